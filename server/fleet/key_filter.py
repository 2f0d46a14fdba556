"""The pod's Bloom filter of the keys the fleet holds: a miss nobody computed skips the fleet lookup.

Without it a frontend's miss costs a Redis round trip (GET) before its worker takes the key's lease and
the model runs. With it the frontend asks the filter first and looks up only the keys it may hold.

- One file per pod (`fleet-keys.bloom` in the server's socket folder), written by one process (worker 0:
  `Owner`), memory-mapped read-only by every frontend (`Reader`). Header, then m bits.
- What feeds it: every pod's workers publish digests of the fleet keys they write (`<prefix>:keys`, one
  message per write pipeline); the owner, subscribed, sets their bits. Every `fleet.key_filter_refresh_s`
  it rebuilds the filter from a SCAN of the fleet's keys, which also drops expired and invalidated ones.
  The fleet key (generations.py) carries the namespace's generation sum, so an invalidated entry is
  absent from the filter's point of view at once.
- The owner stamps the header every second while it is subscribed and has built the filter once;
  readers use the filter only while the stamp is fresh (`STALE_S`). Otherwise they look up as if there
  were no filter.

What each error costs, and which the design allows:
- A false positive (a key the fleet does not hold, bits set by others): one GET that finds nothing, as
  without the filter. Allowed, at the configured rate (`fleet.key_filter_fp` at `fleet.key_filter_keys`
  keys; more keys than that raise it).
- A false negative (a key the fleet holds, not yet in the filter: written by another pod less than a
  broadcast ago, or while this pod's subscription was down, before the next rebuild): the frontend skips
  its GET. The worker's lease step (TAKE, tier.py) still finds the record, so a request that stores
  answers RESULT_FLEET with no recompute; a NO_STORE request, which takes no lease, computes once.
  Allowed, only in those windows: a lost subscription makes the filter stale until a rebuild.
  ONLY_IF_CACHED requests never ask the filter (no model run waits behind their lookup, and a false
  negative would refuse them).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import mmap
import os
import struct
import time
from collections import Counter
from pathlib import Path

import numpy as np

log = logging.getLogger("infercache.fleet")

FILE_NAME = "fleet-keys.bloom"
MAGIC = b"icbloom1"
HEADER = struct.Struct("<8sQIIq")  # magic, m (bits), k (hashes), unused, stamp (unix microseconds; 0 = not ready)
STAMP_OFFSET = 24
STALE_S = 3.0       # a stamp older than this: the owner is gone or not subscribed; readers look up everything
STAMP_EVERY_S = 1.0
RETRY_S = 0.5
SCAN_COUNT = 1000
_MASK = (1 << 64) - 1


def sized(keys: int, fp_rate: float) -> tuple[int, int]:
    """(m bits, k hashes) of a filter for `keys` keys at false-positive rate `fp_rate`."""
    m = max(64, math.ceil(-keys * math.log(fp_rate) / math.log(2) ** 2))
    return m, max(1, round(m / keys * math.log(2)))


def digest(name: str) -> bytes:
    """16 bytes of a fleet key's name: what is published and what the positions derive from."""
    return hashlib.blake2b(name.encode(), digest_size=16, person=b"icache-bloom").digest()


def positions(raw: bytes, m: int, k: int) -> list[int]:
    h1, h2 = int.from_bytes(raw[:8], "little"), int.from_bytes(raw[8:], "little") | 1
    return [((h1 + i * h2) & _MASK) % m for i in range(k)]


def _positions_many(digests: np.ndarray, m: int, k: int) -> np.ndarray:
    """positions() of an (n, 16) uint8 array of digests, flattened (uint64 arithmetic wraps as _MASK does)."""
    halves = digests.view("<u8").reshape(-1, 2)
    h1, h2 = halves[:, 0:1], halves[:, 1:2] | np.uint64(1)
    with np.errstate(over="ignore"):
        return ((h1 + np.arange(k, dtype=np.uint64)[None, :] * h2) % np.uint64(m)).ravel()


class Bits:
    """A filter's bits (numpy): in memory as the owner builds them, or `array`, a view of its file."""

    def __init__(self, m: int, k: int, array: np.ndarray | None = None) -> None:
        self.m, self.k = m, k
        self.array = np.zeros((m + 7) // 8, dtype=np.uint8) if array is None else array

    def add(self, digests: bytes) -> int:
        """Sets the bits of concatenated 16-byte digests; how many digests."""
        if not digests:
            return 0
        found = np.frombuffer(digests, dtype=np.uint8).reshape(-1, 16)
        where = _positions_many(found, self.m, self.k)
        np.bitwise_or.at(self.array, (where >> np.uint64(3)).astype(np.intp),
                         (np.uint8(1) << (where & np.uint64(7)).astype(np.uint8)))
        return len(found)

    def may_hold(self, raw: bytes) -> bool:
        array = self.array
        return all(array[p >> 3] >> (p & 7) & 1 for p in positions(raw, self.m, self.k))


class Reader:
    """A frontend's view of the pod's filter file (read-only map; re-mapped when the owner replaces it)."""

    def __init__(self, path: Path, counters: Counter) -> None:
        self.path = path
        self.counters = counters
        self._map: mmap.mmap | None = None
        self._inode = None
        self._m = self._k = 0
        self._check_at = 0.0
        self._usable = False

    def absent(self, name: str) -> bool:
        """True only when the filter is usable and says the fleet does not hold `name`."""
        now = time.monotonic()
        if now >= self._check_at:
            self._check(now)
        if not self._usable:
            return False
        view = self._map
        for p in positions(digest(name), self._m, self._k):
            if not view[HEADER.size + (p >> 3)] >> (p & 7) & 1:
                return True
        return False

    def _check(self, now: float) -> None:
        """Every half second: the file the owner has in place (re-mapped when replaced), and its stamp."""
        self._check_at = now + 0.5
        try:
            inode = os.stat(self.path).st_ino
            if inode != self._inode:
                with open(self.path, "rb") as f:
                    mapped = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
                magic, m, k, _, _ = HEADER.unpack_from(mapped)
                if magic != MAGIC or len(mapped) < HEADER.size + (m + 7) // 8:
                    raise ValueError("not a filter file")
                if self._map is not None:
                    self._map.close()
                self._map, self._inode, self._m, self._k = mapped, inode, m, k
            stamp = struct.unpack_from("<q", self._map, STAMP_OFFSET)[0]
            self._usable = stamp > 0 and time.time() - stamp / 1e6 < STALE_S
        except (OSError, ValueError, struct.error):
            self._usable = False
        self.counters["key_filter_usable"] = int(self._usable)

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None


class Owner:
    """Worker 0's writer of the pod's filter file: follows the key broadcasts, rebuilds from a SCAN,
    stamps the header. Runs on the worker's event loop; the file has no other writer."""

    def __init__(self, path: Path, gens, redis_url: str, link, keys: int, fp_rate: float,
                 refresh_s: float, counters: Counter) -> None:
        """gens: the tier's NamespaceGenerations (generations.py), which names the channel and the keys."""
        self.path = path
        self.channel = gens.keys_channel
        self.pattern = gens.value_pattern
        self.redis_url = redis_url
        self.link = link            # the tier's client (link.py): SCANs go through it
        self.m, self.k = sized(keys, fp_rate)
        self.refresh_s = refresh_s
        self.counters = counters
        self._map: mmap.mmap | None = None
        self._live: Bits | None = None  # the bits of the file in place (a view of its map)
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())
        log.info("fleet key filter: %d bits, %d hashes (%.1f MiB) in %s", self.m, self.k,
                 (self.m / 8) / (1 << 20), self.path)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._stamp(0)
        self._live = None
        if self._map is not None:
            self._map.close()

    def heard(self, digests: bytes) -> None:
        """A pod's broadcast of the keys it wrote."""
        if len(digests) % 16:
            self.counters["key_filter_unreadable"] += 1
            return
        if self._live is not None:
            self.counters["key_filter_added"] += self._live.add(digests)

    async def _run(self) -> None:
        from server.fleet.link import subscribed

        attempt = 0
        while True:
            try:
                async with subscribed(self.redis_url, self.channel, attempt, RETRY_S * 2) as pubsub:
                    await self._rebuild()  # after subscribing: no broadcast from here on is missed
                    loop = asyncio.get_running_loop()
                    rebuild_at = stamp_at = loop.time()
                    while True:
                        if loop.time() >= stamp_at:
                            self._stamp(time.time_ns() // 1000)
                            stamp_at = loop.time() + STAMP_EVERY_S
                        message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=STAMP_EVERY_S / 2)
                        if message is not None and message.get("type") == "message":
                            self.heard(message["data"])
                        if loop.time() - rebuild_at >= self.refresh_s:
                            await self._rebuild()
                            rebuild_at = stamp_at = loop.time()  # (a new file starts unstamped)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._stamp(0)  # readers look everything up until the filter is whole again
                self.counters["key_filter_resubscribes"] += 1
                log.warning("fleet key filter: %r; not used until it is rebuilt", exc)
                attempt += 1
                await asyncio.sleep(RETRY_S)

    async def _rebuild(self) -> None:
        """A new filter of every fleet key (SCAN), then in place of the old. Broadcasts that arrive
        meanwhile wait in the subscription and are added to the new one."""
        started = time.monotonic()
        fresh = Bits(self.m, self.k)
        count = 0
        batch: list[bytes] = []
        async for name in self.link.redis.scan_iter(match=self.pattern, count=SCAN_COUNT):
            batch.append(digest(name.decode() if isinstance(name, bytes) else name))
            if len(batch) >= SCAN_COUNT:
                count += fresh.add(b"".join(batch))
                batch = []
        count += fresh.add(b"".join(batch))
        fill = await asyncio.to_thread(self._write, fresh.array)  # (a large filter's file: off the loop)
        self._map_file()
        self.counters["key_filter_rebuilds"] += 1
        self.counters["key_filter_keys_scanned"] = count
        # (past about half, the filter holds more keys than it was sized for: its false positives grow)
        self.counters["key_filter_fill_permille"] = fill
        log.debug("fleet key filter rebuilt from %d keys in %.2f s", count, time.monotonic() - started)

    def _write(self, array: np.ndarray) -> int:
        """The new file, renamed into place (readers re-map it); its bits set, per thousand."""
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(HEADER.pack(MAGIC, self.m, self.k, 0, 0))
            f.write(array.tobytes())
        os.chmod(tmp, 0o600)
        os.replace(tmp, self.path)
        return int(1000 * np.unpackbits(array).mean())

    def _map_file(self) -> None:
        """Maps the file in place, whose bits `heard` sets from now on."""
        with open(self.path, "r+b") as f:
            mapped = mmap.mmap(f.fileno(), 0)
        old, self._map = self._map, mapped
        self._live = Bits(self.m, self.k, np.frombuffer(mapped, dtype=np.uint8, offset=HEADER.size))
        if old is not None:  # (its view went with the old Bits)
            old.close()

    def _stamp(self, value: int) -> None:
        if self._map is not None:
            struct.pack_into("<q", self._map, STAMP_OFFSET, value)
