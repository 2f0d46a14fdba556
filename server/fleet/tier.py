"""The fleet tier of one process: lookups, write-behind, leases, invalidation (see __init__.py).

A frontend looks an L1 miss up here (`get`) before sending it to a worker; a worker uses the rest
(server/worker/core.py):

1. `get`: the entry under its current fleet key (generations.py); a fresh record is the answer, and the
   key's worker copies it into L1 (read-through). A worker looks itself only when the frontend did not.
2. `claim`: a miss that will be stored takes a lease (SET NX PX). If another pod holds it, `wait` polls
   for that pod's result and, when its lease lapsed without one (the pod died), takes the lease over:
   one waiter computes instead of all of them. The wait is bounded (`fleet.lease_wait_s`).
3. `put`: a computed result goes to Redis behind the reply, in pipelined batches, with the entry's
   remaining TTL (which cache.ttl_jitter spread when the record was made; fleet.ttl_jitter may take a
   further share) as its expiry; the lease is dropped in the same pipeline. Each pipeline's keys are
   then published for the pods' key filters (key_filter.py).

Invalidations bump a generation (or delete one key) and are broadcast; every pod's subscription
(`_follow`) advances its generations and purges the same range from its own L1. A pod that was
disconnected re-reads the whole generations hash when it reconnects (and every `fleet.refresh_s`), and
purges whatever grew meanwhile. While it is not subscribed, the tier is not used at all: without the
broadcasts it could serve an entry another pod has invalidated.

Lookups, claims and the polls of a wait are pipelined: what is asked while a pipeline is out goes
together in the next one, one pipeline in flight at a time, on one warm connection. At 32 callers that
is one round trip for many lookups (measured: one pipeline per connection per lookup set up new
connections inside the budget, and under load missed it).

Every failure is a miss: a pipeline not answered within `fleet.timeout_ms` of leaving answers nothing
(so a lookup waits for at most the budget of the pipeline ahead of it and its own), and the breaker
(link.py) keeps a failing Redis off the request path. A late pipeline is not cancelled (that would tear
its connection down mid-reply): it finishes in the background while the next one leaves. Counters (GetStats group "fleet") are
written on this process's event loop only.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
from collections import Counter
from pathlib import Path
from typing import Callable

from cachestore import records
from cachestore.errors import CorruptRecord
from cachestore.keys import Namespace, Selector
from cachestore.records import Record
from cachestore.sealing import KeyRing
from cachestore.results import now_us
from server.config import Config, FleetSection
from server.fleet import generations, key_filter
from server.fleet.generations import NamespaceGenerations, ns_hex
from server.fleet.link import FleetUnavailable, Link, describe, subscribed

log = logging.getLogger("infercache.fleet")

WRITE_BATCH = 128          # operations per pipeline
MAX_PENDING = 20_000       # queued writes beyond this are dropped (counted): Redis is not keeping up
ADMIN_BUDGET_S = 1.0       # an invalidation is an administrator's call: it may wait longer than a lookup
RESYNC_BUDGET_S = 1.0
RETRY_S = 0.5              # between attempts to re-subscribe
POLL_FIRST_S, POLL_MAX_S = 0.002, 0.02
# A lease is dropped only by its holder: another pod may hold the key's lease by now (it lapsed and was
# taken over, or this pod's claim timed out after Redis took it).
RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"
# The record if it is there, else the lease if it is free, in one step: a pod that looked before the
# holder wrote and claims after it released must find the record, not a free lease. (Both keys share a
# hash tag: one slot.)
TAKE = """local v = redis.call('get', KEYS[1])
if v then return {1, v} end
if redis.call('set', KEYS[2], ARGV[1], 'NX', 'PX', ARGV[2]) then return {2} end
return {0}"""


def start(config: Config, purge: Callable[[Selector], object] | None = None, state_path: Path | None = None,
          filter_dir: Path | None = None, filter_role: str = "") -> FleetTier | None:
    """The tier of this process when `fleet.redis` is set (None otherwise), started on the running loop.
    With fleet.key_filter_keys, the pod's key filter in `filter_dir` (key_filter.py): filter_role
    "reader" (a frontend: lookups ask it first) or "owner" (worker 0: keeps it); every worker publishes
    the keys it writes."""
    if not config.fleet.redis:
        return None
    tier = FleetTier(config.fleet, KeyRing(config.secrets.keys) if config.secrets.keys else None, purge, state_path)
    tier.start()
    if config.fleet.key_filter_keys and filter_dir is not None:
        path = filter_dir / key_filter.FILE_NAME
        if filter_role == "reader":
            tier.filter = key_filter.Reader(path, tier.counters)
        else:
            tier.publishing = True
            if filter_role == "owner":
                s = config.fleet
                tier.filter_owner = key_filter.Owner(path, tier.gens, s.redis, tier.link, s.key_filter_keys,
                                                     s.key_filter_fp, s.key_filter_refresh_s, tier.counters)
                tier.filter_owner.start()
    return tier


class FleetTier:
    def __init__(self, settings: FleetSection, ring: KeyRing | None,
                 purge: Callable[[Selector], object] | None = None, state_path: Path | None = None) -> None:
        """purge: removes a selector's entries from this host's L1 and fences its writer against entries
        created before (each worker, since each writes through its own writer). state_path: where one
        worker keeps the generations applied, so that after a restart it purges what was invalidated
        while it was down."""
        self.settings = settings
        self.ring = ring
        self.purge = purge
        self.state_path = state_path
        self.origin = os.urandom(8).hex()  # this process, in broadcasts: its own are not applied twice
        self.counters: Counter[str] = Counter()
        self.gens = NamespaceGenerations(settings.prefix)
        self.ready = False                 # subscribed and generations read: the tier may be used
        self.link: Link | None = None
        self.pending: list[tuple] = []
        self._flusher: asyncio.Task | None = None
        self._follower: asyncio.Task | None = None
        self._registered: set[str] = set()  # namespaces written to <prefix>:ns by this process
        self._asked: list[tuple[str, tuple, dict, asyncio.Future]] = []  # commands for the next pipeline
        self._sending = False                # a pipeline is out
        self._sender: asyncio.Task | None = None
        self._known = False  # generations known from before (a file, or a sync): changes since are purged
        self.filter: key_filter.Reader | None = None       # a frontend's view of the pod's key filter
        self.filter_owner: key_filter.Owner | None = None  # worker 0 keeps it
        self.publishing = False  # workers: each write pipeline publishes the keys it wrote (key_filter.py)

    # ---- life ----------------------------------------------------------------------------------------

    def start(self) -> None:
        s = self.settings
        self.link = Link(s.redis, timeout_s=s.timeout_ms / 1000, failures=s.breaker_failures,
                         open_s=s.breaker_open_s, counters=self.counters, probe_key=self.gens.hash_key)
        if self.state_path is not None:
            try:
                self.gens.replace({k: int(v) for k, v in json.loads(self.state_path.read_text()).items()})
                self._known = True
            except (OSError, ValueError, AttributeError):
                pass  # first start, or an unreadable file: nothing to compare with
        self._follower = asyncio.get_running_loop().create_task(self._follow())
        log.info("fleet tier on %s (prefix %r)", describe(s.redis), s.prefix)

    @property
    def usable(self) -> bool:
        return self.ready and not self.link.open

    async def close(self, timeout: float = 2.0) -> None:
        """Sends what is queued (bounded), then stops."""
        if self._flusher is not None and not self._flusher.done():
            try:
                async with asyncio.timeout(timeout):
                    await asyncio.shield(self._flusher)
            except (TimeoutError, Exception):
                pass
        if self._follower is not None:
            self._follower.cancel()
            await asyncio.gather(self._follower, return_exceptions=True)
        if self.filter_owner is not None:
            await self.filter_owner.close()
        if self.filter is not None:
            self.filter.close()
        if self.link is not None:
            await self.link.close()

    # ---- the request path ------------------------------------------------------------------------------

    def _ask(self, command: str, *args, **kwargs) -> asyncio.Future:
        """`command` in the next pipeline; its future holds the reply, or FleetUnavailable once the budget
        has passed (or at once while the breaker is open)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        if self.link.open:
            self.counters["skipped_breaker_open"] += 1
            future.set_exception(FleetUnavailable("breaker open"))
            return future
        self._asked.append((command, args, kwargs, future))
        if not self._sending:
            self._sending = True
            self._sender = loop.create_task(self._send_asked())  # next turn: this turn's commands join it
        return future

    async def _send_asked(self) -> None:
        """Pipelines of what was asked, one out at a time; one that runs past its budget is left to finish
        in the background (link.py), so what was asked meanwhile waits at most that budget before leaving."""
        try:
            while self._asked:
                batch, self._asked = self._asked, []
                pipe = self.link.redis.pipeline(transaction=False)
                for command, args, kwargs, _ in batch:
                    getattr(pipe, command)(*args, **kwargs)
                try:
                    replies = await self.link.call(pipe.execute, raise_on_error=False)
                    self.counters["pipelines"] += 1
                except FleetUnavailable as exc:
                    replies = [exc] * len(batch)
                if len(replies) != len(batch):  # never seen; no lookup may wait for an answer that cannot come
                    replies = [FleetUnavailable(f"{len(replies)} replies to {len(batch)} commands")] * len(batch)
                for (*_, future), reply in zip(batch, replies):
                    if future.done():  # its flight was cancelled
                        continue
                    if isinstance(reply, Exception):
                        future.set_exception(reply if isinstance(reply, FleetUnavailable) else FleetUnavailable(repr(reply)))
                    else:
                        future.set_result(reply)
        finally:
            self._sending = False

    async def get(self, key: bytes, ns: Namespace, max_age_us: int | None, filtered: bool = True) -> Record | None:
        """The fresh record of `key` in the fleet, or None (absent, stale, unreadable, or Redis failing, or
        the pod's key filter rules it out: no round trip). filtered=False: looked up whatever the filter
        says (ONLY_IF_CACHED, where no model run waits behind the lookup and a miss is an error)."""
        name = self.gens.value_key(key, ns)
        if filtered and self.filter is not None and self.filter.absent(name):
            self.counters["key_filter_skipped"] += 1
            return None
        try:
            raw = await self._ask("get", name)
        except FleetUnavailable:
            return None
        return self._record(key, raw, max_age_us, "misses")

    def _record(self, key: bytes, raw: bytes | None, max_age_us: int | None, absent: str) -> Record | None:
        if raw is None:
            self.counters[absent] += 1
            return None
        try:
            record = records.decode(raw, key, self.ring)
        except CorruptRecord:
            self.counters["unreadable"] += 1
            return None
        if not record.is_fresh(now_us(), max_age_us):
            self.counters["stale"] += 1
            return None
        self.counters["hits"] += 1
        return record

    async def _take(self, key: bytes, ns: Namespace, max_age_us: int | None) -> tuple[Record | None, bool | None]:
        """One atomic step (TAKE): the key's record if it is there, else its lease if that is free.
        (record, False): answered; (None, True): this pod holds the lease now; (None, False): another pod
        holds it; (None, None): Redis failed, or the record is too old for this request (compute; the
        caller releases as if it held the lease, which only its holder can)."""
        try:
            reply = await self._ask("eval", TAKE, 2, self.gens.value_key(key, ns), self.gens.lease_key(key, ns),
                                    self.origin, self.settings.lease_ms)
        except FleetUnavailable:
            return None, None
        if reply[0] == 1:
            record = self._record(key, reply[1], max_age_us, "misses")
            return (record, False) if record is not None else (None, None)
        return None, reply[0] == 2

    async def claim(self, key: bytes, ns: Namespace, max_age_us: int | None) -> tuple[Record | None, bool | None]:
        """Before computing a miss: the record if it landed meanwhile, else the lease (see `_take`)."""
        record, taken = await self._take(key, ns, max_age_us)
        if taken is not None:
            self.counters["leases_taken" if taken else "leases_busy"] += 1
        return record, taken

    async def wait(self, key: bytes, ns: Namespace, max_age_us: int | None, bound_s: float
                   ) -> tuple[Record | None, bool | None]:
        """While another pod computes `key`: (its record, False) once it is written, or (None, took) when
        this pod computes after all; took: its lease lapsed and this pod holds it now (None: Redis failed,
        so it may)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + bound_s
        delay = POLL_FIRST_S
        while loop.time() + delay < deadline:
            await asyncio.sleep(delay)
            delay = min(2 * delay, POLL_MAX_S)
            record, took = await self._take(key, ns, max_age_us)
            if record is not None:
                self.counters["lease_wait_hits"] += 1
                return record, False
            if took is not False:
                self.counters["lease_takeovers" if took else "lease_wait_failures"] += 1
                return None, took
        self.counters["lease_wait_timeouts"] += 1
        return None, False

    def put(self, key: bytes, ns: Namespace, record: Record, release: bool) -> None:
        """Queues a computed record for the fleet (and, with `release`, drops this pod's lease)."""
        lease_key = self.gens.lease_key(key, ns) if release else None
        remaining_ms = (record.expires_us - now_us()) // 1000 if record.expires_us else None
        if remaining_ms is not None and remaining_ms <= 0:
            self._queue(("release", lease_key)) if lease_key else None
            return
        expiry_ms = None
        if remaining_ms is not None:
            expiry_ms = max(1, remaining_ms - int(remaining_ms * random.uniform(0, self.settings.ttl_jitter)))
        hex_ns = ns_hex(key)
        register = None if hex_ns in self._registered else (hex_ns, ns.to_json())
        name = self.gens.value_key(key, ns)
        self._queue(("set", name, records.encode(record, key, self.ring), expiry_ms, lease_key, register))

    def release(self, key: bytes, ns: Namespace) -> None:
        """Drops this pod's lease on a key it will not write (the computation failed, or was not stored)."""
        self._queue(("release", self.gens.lease_key(key, ns)))

    def _queue(self, op: tuple) -> None:
        if len(self.pending) >= MAX_PENDING:
            self.counters["writes_dropped"] += 1
            return
        self.pending.append(op)
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.get_running_loop().create_task(self._flush())

    async def _flush(self) -> None:
        """Pipelines of queued writes, one at a time, until the queue is empty."""
        while self.pending:
            await asyncio.sleep(0)  # the replies of this loop turn leave first
            batch, self.pending = self.pending[:WRITE_BATCH], self.pending[WRITE_BATCH:]
            pipe = self.link.redis.pipeline(transaction=False)
            registered, written = [], []
            for op in batch:
                if op[0] == "release":
                    pipe.eval(RELEASE, 1, op[1], self.origin)
                    continue
                _, value_key, value, expiry_ms, lease_key, register = op
                pipe.set(value_key, value, px=expiry_ms)
                if self.publishing:
                    written.append(key_filter.digest(value_key))
                if lease_key is not None:
                    pipe.eval(RELEASE, 1, lease_key, self.origin)
                if register is not None:
                    pipe.hsetnx(self.gens.namespaces_key, *register)
                    registered.append(register[0])
            try:
                await self.link.call(pipe.execute, budget=self.settings.write_timeout_ms / 1000)
            except FleetUnavailable:
                self.counters["writes_dropped"] += len(batch)
                continue
            self.counters["writes"] += len(batch)
            self._registered.update(registered)
            if written:  # once the SETs are done: a pod hears of a key once it is there (a cluster
                try:     # pipeline cannot carry a PUBLISH)
                    await self.link.call(self.link.redis.publish, self.gens.keys_channel, b"".join(written),
                                         budget=self.settings.write_timeout_ms / 1000)
                except FleetUnavailable:  # those keys reach the other pods' filters at their next rebuild
                    self.counters["key_broadcasts_dropped"] += 1

    # ---- invalidation ------------------------------------------------------------------------------------

    async def invalidate(self, selector: Selector) -> None:
        """Fleet-wide: one key deleted, or the selector's generation bumped; broadcast to every pod.
        FleetUnavailable when Redis cannot be reached (this host's L1 is already purged by then)."""
        redis, gens = self.link.redis, self.gens
        if selector.key is not None:
            key = selector.key
            known = await self.link.call(redis.hget, gens.namespaces_key, ns_hex(key), budget=ADMIN_BUDGET_S,
                                         force=True)
            if known is not None:  # else it was never written to the fleet
                ns = Namespace.from_json(known)
                await self.link.call(redis.delete, gens.value_key(key, ns), gens.lease_key(key, ns),
                                     budget=ADMIN_BUDGET_S, force=True)
            message = {"o": self.origin, "k": key.hex()}
        else:
            name = generations.field(selector.tenant, selector.model, selector.version)
            gen = await self.link.call(redis.hincrby, gens.hash_key, name, 1, budget=ADMIN_BUDGET_S, force=True)
            if gens.advance(name, int(gen)):
                await self._save()
            message = {"o": self.origin, "f": name, "g": int(gen)}
        await self.link.call(redis.publish, gens.channel, json.dumps(message), budget=ADMIN_BUDGET_S, force=True)
        self.counters["invalidations_sent"] += 1

    # ---- following the other pods' invalidations ------------------------------------------------------------

    async def _follow(self) -> None:
        """Subscribed to the broadcasts; the generations re-read after each (re)connection and every
        refresh_s. `ready` only while subscribed."""
        loop = asyncio.get_running_loop()
        attempt = 0
        while True:
            try:
                async with subscribed(self.settings.redis, self.gens.channel, attempt, RESYNC_BUDGET_S) as pubsub:
                    await self._resync()  # after subscribing: nothing published from here on is missed
                    if not self.ready:
                        log.info("fleet tier subscribed; generations of %d selectors", len(self.gens.values))
                    self.ready = True
                    refresh_at = loop.time() + self.settings.refresh_s
                    while True:
                        wait = max(0.0, min(1.0, refresh_at - loop.time()))
                        message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=wait)
                        if message is not None and message.get("type") == "message":
                            await self._on_broadcast(message["data"])
                        if loop.time() >= refresh_at:
                            await self._resync()
                            refresh_at = loop.time() + self.settings.refresh_s
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if self.ready:
                    log.warning("fleet tier: invalidation channel lost (%r); not used until it is back", exc)
                self.ready = False
                self.counters["resubscribes"] += 1
                attempt += 1
                await asyncio.sleep(RETRY_S)

    async def _resync(self) -> None:
        async with asyncio.timeout(RESYNC_BUDGET_S):
            raw = await self.link.redis.hgetall(self.gens.hash_key)
        changed = self.gens.replace({k.decode(): int(v) for k, v in raw.items()})
        self.counters["resyncs"] += 1
        if not self._known:  # the first sync of a process without a file: a baseline, nothing to undo
            self._known = True
            await self._save()
            return
        if changed:
            self.counters["generations_caught_up"] += len(changed)
            for name in changed:
                self._purge(generations.selector(name))
            await self._save()

    async def _on_broadcast(self, data: bytes) -> None:
        try:
            message = json.loads(data)
            origin, name, gen, key = message.get("o"), message.get("f"), int(message.get("g", 0)), message.get("k")
            selector = generations.selector(name) if name else Selector(key=bytes.fromhex(key))
        except (ValueError, TypeError, AttributeError):  # not ours: another writer on the channel
            self.counters["broadcasts_unreadable"] += 1
            return
        self.counters["broadcasts_received"] += 1
        if name:
            if self.gens.advance(name, gen):
                if origin != self.origin:
                    self._purge(selector)
                await self._save()
        elif origin != self.origin:
            self._purge(selector)

    def _purge(self, selector: Selector) -> None:
        if self.purge is not None:
            self.purge(selector)
            self.counters["l1_purges"] += 1

    async def _save(self) -> None:
        """The generations this host's L1 reflects (the purging worker only)."""
        if self.state_path is None or self.purge is None:
            return
        path, text = self.state_path, json.dumps(self.gens.values)

        def write() -> None:
            tmp = path.with_suffix(".tmp")
            tmp.write_text(text)
            tmp.replace(path)

        try:
            await asyncio.to_thread(write)
        except OSError as exc:
            log.warning("fleet tier: cannot keep the generations in %s: %s", path, exc)
