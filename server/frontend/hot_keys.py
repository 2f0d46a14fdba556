"""The hottest keys of each model: a bounded space-saving sketch per model, in each frontend.

Space-saving (Metwally et al.): a key already held is counted; a new key, once the sketch is full,
takes the place of the least counted one and inherits its count as its possible overcount (`error`).
Every key whose true count exceeds (texts seen / capacity) is held, and each held key's count is at most
`error` above its true count (count - error <= true <= count). Here eviction is batched: the sketch holds
up to twice its capacity, and when that fills it keeps the `capacity` most counted and new keys start
above the largest count dropped, its `floor` (the same bounds; a hit on a held key is one dict increment).

Keys are the cache keys (hashes of tenant, model, version and normalized text); a key's text and tenant
are kept only for models whose config sets `hot_keys.keep_text`. Each frontend publishes its sketches
(server/frontend/process.py), with their floors; GetHotKeys merges them: a key another frontend does not list
may have been counted there up to that frontend's floor, which the merge adds to its count and error,
so the bounds hold for the merged list too. A restarted frontend adopts what its predecessor published.
"""

from __future__ import annotations


class _Sketch:
    __slots__ = ("entries", "floor")

    def __init__(self) -> None:
        self.entries: dict[bytes, list] = {}  # key -> [count, error, version, tenant, text]
        self.floor = 0                         # the largest count dropped so far


class HotKeys:
    """Written by the frontend's event loop only."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.changes = 0  # texts counted: the publisher skips an unchanged sketch
        self._models: dict[str, _Sketch] = {}

    def adopt(self, published: dict[str, dict]) -> None:
        """A predecessor's published sketches (a restarted frontend keeps counting where it left off):
        its published floor bounds every key it did not list."""
        for model, found in published.items():
            sketch = self._models.setdefault(model, _Sketch())
            sketch.floor = max(sketch.floor, found["floor"])
            for key, count, error, version, tenant, text in found["keys"][:self.capacity]:
                sketch.entries[bytes.fromhex(key)] = [count, error, version, tenant, text]

    def add(self, model: str, version: str, key: bytes, tenant: str, text: str) -> None:
        self.changes += 1
        sketch = self._models.get(model)
        if sketch is None:
            sketch = self._models[model] = _Sketch()
        entry = sketch.entries.get(key)
        if entry is not None:
            entry[0] += 1
            return
        if len(sketch.entries) >= 2 * self.capacity:
            self._trim(sketch)
        sketch.entries[key] = [sketch.floor + 1, sketch.floor, version, tenant, text]

    def _trim(self, sketch: _Sketch) -> None:
        ranked = sorted(sketch.entries.items(), key=lambda item: item[1][0], reverse=True)
        sketch.entries = dict(ranked[:self.capacity])
        sketch.floor = max(sketch.floor, ranked[self.capacity][1][0])

    def top(self, model: str) -> dict:
        """{"floor": f, "keys": [[key hex, count, error, version, tenant, text], ...]}, most counted
        first, at most `capacity` keys. Keys held beyond those count at most the smallest listed."""
        sketch = self._models.get(model)
        if sketch is None:
            return {"floor": 0, "keys": []}
        ranked = sorted(sketch.entries.items(), key=lambda item: item[1][0], reverse=True)
        keys = [[key.hex(), *entry] for key, entry in ranked[:self.capacity]]
        floor = sketch.floor if len(ranked) <= self.capacity else max(sketch.floor, ranked[self.capacity][1][0])
        return {"floor": floor, "keys": keys}

    def published(self) -> dict[str, dict]:
        return {model: self.top(model) for model in self._models}


def merge_tops(tops: list[dict], limit: int) -> list[list]:
    """Several frontends' tops of one model as one list, most counted first: per key, counts and errors
    added, plus each other frontend's floor where that frontend does not list the key."""
    by_key: dict[str, list] = {}
    for n, top in enumerate(tops):
        for key, count, error, version, tenant, text in top["keys"]:
            found = by_key.setdefault(key, [key, 0, 0, version, tenant, text, set()])
            found[1] += count
            found[2] += error
            found[6].add(n)
    for found in by_key.values():
        for n, top in enumerate(tops):
            if n not in found[6]:
                found[1] += top["floor"]
                found[2] += top["floor"]
    merged = sorted((entry[:6] for entry in by_key.values()), key=lambda entry: entry[1], reverse=True)
    return merged[:limit]
