"""Cache keys.

A namespace is (tenant, model, version): entries of different namespaces never collide, so tenants
never share entries and a new model version starts empty. A key is 24 bytes:

    ns_id (8 bytes) + blake2b(ns_id + normalized input, 16 bytes)

The namespace prefix keeps one namespace's entries adjacent in LMDB, so invalidating a tenant, model or
version is a range delete instead of a scan of the whole store. Keys stay far below LMDB's 511-byte limit.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import cached_property, lru_cache

NS_ID_BYTES = 8
KEY_BYTES = NS_ID_BYTES + 16


@dataclass(frozen=True)
class Namespace:
    tenant: str
    model: str
    version: str

    @property
    def ns_id(self) -> bytes:
        return namespace_id(self.tenant, self.model, self.version)

    @cached_property
    def json(self) -> bytes:
        """The stored form (the namespaces table); made once per object, since every stored entry writes it."""
        return json.dumps([self.tenant, self.model, self.version]).encode()

    def to_json(self) -> bytes:
        return self.json

    @classmethod
    def from_json(cls, raw: bytes) -> "Namespace":
        tenant, model, version = json.loads(raw)
        return cls(tenant, model, version)


@dataclass(frozen=True)
class Selector:
    """What Invalidate removes; set fields combine with AND. None = any."""

    tenant: str | None = None
    model: str | None = None
    version: str | None = None
    key: bytes | None = None

    def matches(self, ns: Namespace) -> bool:
        return (
            (self.tenant is None or ns.tenant == self.tenant)
            and (self.model is None or ns.model == self.model)
            and (self.version is None or ns.version == self.version)
        )


# One object per namespace, not one per stored answer (its JSON form is made once).
namespace = lru_cache(maxsize=4096)(Namespace)


@lru_cache(maxsize=4096)  # every request derives one; few are distinct (identifiers are bounded in length)
def namespace_id(tenant: str, model: str, version: str, variant: str = "") -> bytes:
    """`variant`: what else decides a model's keys (its synonym dictionary's fingerprint: ModelSpec
    key_variant); "" leaves the id as it always was. The namespaces table keeps [tenant, model, version]
    for either, so selectors (Invalidate) match entries made under any variant."""
    # JSON encoding keeps the parts unambiguous ("a|b","c" vs "a","b|c").
    material = json.dumps([tenant, model, version, variant] if variant else [tenant, model, version]).encode()
    return hashlib.blake2b(material, digest_size=NS_ID_BYTES, person=b"icache-ns").digest()


def entry_key(ns_id: bytes, normalized: str) -> bytes:
    digest = hashlib.blake2b(ns_id + normalized.encode(), digest_size=KEY_BYTES - NS_ID_BYTES, person=b"icache-key")
    return ns_id + digest.digest()


def parse_hex_key(text: str) -> bytes:
    """Key from its hex form (CacheInfo.key); ValueError with a readable message when malformed."""
    try:
        key = bytes.fromhex(text)
    except ValueError:
        raise ValueError(f"key must be {KEY_BYTES * 2} hex digits, got {text!r}") from None
    if len(key) != KEY_BYTES:
        raise ValueError(f"key must be {KEY_BYTES * 2} hex digits, got {len(text)} characters")
    return key
