"""The memory level of the feature tier (L2): an LRU of encoder outputs in device memory on a GPU host,
in host memory otherwise, never above its byte cap.

Rows live in slabs allocated as the LRU fills (16 MiB each at most), so a cap of a fifth of a GPU is not
reserved at start; the slabs' total (each sized to what the CUDA allocator counts for it) never exceeds
the cap, and a full LRU reuses its least recently used row. The event loop is the only owner:
lookups, inserts, evictions and purges all happen there.

On a GPU nothing per row touches the device on the event loop:
- a lookup returns the row's number (a DeviceRow) and pins it; the head's batch gathers all its rows in
  its own thread with one index_select per slab (`gather`), and the lookup's owner releases the pin when
  the answer is made (or its caller went away: then only that caller's discarded answer could read a
  reused row). A pinned row is neither evicted nor reused;
- inserts are copied in together: rows wait in host memory until the loop's next iteration, or until a
  lookup wants one of them, then go to the device in one copy in and one index_copy_ per slab (on the
  event loop: a copy from pageable memory waits for the stream). Copies and gathers are queued on the same
  CUDA stream in the order the loop made them, so a gather sees every write before it.
Each key belongs to a namespace (its first bytes are the namespace id, as in every cache key), so a purge
touches only the namespaces it names.
"""

from __future__ import annotations

import asyncio
import math
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Callable

import numpy as np

from cachestore.keys import NS_ID_BYTES

SLAB_BYTES = 16 << 20
# torch's CUDA allocator counts a block of at most 1 MiB rounded up to 512 bytes, and a larger one rounded
# up to 2 MiB (its leftover is not split off): slabs are exact multiples of one or the other.
SMALL_BLOCK, SMALL_ALIGN, LARGE_ALIGN = 1 << 20, 512, 2 << 20


@dataclass(frozen=True, slots=True)
class DeviceRow:
    """A pinned row of a device LRU (see FeatureLRU.get); released with FeatureLRU.release."""

    lru: "FeatureLRU"
    row: int

    def __len__(self) -> int:  # the feature's length, as for a host array (a batcher buckets by it)
        return self.lru.dim


class FeatureLRU:
    def __init__(self, dim: int, dtype: str, cap_bytes: int, device: str | None = None) -> None:
        self.dim = dim
        self.dtype = np.dtype(dtype)
        self.row_bytes = dim * self.dtype.itemsize
        large = LARGE_ALIGN // math.gcd(self.row_bytes, LARGE_ALIGN)  # rows making a multiple of 2 MiB
        if cap_bytes >= large * self.row_bytes:
            unit, slab_bytes = large, max(SLAB_BYTES, large * self.row_bytes)
        else:  # a small cap: slabs of at most 1 MiB, in multiples of 512 bytes
            unit, slab_bytes = SMALL_ALIGN // math.gcd(self.row_bytes, SMALL_ALIGN), SMALL_BLOCK
        self.capacity = max(0, cap_bytes) // self.row_bytes // unit * unit  # rows
        self.slab_rows = max(unit, min(self.capacity, slab_bytes // self.row_bytes) // unit * unit)
        self.device = device  # None: numpy in host memory; else a torch device ("cuda")
        self.counters: Counter[str] = Counter()
        self._slabs: list = []  # appended to on the loop, read by gathers (a list append is atomic)
        self._rows: OrderedDict[bytes, tuple[int, int]] = OrderedDict()  # key -> (row, expires_us or 0),
                                                                        # least recently used first
        self._groups: dict[bytes, tuple[object, set[bytes]]] = {}  # namespace id -> (namespace, its keys)
        self._free: list[int] = []
        self._allocated = 0  # rows in slabs
        self._pins: Counter[int] = Counter()      # device rows that a head batch is about to read
        self._orphans: set[int] = set()           # purged while pinned: free once released
        self._pending: dict[int, np.ndarray] = {}  # device rows not copied in yet
        self._flush_scheduled = False

    @property
    def allocated_bytes(self) -> int:
        return self._allocated * self.row_bytes

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, key: bytes) -> bool:
        return key in self._rows

    def get(self, key: bytes, now_us: int):
        """The key's feature or None (absent, or expired: then dropped): a copy (numpy) in host memory, a
        pinned DeviceRow on a GPU."""
        found = self._rows.get(key)
        if found is None:
            return None
        row, expires = found
        if expires and now_us >= expires:
            self._drop(key)
            return None
        self._rows.move_to_end(key)
        if self.device is None:
            slab, offset = divmod(row, self.slab_rows)
            return self._slabs[slab][offset].copy()
        if row in self._pending:
            self.flush()
        self._pins[row] += 1
        return DeviceRow(self, row)

    def release(self, handle: DeviceRow) -> None:
        row = handle.row
        self._pins[row] -= 1
        if self._pins[row] <= 0:
            del self._pins[row]
            if row in self._orphans:
                self._orphans.discard(row)
                self._free.append(row)

    def put(self, key: bytes, vector: np.ndarray, ns, expires_us: int = 0) -> None:
        """Keeps `vector` (this LRU's dtype and dim) under `key` (which begins with `ns`'s id, as every
        cache key does) until `expires_us` (0: no expiry), evicting the least recently used row when
        full. A key already held only becomes the most recently used (its feature is the same)."""
        if key in self._rows:
            self._rows.move_to_end(key)
            return
        row = self._row()
        if row is None:
            return
        if self.device is None:
            slab, offset = divmod(row, self.slab_rows)
            self._slabs[slab][offset] = vector
        else:
            self._pending[row] = vector
            if not self._flush_scheduled:
                self._flush_scheduled = True
                try:
                    asyncio.get_running_loop().call_soon(self.flush)
                except RuntimeError:  # no loop (a tool, a test): at once
                    self.flush()
        self._rows[key] = (row, expires_us)
        self._groups.setdefault(key[:NS_ID_BYTES], (ns, set()))[1].add(key)

    def flush(self) -> None:
        """Copies the waiting rows to the device: one host-to-device copy, one index_copy_ per slab."""
        self._flush_scheduled = False
        if not self._pending:
            return
        import torch

        rows = np.fromiter(self._pending, dtype=np.int64, count=len(self._pending))
        try:
            order, offsets, spans = self._by_slab(rows)
            values = torch.from_numpy(np.stack([self._pending[int(r)] for r in rows[order]])).to(self.device)
            index = torch.from_numpy(offsets).to(self.device)
            for slab, start, end in spans:
                self._slabs[slab].index_copy_(0, index[start:end], values[start:end])
        except Exception:  # (a device out of memory, ...) those rows are not kept: later lookups miss
            waiting = set(self._pending)
            for key in [key for key, (row, _) in self._rows.items() if row in waiting]:
                self._drop(key)
            self.counters["copy_errors"] += 1
            self._pending.clear()
            raise
        self._pending.clear()

    def gather(self, handles: list[DeviceRow]):
        """[len(handles), dim] on the device, in order (called from the head's batch thread): one copy of
        the row numbers in, one index_select per slab the rows lie in, one reordering if several."""
        import torch

        rows = np.fromiter((h.row for h in handles), dtype=np.int64, count=len(handles))
        order, offsets, spans = self._by_slab(rows)
        if len(spans) == 1:  # one slab: the rows in their own order
            return self._slabs[spans[0][0]].index_select(0, torch.from_numpy(rows - spans[0][0] * self.slab_rows)
                                                         .to(self.device))
        inverse = np.empty_like(order)
        inverse[order] = np.arange(len(order))
        index = torch.from_numpy(np.concatenate([offsets, inverse])).to(self.device)
        parts = [self._slabs[slab].index_select(0, index[start:end]) for slab, start, end in spans]
        return torch.cat(parts).index_select(0, index[len(rows):])

    def _by_slab(self, rows: np.ndarray):
        """rows grouped by slab: (the order that groups them, their offsets in that order, and (slab,
        start, end) of each group)."""
        slabs = rows // self.slab_rows
        order = np.argsort(slabs, kind="stable")
        grouped = slabs[order]
        offsets = rows[order] - grouped * self.slab_rows
        cuts = np.flatnonzero(np.diff(grouped)) + 1
        starts, ends = np.concatenate([[0], cuts]), np.concatenate([cuts, [len(rows)]])
        return order, offsets, [(int(grouped[a]), int(a), int(b)) for a, b in zip(starts, ends)]

    def purge(self, doomed: Callable[[object], bool]) -> int:
        """Drops the features of every namespace for which doomed(namespace) is true; their rows are free
        again (a pinned one once its reader releases it). Touches only the namespaces' own keys."""
        keys = [key for ns, members in self._groups.values() if doomed(ns) for key in members]
        for key in keys:
            self._drop(key)
        self.counters["purged"] += len(keys)
        return len(keys)

    def _drop(self, key: bytes) -> None:
        row, _ = self._rows.pop(key)
        self._ungroup(key)
        self._pending.pop(row, None)
        if row in self._pins:
            self._orphans.add(row)
        else:
            self._free.append(row)

    def _ungroup(self, key: bytes) -> None:
        group = self._groups.get(key[:NS_ID_BYTES])
        if group is not None:
            group[1].discard(key)
            if not group[1]:
                del self._groups[key[:NS_ID_BYTES]]

    def _row(self) -> int | None:
        if self._free:
            return self._free.pop()
        if self._allocated < self.capacity:
            rows = min(self.slab_rows, self.capacity - self._allocated)
            self._slabs.append(self._new_slab(rows))
            self._free.extend(range(self._allocated + rows - 1, self._allocated - 1, -1))
            self._allocated += rows
            return self._free.pop()
        for _ in range(len(self._rows)):  # the least recently used row nobody is reading
            key, (row, expires) = self._rows.popitem(last=False)
            if row not in self._pins:
                self._ungroup(key)
                self._pending.pop(row, None)
                self.counters["evicted"] += 1
                return row
            self._rows[key] = (row, expires)  # pinned: it stays, as the most recently used
        return None  # a cap below one row, or every row being read: not kept

    def _new_slab(self, rows: int):
        # Every slab has slab_rows rows of address space (the last may hold fewer), so a row's slab is
        # row // slab_rows; only `rows` of them are allocated.
        if self.device:
            import torch

            return torch.empty((rows, self.dim), dtype=getattr(torch, self.dtype.name), device=self.device)
        return np.empty((rows, self.dim), dtype=self.dtype)
