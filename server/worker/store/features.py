"""The feature tier (L2): encoder outputs that head models read, kept so that a miss runs only the head.

A feature is keyed by what decides it: the encoder model, version and output, and the normalized text
(the frontend derives the key, so it can look a feature up without tokenizing), namespaced by tenant
("t:<tenant>") unless the head model's config shares features across tenants ("*"). So a new head
version (new labels, same encoder) finds every feature its predecessor computed, and a new encoder
version finds none of the old ones.

Two levels, looked up in order:
- memory: an LRU on the worker's GPU (`l2.device_fraction` of the GPU's memory, shared by the workers on
  it), or in host memory on a CPU host (`l2.memory_mb`): server/worker/store/feature_lru.py;
- the host's LMDB feature store (`<cache.dir>/features`, its own TTL and byte budget, written behind by
  a writer process like the result store's, shared by every worker of the host, surviving restarts).
A level that fails (a corrupt or unsealable record, an unreadable store) is a miss.

A feature is stored in FP16 when the encoder's output survives it (cosine >= 0.999 on the warmup texts,
and finite); else FP32. The head always runs on the stored form, so a computed miss and a later FEATURE
answer see the same input. The event loop is the only user of this object.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter

import numpy as np

from cachestore import records
from cachestore.errors import CorruptRecord
from cachestore.keys import Namespace, Selector
from cachestore.results import ResultCache, now_us
from server.shared.feature_records import Source, decode, encode, feature_tenant, storage_dtype
from server.shared.ttl_classes import jittered
from server.worker.store.feature_lru import DeviceRow, FeatureLRU
from server.worker.store.writer import WriterProcess

log = logging.getLogger("infercache.features")

def feature_selector(selector: Selector) -> Selector:
    """A request's selector (tenant, encoder model, encoder version) in feature namespaces."""
    tenant = None if selector.tenant is None else feature_tenant(selector.tenant, shared=False)
    return Selector(tenant=tenant, model=selector.model, version=selector.version, key=selector.key)


INDEX_BYTES_PER_ROW = 200  # host memory a memory-LRU row costs in its index (key, OrderedDict entry, group)
FENCE_S = 600              # a computation older than an Invalidate(features) may not store its feature


class _Encoder:
    """What the tier keeps per encoder output that heads read: its stored form and its memory level."""

    def __init__(self, dim: int, dtype: np.dtype) -> None:
        self.dim = dim
        self.dtype = dtype
        self.lru: FeatureLRU | None = None




class FeatureTier:
    def __init__(self, writer: WriterProcess | None, *, ttl_s: int, memory_bytes: int, index_bytes: int,
                 device: str | None, ttl_jitter: float = 0.0) -> None:
        """memory_bytes: the memory level's cap (device memory on a GPU host); index_bytes: the host memory
        its index may take (which bounds the rows too, at INDEX_BYTES_PER_ROW each). ttl_jitter
        (cache.ttl_jitter): each feature's TTL less up to this share, at random."""
        self.writer = writer
        self.store = ResultCache(writer.store) if writer is not None else None
        if writer is not None:  # (as the core's L1: server/worker/core.py)
            self.store.on_corrupt = writer.check
            writer.on_store.append(self.store.use)
        self.ttl_us = ttl_s * 1_000_000
        self.ttl_jitter = ttl_jitter
        self.memory_bytes = memory_bytes
        self.index_bytes = index_bytes
        self.device = device  # torch device of the memory level, None = host memory
        self.counters: Counter[str] = Counter()
        self._encoders: dict[Source, _Encoder] = {}
        self._fences: list[tuple[Selector, int]] = []  # Invalidate(features) selectors and when

    def add_encoder(self, source: Source, samples: np.ndarray) -> None:
        """Called once per encoder output that heads read, with some of its values (the stored form is
        chosen from them), before any lookup. The caps are shared equally by the encoder outputs."""
        self._encoders[source] = _Encoder(samples.shape[1], storage_dtype(samples))
        share, rows = self.memory_bytes // len(self._encoders), self.index_bytes // INDEX_BYTES_PER_ROW // len(self._encoders)
        for encoder in self._encoders.values():
            encoder.lru = FeatureLRU(encoder.dim, encoder.dtype.name, min(share, rows * encoder.dim * encoder.dtype.itemsize),
                                     self.device)
        added = self._encoders[source]
        log.info("feature tier: %s stored as %s, up to %d rows in %s memory", "/".join(source), added.dtype.name,
                 added.lru.capacity, self.device or "host")

    def get(self, ns: Namespace, source: Source, key: bytes):
        """(feature, level) with level "l2_device" (the memory LRU) or "l2_host" (LMDB), or None. A device
        LRU's feature is a pinned DeviceRow: pass it to `release` once the head has run on it. A level
        that fails is a miss (counted)."""
        encoder = self._encoders[source]
        now = now_us()
        try:
            found = encoder.lru.get(key, now)
        except Exception as exc:  # noqa: BLE001 (a device error: the memory level is skipped, not the request)
            found = self._failed("memory_errors", exc)
        if found is not None:
            return found, "l2_device"
        if self.store is None or (record := self.store.get(key, now)) is None:
            return None
        try:
            vector = decode(record.payload, encoder.dim)
        except CorruptRecord as exc:
            return self._failed("unreadable", exc)
        if vector.dtype != encoder.dtype:  # stored by a worker that chose the other form
            vector = vector.astype(encoder.dtype)
        self._remember(encoder, ns, key, vector, record.created_us)
        return vector, "l2_host"

    @staticmethod
    def release(feature) -> None:
        """Ends a lookup's hold on a device row (its head batch has read it); nothing for host arrays."""
        if isinstance(feature, DeviceRow):
            feature.lru.release(feature)

    def stored_form(self, source: Source, feature: np.ndarray) -> np.ndarray | None:
        """The feature as it is stored and as the head reads it; None when it does not fit that form (an
        output out of FP16's range): the head then reads it as computed, and it is not kept."""
        stored = np.ascontiguousarray(feature, dtype=self._encoders[source].dtype)
        return stored if np.isfinite(stored).all() else None

    def put(self, ns: Namespace, source: Source, key: bytes, vector: np.ndarray, created_us: int) -> None:
        """Keeps a feature in its stored form, computed by a flight that started at `created_us`, in
        memory and behind in LMDB; not when an Invalidate(features) covering it came after that start."""
        if any(created_us < at and selector.matches(ns) for selector, at in self._fences):
            self.counters["fenced"] += 1
            return
        self._remember(self._encoders[source], ns, key, vector, created_us)
        if self.writer is not None:
            self.writer.put(key, ns, records.Record(created_us, self._expires(created_us), encode(vector)))

    def _expires(self, created_us: int) -> int:
        if not self.ttl_us:
            return 0
        return jittered(created_us, self.ttl_us, self.ttl_jitter)

    def _remember(self, encoder: _Encoder, ns: Namespace, key: bytes, vector: np.ndarray, created_us: int) -> None:
        try:
            encoder.lru.put(key, vector, ns, self._expires(created_us))
        except Exception as exc:  # noqa: BLE001 (kept in LMDB all the same)
            self._failed("memory_errors", exc)

    def _failed(self, counter: str, exc: Exception) -> None:
        self.counters[counter] += 1
        log.warning("feature tier: %s (%s), served as a miss", counter.replace("_", " "), exc)
        return None

    async def invalidate(self, selector: Selector) -> int:
        """Removes the features a (feature) selector names: from LMDB first, then from memory (a lookup
        meanwhile would put an LMDB record back), and fences computations that started before."""
        now = now_us()
        self._fences = [(s, t) for s, t in self._fences if now - t < FENCE_S * 1_000_000] + [(selector, now)]
        removed = 0
        if self.writer is not None:
            removed = await asyncio.wrap_future(self.writer.invalidate(selector))
        purged = sum(encoder.lru.purge(selector.matches) for encoder in self._encoders.values())
        return removed if self.writer is not None else purged

    def stats(self) -> Counter[str]:
        out = Counter(self.counters)
        if self.store is not None:
            out.update(self.store.counters)
        for encoder in self._encoders.values():
            out["memory_rows"] += len(encoder.lru)
            out["memory_bytes"] += encoder.lru.allocated_bytes
            out["memory_cap_bytes"] += encoder.lru.capacity * encoder.lru.row_bytes
            out.update(encoder.lru.counters)
        return out
