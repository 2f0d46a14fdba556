"""The feature tier (L2): encoder outputs that head models read, kept so that a miss runs only the head.

A feature is keyed by what decides it: the encoder model and version, and the token ids the encoder
runs on (the frontend's tokenization of the normalized text, truncated as the model is), namespaced by
tenant ("t:<tenant>") unless the head model's config shares features across tenants ("*"). So a new head
version (new labels, same encoder) finds every feature its predecessor computed, and a new encoder
version finds none of the old ones.

Two levels, looked up in order:
- memory: an LRU on the worker's GPU (`features.device_fraction` of its memory), or in host memory on a
  CPU host (`features.memory_mb`): server/feature_lru.py;
- the host's LMDB feature store (`<cache.dir>/features`, its own TTL and byte budget, written behind by
  the same WriteBehind as the result store, shared by every worker of the host, surviving restarts).
A level that fails (a corrupt or unsealable record, an unreadable store) is a miss.

A feature is stored in FP16 when the encoder's output survives it (cosine >= 0.999 on the warmup texts,
and finite); else FP32. The head always runs on the stored form, so a computed miss and a later FEATURE
answer see the same input. The event loop is the only user of this object.
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter

import numpy as np

from cachestore import records
from cachestore.errors import CorruptRecord
from cachestore.keys import KEY_BYTES, NS_ID_BYTES, Namespace
from cachestore.results import ResultCache, now_us
from cachestore.writer import Selector, WriteBehind
from server.feature_lru import DeviceRow, FeatureLRU

log = logging.getLogger("infercache.features")

SHARED_TENANT = "*"        # features of models that share them across tenants
_PRIVATE = "t:"            # prefix of a tenant's own features: never equal to SHARED_TENANT
_MAGIC = b"F"
_DTYPES = {b"h": np.dtype("<f2"), b"f": np.dtype("<f4")}
_CODES = {dtype: code for code, dtype in _DTYPES.items()}
FP16_MIN_COSINE = 0.999


def feature_tenant(tenant: str, shared: bool) -> str:
    return SHARED_TENANT if shared else _PRIVATE + tenant


def feature_selector(selector: Selector) -> Selector:
    """A request's selector (tenant, encoder model, encoder version) in feature namespaces."""
    tenant = None if selector.tenant is None else _PRIVATE + selector.tenant
    return Selector(tenant=tenant, model=selector.model, version=selector.version, key=selector.key)


def feature_key(ns_id: bytes, ids: bytes) -> bytes:
    digest = hashlib.blake2b(ns_id + ids, digest_size=KEY_BYTES - NS_ID_BYTES, person=b"icache-feat")
    return ns_id + digest.digest()


def storage_dtype(samples: np.ndarray) -> np.dtype:
    """FP16 when every sample row survives it (finite, cosine >= 0.999 with the FP32 row), else FP32."""
    samples = np.asarray(samples, dtype=np.float32)
    with np.errstate(over="ignore"):
        half = samples.astype(np.float16).astype(np.float32)
    if not np.isfinite(half).all():
        return _DTYPES[b"f"]
    norms = np.linalg.norm(samples, axis=1) * np.linalg.norm(half, axis=1)
    zero = ~np.any(samples, axis=1)  # a zero row stays zero; a row that FP16 zeroes does not survive
    cosine = np.divide((samples * half).sum(axis=1), norms, out=zero.astype(np.float64), where=norms > 0)
    return _DTYPES[b"h"] if float(cosine.min()) >= FP16_MIN_COSINE else _DTYPES[b"f"]


def encode(vector: np.ndarray) -> bytes:
    return _MAGIC + _CODES[vector.dtype] + vector.tobytes()


def decode(payload: bytes, dim: int) -> np.ndarray:
    """The stored vector; CorruptRecord when it is not a feature of this dimension."""
    dtype = _DTYPES.get(payload[1:2])
    if payload[:1] != _MAGIC or dtype is None or len(payload) != 2 + dim * dtype.itemsize:
        raise CorruptRecord(f"not a feature of dimension {dim}")
    return np.frombuffer(payload, dtype=dtype, offset=2)


class _Encoder:
    """What the tier keeps per encoder version: its stored form and its memory level."""

    def __init__(self, dim: int, dtype: np.dtype, lru: FeatureLRU) -> None:
        self.dim = dim
        self.dtype = dtype
        self.lru = lru


class FeatureTier:
    def __init__(self, writer: WriteBehind | None, *, ttl_s: int, memory_bytes: int, device: str | None) -> None:
        self.writer = writer
        self.store = ResultCache(writer.store) if writer is not None else None
        self.ttl_us = ttl_s * 1_000_000
        self.memory_bytes = memory_bytes
        self.device = device  # torch device of the memory level, None = host memory
        self.counters: Counter[str] = Counter()
        self._encoders: dict[tuple[str, str], _Encoder] = {}
        self._namespaces: dict[bytes, Namespace] = {}  # ns_id -> namespace, of features seen (purges)

    def add_encoder(self, model: str, version: str, samples: np.ndarray) -> None:
        """Called once per encoder version that heads read, with some of its outputs (the stored form is
        chosen from them). The memory cap is shared equally by the encoders."""
        dtype = storage_dtype(samples)
        self._encoders[(model, version)] = _Encoder(samples.shape[1], dtype, None)  # type: ignore[arg-type]
        share = self.memory_bytes // len(self._encoders)
        for encoder in self._encoders.values():  # few encoders: re-made at start, before any feature
            encoder.lru = FeatureLRU(encoder.dim, encoder.dtype.name, share, self.device)
        log.info("feature tier: %s/%s stored as %s, %d rows in %s memory per encoder", model, version,
                 dtype.name, share // (encoder.dim * dtype.itemsize), self.device or "host")

    def dtype(self, model: str, version: str) -> np.dtype:
        return self._encoders[(model, version)].dtype

    def key(self, ns: Namespace, ids: bytes) -> bytes:
        ns_id = ns.ns_id
        self._namespaces.setdefault(ns_id, ns)
        return feature_key(ns_id, ids)

    def get(self, ns: Namespace, key: bytes):
        """(feature, level) with level "l2_device" (the memory LRU) or "l2_host" (LMDB), or None. A device
        LRU's feature is a pinned DeviceRow: pass it to `release` once the head has run on it."""
        encoder = self._encoders[(ns.model, ns.version)]
        found = encoder.lru.get(key)
        if found is not None:
            return found, "l2_device"
        if self.store is None:
            return None
        record = self.store.get(key, now_us())
        if record is None:
            return None
        try:
            vector = decode(record.payload, encoder.dim)
        except CorruptRecord as exc:
            self.counters["unreadable"] += 1
            log.warning("feature record %s unreadable, recomputing: %s", key.hex(), exc)
            return None
        if vector.dtype != encoder.dtype:  # stored by a worker that chose the other form
            vector = vector.astype(encoder.dtype)
        encoder.lru.put(key, vector)
        return vector, "l2_host"

    @staticmethod
    def release(feature) -> None:
        """Ends a lookup's hold on a device row (its head batch has read it); nothing for host arrays."""
        if isinstance(feature, DeviceRow):
            feature.lru.release(feature)

    def stored_form(self, ns: Namespace, feature: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(feature, dtype=self._encoders[(ns.model, ns.version)].dtype)

    def put(self, ns: Namespace, key: bytes, vector: np.ndarray) -> None:
        """Keeps a computed feature (in its stored form) in memory and writes it behind to LMDB."""
        self._encoders[(ns.model, ns.version)].lru.put(key, vector)
        if self.writer is not None:
            created = now_us()
            self.writer.put(key, ns, records.Record(created, created + self.ttl_us if self.ttl_us else 0,
                                                    encode(vector)))

    def purge(self, selector: Selector) -> int:
        """Drops from memory the features a (feature) selector names; the caller purges LMDB."""
        def doomed(key: bytes) -> bool:
            if selector.key is not None:
                return key == selector.key
            ns = self._namespaces.get(key[:NS_ID_BYTES])
            return ns is not None and selector.matches(ns)

        return sum(encoder.lru.purge(doomed) for encoder in self._encoders.values())

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
