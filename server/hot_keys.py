"""The hottest keys of each model: a bounded space-saving sketch per model, in each frontend.

Space-saving (Metwally et al.): a key already held is counted; a new key, once the sketch is full,
takes the place of the least counted one and inherits its count as its possible overcount (`error`).
Every key whose true count exceeds (texts seen / capacity) is held, and each held key's count is at most
`error` above its true count. Here eviction is batched: the sketch holds up to twice its capacity, and
when that fills it keeps the `capacity` most counted and new keys start above the largest count dropped
(the same bounds, and a hit on a held key is one dict increment).

Keys are the cache keys (hashes of tenant, model, version and normalized text); a key's text is kept
only for models whose config sets `hot_keys.keep_text`. Each frontend publishes its sketches in its
metrics snapshot (server/telemetry.py); GetHotKeys adds them up over the frontends.
"""

from __future__ import annotations


class _Sketch:
    __slots__ = ("entries", "floor")

    def __init__(self) -> None:
        self.entries: dict[bytes, list] = {}  # key -> [count, error, version, text]
        self.floor = 0                         # the largest count dropped so far


class HotKeys:
    """Written by the frontend's event loop only."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._models: dict[str, _Sketch] = {}

    def adopt(self, published: dict[str, list[list]]) -> None:
        """A predecessor's published sketches (a restarted frontend keeps counting where it left off)."""
        for model, top in published.items():
            sketch = self._models.setdefault(model, _Sketch())
            for key, count, error, version, text in top[:self.capacity]:
                sketch.entries[bytes.fromhex(key)] = [count, error, version, text]

    def add(self, model: str, version: str, key: bytes, text: str) -> None:
        sketch = self._models.get(model)
        if sketch is None:
            sketch = self._models[model] = _Sketch()
        entry = sketch.entries.get(key)
        if entry is not None:
            entry[0] += 1
            return
        if len(sketch.entries) >= 2 * self.capacity:
            self._trim(sketch)
        sketch.entries[key] = [sketch.floor + 1, sketch.floor, version, text]

    def _trim(self, sketch: _Sketch) -> None:
        ranked = sorted(sketch.entries.items(), key=lambda item: item[1][0], reverse=True)
        sketch.entries = dict(ranked[:self.capacity])
        sketch.floor = max(sketch.floor, ranked[self.capacity][1][0])

    def top(self, model: str, limit: int | None = None) -> list[list]:
        """[[key hex, count, error, version, text], ...] most counted first."""
        sketch = self._models.get(model)
        if sketch is None:
            return []
        ranked = sorted(sketch.entries.items(), key=lambda item: item[1][0], reverse=True)
        return [[key.hex(), *entry] for key, entry in ranked[:limit or self.capacity]]

    def published(self) -> dict[str, list[list]]:
        return {model: self.top(model) for model in self._models}


def combine(tops: list[list[list]], limit: int) -> list[list]:
    """Several frontends' top lists of one model as one: counts and errors added per key."""
    by_key: dict[str, list] = {}
    for top in tops:
        for key, count, error, version, text in top:
            found = by_key.get(key)
            if found is None:
                by_key[key] = [key, count, error, version, text]
            else:
                found[1] += count
                found[2] += error
                found[4] = found[4] or text
    return sorted(by_key.values(), key=lambda entry: entry[1], reverse=True)[:limit]
