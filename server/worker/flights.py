"""A worker's flights: one computation that identical concurrent items share (coalescing), what it
produced, and which later items may take its answer; and the one registry of every flight in the worker,
an encoder item's (Flight, server/worker/core.py) or a generation's (GenerateFlight,
server/worker/generation/). Owned by the worker's event loop."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from cachestore import records
from cachestore.results import now_us
from infercache.v1 import infercache_pb2 as pb
from infercache.v1 import worker_pb2

if TYPE_CHECKING:  # (model_runtime reads items' token ids from here)
    from server.worker.model_runtime import ModelRuntime

Source = pb.CacheInfo.Source


class Replies(Protocol):
    """Where a connection's answers go (server/worker/process.py: one per frontend connection)."""

    waiting: dict[int, "Flight"]  # item id -> the flight it waits for (a Flight or a GenerateFlight)

    def ok(self, item_id: int, source: int, payload: bytes, rejected: bool = False) -> None: ...

    def fail(self, item_id: int, exc: BaseException) -> None: ...

    def stream(self, item_id: int, text: str, token_ids: list[int]) -> None: ...  # a generation's next piece

    def finish(self, item_id: int, source: int, answer: bytes) -> None: ...  # its end (server/shared/generated.py)


@dataclass(slots=True)
class Outcome:
    """What a flight produced: the answer's serialized response, and what to store."""

    payload: bytes
    source: int = Source.MISS
    stored: bytes | None = None               # when it differs from payload (explain adds neighbours)
    embedding: np.ndarray | None = None       # the query's embedding (semantic models)
    label: str = ""
    matched: records.Record | None = None     # a stored record this answer came from (RESULT_SEMANTIC, RESULT_FLEET)
    rejected: bool = False                    # computed although a semantic search found neighbours


class Flight:
    """One computation that identical concurrent items share."""

    __slots__ = ("key", "runtime", "item", "future", "waiters", "store", "outcome", "created_us", "leased")
    CANCELLED = "cancelled"  # the counter of flights nobody waited for any more

    def __init__(self, key: bytes, runtime: ModelRuntime, item: worker_pb2.ComputeItem) -> None:
        self.key = key
        self.runtime = runtime
        self.item = item
        self.future: asyncio.Future | None = None
        self.waiters: dict[tuple[Replies, int], bool] = {}  # (connection, item id) -> joined
        self.store = False
        self.outcome: Outcome | None = None
        self.created_us = now_us()
        self.leased = False  # this pod holds the key's fleet lease (dropped when the flight ends)


    def may_join(self, item: worker_pb2.ComputeItem) -> bool:
        """Whether an item may take this flight's answer. A finished flight whose entry is not committed
        yet stands for that entry: it answers an item that may use a stored answer (not BYPASS) no older
        than the item's max_age. A running one may end in a stored answer too (a near-duplicate's, the
        fleet's) as old as the item that started it allowed: a stricter item joins only a flight at least
        as strict."""
        max_age = item.max_age_us if item.HasField("max_age_us") else None
        if self.outcome is not None:
            if not item.cached_ok:
                return False
            matched = self.outcome.matched  # a near-duplicate's or the fleet's record: its own age
            created_us = matched.created_us if matched is not None else self.created_us
            return max_age is None or now_us() - created_us <= max_age
        first = self.item
        if not first.cached_ok or (item.cached_ok and max_age is None):
            return True
        return item.cached_ok and first.HasField("max_age_us") and first.max_age_us <= max_age

    def leave(self, replies: Replies, item_id: int) -> bool:
        """A waiter went away; True when nobody waits any more for a computation still running (it is
        cancelled: the batcher drops it before the engine)."""
        self.waiters.pop((replies, item_id), None)
        if self.waiters or self.outcome is not None:
            return False
        self.future.cancel()
        return True

    @property
    def pending(self) -> asyncio.Future | None:
        """Its computation while it runs (the worker's close waits for it)."""
        return self.future if self.outcome is None else None


class FlightRegistry:
    """Every flight of a worker by key, whatever computes it. An identical item joins the flight of its
    key where that flight's `may_join` says so; a flight is forgotten once its entry is committed, at once
    when it failed, or when nobody waits for it any more (`leave`: an identical item arriving then starts
    a flight of its own). Event loop only."""

    def __init__(self, counters) -> None:
        self._flights: dict[bytes, object] = {}
        self.counters = counters  # the worker's

    def joinable(self, item: worker_pb2.ComputeItem):
        """The flight of the item's key that may answer it, or None."""
        flight = self._flights.get(item.key)
        return flight if flight is not None and flight.may_join(item) else None

    def add(self, flight) -> None:
        self._flights[flight.key] = flight

    def forget(self, flight) -> None:
        if self._flights.get(flight.key) is flight:
            del self._flights[flight.key]

    def leave(self, replies: Replies, item_id: int) -> None:
        """The item's caller went away: its flight is dropped where nobody else waits for it."""
        flight = replies.waiting.pop(item_id, None)
        if flight is not None and flight.leave(replies, item_id):
            self.counters[flight.CANCELLED] += 1
            self.forget(flight)

    def pending(self) -> list[asyncio.Future]:
        """The computations still running."""
        return [future for flight in self._flights.values() if (future := flight.pending) is not None]


def token_ids(packed: bytes) -> np.ndarray:
    """An item's token ids (int32 little-endian bytes, see worker.proto)."""
    return np.frombuffer(packed, dtype="<i4")
