"""Namespace generations and the names of fleet keys.

Invalidating a tenant, a model or a model version across the fleet is one HINCRBY: a hash
(`<prefix>:gens`) holds a generation for each selector ever invalidated, its field the selector as JSON
`[tenant, model, version]` with null for "any". An entry's fleet key carries the sum of the generations of
the eight selectors that cover its namespace. Generations only grow, so the sum grows with each
invalidation that covers the entry and never returns to an earlier value: the old entries become
unreachable at once and expire by their TTL.

Keys of one entry share a hash tag, so its value and its lease live in one cluster slot (one pipeline):

    <prefix>:r:{<entry key hex>:<sum>}   the record (the bytes LMDB stores: header + payload, sealed
                                         when encryption at rest is on)
    <prefix>:l:{<entry key hex>:<sum>}   the lease of the pod computing it
    <prefix>:ns                          hash: namespace id (hex) -> [tenant, model, version]
    <prefix>:inv                         the broadcast channel of invalidations
    <prefix>:keys                        the broadcast channel of the keys written (key_filter.py)
"""

from __future__ import annotations

import itertools
import json

from cachestore.keys import NS_ID_BYTES, Namespace, Selector


def field(tenant: str | None, model: str | None, version: str | None) -> str:
    return json.dumps([tenant, model, version])


def selector(name: str) -> Selector:
    tenant, model, version = json.loads(name)
    return Selector(tenant=tenant, model=model, version=version)


def covering(ns: Namespace) -> list[str]:
    """The fields of every selector that covers `ns` (each part: its value, or any)."""
    return [field(t, m, v) for t, m, v in itertools.product((ns.tenant, None), (ns.model, None), (ns.version, None))]


SUMS_KEPT = 10_000  # namespaces whose sum is remembered (recomputed after: eight dict lookups)


class NamespaceGenerations:
    """This process's copy of the generations hash. One writer: the tier's subscription task (and the
    tier's own invalidations, on the same event loop)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.values: dict[str, int] = {}
        self._sums: dict[Namespace, int] = {}

    def replace(self, values: dict[str, int]) -> list[str]:
        """Adopts Redis' hash; the fields whose generation changed. Grown: their entries here are stale.
        Shrunk or gone (Redis lost the hash): sums may return to values already used, so those entries
        are no more trustworthy than the others."""
        changed = [name for name in set(values) | set(self.values) if values.get(name, 0) != self.values.get(name, 0)]
        self.values = dict(values)
        self._sums.clear()
        return changed

    def advance(self, name: str, gen: int) -> bool:
        """A broadcast generation; True when it is news."""
        if gen <= self.values.get(name, 0):
            return False
        self.values[name] = gen
        self._sums.clear()
        return True

    def total(self, ns: Namespace) -> int:
        found = self._sums.get(ns)
        if found is None:
            if len(self._sums) >= SUMS_KEPT:
                self._sums.clear()
            found = self._sums[ns] = sum(self.values.get(name, 0) for name in covering(ns))
        return found

    def value_key(self, key: bytes, ns: Namespace) -> str:
        return f"{self.prefix}:r:{{{key.hex()}:{self.total(ns)}}}"

    def lease_key(self, key: bytes, ns: Namespace) -> str:
        return f"{self.prefix}:l:{{{key.hex()}:{self.total(ns)}}}"

    @property
    def hash_key(self) -> str:
        return f"{self.prefix}:gens"

    @property
    def namespaces_key(self) -> str:
        return f"{self.prefix}:ns"

    @property
    def channel(self) -> str:
        return f"{self.prefix}:inv"

    @property
    def keys_channel(self) -> str:
        return f"{self.prefix}:keys"

    @property
    def value_pattern(self) -> str:
        """A SCAN pattern of every record's key (the prefix's glob characters escaped)."""
        return "".join("\\" + c if c in "*?[]\\" else c for c in self.prefix) + ":r:*"


def ns_hex(key: bytes) -> str:
    return key[:NS_ID_BYTES].hex()
