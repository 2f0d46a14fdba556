"""The memory level of the feature tier (L2): an LRU of encoder outputs in device memory on a GPU host,
in host memory otherwise, never above its byte cap.

Rows live in slabs allocated as the LRU fills (16 MiB each at most), so a cap of a fifth of a GPU is not
reserved at start; the slabs' total (each a multiple of the CUDA allocator's 512-byte rounding) never
exceeds the cap, and a full LRU reuses its least recently used
row. The event loop is the only user: lookups, inserts, evictions and purges all happen there.

On a GPU a lookup returns a copy of the row, queued on the device's stream and not waited for. A row
evicted and overwritten later is overwritten after that copy on the same stream, so a head batch that
reads the copy in its own thread never sees a row that changed under it.
"""

from __future__ import annotations

import math
from collections import Counter, OrderedDict
from typing import Callable

import numpy as np

SLAB_BYTES = 16 << 20
ALIGN = 512  # torch's CUDA allocator rounds every block up to a multiple of this: slabs are made of it


class FeatureLRU:
    def __init__(self, dim: int, dtype: str, cap_bytes: int, device: str | None = None) -> None:
        self.dim = dim
        self.dtype = np.dtype(dtype)
        self.row_bytes = dim * self.dtype.itemsize
        unit = ALIGN // math.gcd(self.row_bytes, ALIGN)  # rows whose bytes are a multiple of ALIGN
        self.capacity = max(0, cap_bytes) // self.row_bytes // unit * unit  # rows
        self.slab_rows = max(unit, min(self.capacity, SLAB_BYTES // self.row_bytes) // unit * unit)
        self.device = device  # None: numpy in host memory; else a torch device ("cuda")
        self.counters: Counter[str] = Counter()
        self._slabs: list = []
        self._rows: OrderedDict[bytes, int] = OrderedDict()  # key -> row, least recently used first
        self._free: list[int] = []
        self._allocated = 0  # rows in slabs

    @property
    def allocated_bytes(self) -> int:
        return self._allocated * self.row_bytes

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, key: bytes) -> bool:
        return key in self._rows

    def get(self, key: bytes):
        """A copy of the key's feature (numpy, or a torch tensor on the device), or None."""
        row = self._rows.get(key)
        if row is None:
            return None
        self._rows.move_to_end(key)
        slab, offset = divmod(row, self.slab_rows)
        return self._slabs[slab][offset].clone() if self.device else self._slabs[slab][offset].copy()

    def put(self, key: bytes, vector: np.ndarray) -> None:
        """Keeps `vector` (this LRU's dtype and dim) under `key`, evicting the least recently used row
        when full. A key already held only becomes the most recently used (its feature is the same)."""
        if key in self._rows:
            self._rows.move_to_end(key)
            return
        row = self._row()
        if row is None:
            return
        slab, offset = divmod(row, self.slab_rows)
        if self.device:
            import torch

            self._slabs[slab][offset].copy_(torch.from_numpy(np.require(vector, requirements="W")))
        else:
            self._slabs[slab][offset] = vector
        self._rows[key] = row

    def purge(self, doomed: Callable[[bytes], bool]) -> int:
        """Drops every key for which doomed(key) is true; their rows are free again."""
        keys = [key for key in self._rows if doomed(key)]
        for key in keys:
            self._free.append(self._rows.pop(key))
        self.counters["purged"] += len(keys)
        return len(keys)

    def _row(self) -> int | None:
        if self._free:
            return self._free.pop()
        if self._allocated < self.capacity:
            rows = min(self.slab_rows, self.capacity - self._allocated)
            self._slabs.append(self._new_slab(rows))
            self._free.extend(range(self._allocated + rows - 1, self._allocated - 1, -1))
            self._allocated += rows
            return self._free.pop()
        if not self._rows:
            return None  # a cap below one row: the LRU holds nothing
        _, row = self._rows.popitem(last=False)
        self.counters["evicted"] += 1
        return row

    def _new_slab(self, rows: int):
        # Every slab has slab_rows rows of address space (the last may hold fewer), so a row's slab is
        # row // slab_rows; only `rows` of them are allocated.
        if self.device:
            import torch

            return torch.empty((rows, self.dim), dtype=getattr(torch, self.dtype.name), device=self.device)
        return np.empty((rows, self.dim), dtype=self.dtype)
