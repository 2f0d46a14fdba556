"""The semantic rows a writer process's commits add and remove (server/worker/store/writer.py), passed on
to the semantic index (`on_semantic`) on the worker's loop: the vectors of semantic puts are kept here
until their rows come back (the process names them by key instead of sending 1.5 KB back for each), and
the rows of a fresh store (after a damaged one's replacement) wait until its read handle is open."""

from __future__ import annotations

import logging
from collections import Counter, deque
from typing import Callable

import numpy as np

from cachestore.semantic_log import Row
from infercache.v1 import writer_pb2

log = logging.getLogger("infercache.writer_process")


class SemanticRows:
    def __init__(self, counters: Counter[str]) -> None:
        self.on_semantic: Callable[[list[Row], list[tuple[bytes, int]]], None] | None = None
        self.counters = counters  # the writer's own (semantic_rows_without_vector, notify_errors)
        # Vectors of the semantic puts not handled yet, by key, and the order to forget them in: (put
        # number, key).
        self._vectors: dict[bytes, tuple[int, np.ndarray]] = {}
        self._order: deque[tuple[int, bytes]] = deque()
        self._deferred: list | None = None  # rows of a fresh store, until its read handle is open

    def keep(self, number: int, key: bytes, embedding: bytes) -> None:
        """Put `number`'s vector (over the frame's bytes: a view of the engine's output would keep its
        whole batch alive)."""
        self._vectors[key] = (number, np.frombuffer(embedding, dtype="<f4"))
        self._order.append((number, key))

    def committed(self, events: writer_pb2.StoreEvents, handled: int) -> None:
        """A frame of the process's: its rows told on (or held), then the vectors of the puts handled
        forgotten (their rows came before their handled count)."""
        if (events.added or events.removed) and self.on_semantic is not None:
            added = []
            for r in events.added:
                vector = np.frombuffer(r.embedding, dtype="<f4") if r.embedding else self._vectors.get(r.key, (0, None))[1]
                if vector is None:  # (not expected: the index misses it until it is rebuilt from the log)
                    self.counters["semantic_rows_without_vector"] += 1
                    continue
                added.append(Row(r.ns_id, r.label, r.key, r.answer, vector))
            removed = [(r.ns_id, r.label) for r in events.removed]
            if self._deferred is not None:
                self._deferred.append((added, removed))
            else:
                self._notify(added, removed)
        order = self._order
        while order and order[0][0] <= handled:
            number, key = order.popleft()
            if self._vectors.get(key, (0,))[0] == number:
                del self._vectors[key]

    def defer(self) -> None:
        """The process replaced its store: the rows that follow wait for resume()."""
        self._deferred = []

    def resume(self) -> None:
        """The fresh store's read handle is open: the rows held meanwhile, in order."""
        deferred, self._deferred = self._deferred or [], None
        for added, removed in deferred:
            self._notify(added, removed)

    def clear(self) -> None:
        self._vectors.clear()
        self._order.clear()

    def _notify(self, added: list[Row], removed: list[tuple[bytes, int]]) -> None:
        try:
            self.on_semantic(added, removed)
        except Exception:  # the index misses these rows; the log in LMDB is still complete
            self.counters["notify_errors"] += 1
            log.exception("semantic index notification failed")
