"""A worker's item connections from its frontends (server/shared/framing.py): items in, answers out in
micro-batches, each answer frame carrying the model queues' waits (the frontends' admission control)."""

from __future__ import annotations

import asyncio
import logging

import grpc

from infercache.v1 import worker_pb2
from server.shared.admission import discounted
from server.shared.errors import to_wire
from server.shared.framing import FrameProtocol
from server.worker.core import WorkerCore

log = logging.getLogger("infercache.worker")

WAIT_JUMP = 1.5    # a queue wait this many times what a frontend holds (and WAIT_JUMP_S more)
WAIT_JUMP_S = 0.01  # is pushed to it at once, without waiting for an answer frame


class Frontends:
    """The worker's open frontend connections.

    Every answer frame tells its frontend the queue waits (admission control in the frontends), but at a
    burst's start no answer has come back yet: the first batch is still running while its frontends keep
    sending. So when arriving items make a model's wait jump past what a frontend holds, that frontend
    is told in a frame of its own, in this loop iteration, and refuses what would not be answered in
    time instead of sending it."""

    def __init__(self, core: WorkerCore) -> None:
        self.core = core
        self.open: set[Connection] = set()
        self._check_scheduled = False

    def items_arrived(self) -> None:
        """Checks the waits once at the end of this loop iteration, whatever frames it brings (at one
        item per frame a check per frame cost the worker 5 us per item)."""
        if not self._check_scheduled:
            self._check_scheduled = True
            asyncio.get_running_loop().call_soon(self._check_waits)

    def _check_waits(self) -> None:
        self._check_scheduled = False
        now = asyncio.get_running_loop().time()
        waits = list(self.core.queue_waits())
        for connection in self.open:
            if connection.holds_less(waits, now):
                self.core.counters["wait_pushes"] += 1
                connection.tell_waits(waits)


class Connection:
    """One frontend's item connection (server/shared/framing.py): items in, answers out in micro-batches."""

    def __init__(self, core: WorkerCore, frontends: Frontends) -> None:
        self.core = core
        self.frontends = frontends
        self.waiting: dict = {}              # item id -> flight (written by the core)
        # The waits of the last frame sent (what the frontend holds, discounting them as time passes):
        # (model, version) -> (seconds, loop time sent).
        self.told: dict[tuple[str, str], tuple[float, float]] = {}
        self.protocol = FrameProtocol(self._on_frame, self._on_lost, worker_pb2.ResultBatch, self._on_flush)
        frontends.open.add(self)

    def _on_frame(self, frame: bytes) -> None:
        batch = worker_pb2.ComputeBatch.FromString(frame)
        now = asyncio.get_running_loop().time()
        counters = self.core.counters
        counters["frames"] += 1
        counters["frame_items"] += len(batch.items)
        self.core.submit_all(self, batch.items, now)
        for item_id in batch.cancel:
            self.core.cancel(self, item_id)
        if batch.items:
            self.frontends.items_arrived()

    def holds_less(self, waits, now: float) -> bool:
        """Whether a wait has jumped past what this frontend holds (WAIT_JUMP, WAIT_JUMP_S)."""
        for model, version, seconds in waits:
            told, at = self.told.get((model, version), (0.0, now))
            if seconds > discounted(told, at, now) * WAIT_JUMP + WAIT_JUMP_S:
                return True
        return False

    def tell_waits(self, waits) -> None:
        """Queue waits in a frame of their own (sent at the end of this loop iteration)."""
        self._add_waits(self.protocol.out, waits)
        self.protocol.flush_soon()

    def _on_flush(self, out) -> None:
        """Every frame tells the frontend how long new items would take (its admission control): as of
        now, replacing what tell_waits put there earlier in this iteration."""
        del out.waits[:]
        waits = list(self.core.queue_waits())
        self._add_waits(out, waits)
        now = asyncio.get_running_loop().time()
        self.told = {(model, version): (seconds, now) for model, version, seconds in waits}

    @staticmethod
    def _add_waits(out, waits) -> None:
        for model, version, seconds in waits:
            out.waits.add(model=model, version=version, seconds=seconds)

    def _on_lost(self, exc: Exception | None) -> None:
        self.frontends.open.discard(self)
        for item_id in list(self.waiting):  # the frontend went away: nobody reads these answers
            self.core.cancel(self, item_id)

    def ok(self, item_id: int, source: int, payload: bytes, rejected: bool = False) -> None:
        self.protocol.out.results.add(id=item_id, response=payload, source=source, semantic_rejected=rejected)
        self.protocol.flush_soon()

    def stream(self, item_id: int, text: str, token_ids: list[int]) -> None:
        self.protocol.out.results.add(id=item_id, more=True, text=text, token_ids=token_ids)
        self.protocol.flush_soon()

    def finish(self, item_id: int, source: int, answer: bytes) -> None:
        self.protocol.out.results.add(id=item_id, source=source, response=answer)
        self.protocol.flush_soon()

    def fail(self, item_id: int, exc: BaseException) -> None:
        code, message = to_wire(exc)
        if code == grpc.StatusCode.INTERNAL.value[0]:
            log.error("item %d failed: %r", item_id, exc)
        self.protocol.out.results.add(id=item_id, code=code, error=message)
        self.protocol.flush_soon()
