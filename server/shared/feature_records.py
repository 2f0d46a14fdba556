"""What a stored feature (an encoder output a head model reads, L2) is, for both sides: its namespace
(its tenant's, or shared across tenants where the head's config says so), its key (derived from the
normalized text, so a frontend can look it up without tokenizing), and its stored form (FP16 where the
encoder's output survives it, else FP32). The workers keep features (server/worker/store/features.py); a
frontend answers from stored ones (server/frontend/features.py)."""

from __future__ import annotations

import hashlib

import numpy as np

from cachestore.errors import CorruptRecord
from cachestore.keys import KEY_BYTES, NS_ID_BYTES, Namespace, namespace

Source = tuple[str, str, str]  # (encoder model, version, output): what a head reads

SHARED_TENANT = "*"        # features of models that share them across tenants
_PRIVATE = "t:"            # prefix of a tenant's own features: never equal to SHARED_TENANT
_MAGIC = b"F"
_DTYPES = {b"h": np.dtype("<f2"), b"f": np.dtype("<f4")}
_CODES = {dtype: code for code, dtype in _DTYPES.items()}
FP16_MIN_COSINE = 0.999


def feature_tenant(tenant: str, shared: bool) -> str:
    return SHARED_TENANT if shared else _PRIVATE + tenant


def feature_namespace(tenant: str, shared: bool, source: Source) -> Namespace:
    """The namespace of a request's features of `source`: its tenant's, or the shared one."""
    return namespace(feature_tenant(tenant, shared), *source[:2])


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


def feature_key(ns: Namespace, source: Source, normalized: str) -> bytes:
    """ns_id + blake2b(ns_id, the output's name, the normalized text): namespaced like every cache key.
    Frontends derive it (worker.proto ComputeItem.feature_key) without tokenizing."""
    ns_id = ns.ns_id
    material = ns_id + source[2].encode() + b"\0" + normalized.encode()
    return ns_id + hashlib.blake2b(material, digest_size=KEY_BYTES - NS_ID_BYTES, person=b"icache-feat").digest()
