"""Shadow verification of semantic hits (calibrated rule, server/match_policy.py).

A share of the semantic hits served (`semantic.verify_fraction`), and every hit answered by an entry no
verification has proven yet, is recomputed by the model in the background and compared with the answer
served. Checks run at low priority: only while every batcher of the worker is idle (nothing queued, no
batch running: on one CPU or one GPU the encoder's batches and the heads' compete for the same device,
so an idle head batcher beside a busy encoder is no idle capacity). Where no such moment comes within
MAX_DEFER_S, one batch of checks goes anyway, so verification goes on, slowly, under sustained load.
Waiting checks go together, as many in one batch as add at most a batch's own cost (the batcher's row
model, a CPU's), or up to its max_batch where a row costs next to nothing (a GPU, a head), so a foreground
miss that arrives meanwhile waits for at most one such batch. When checks come faster than that, the oldest
are dropped, and so is one that waited over a minute (both counted). Each outcome feeds the model
version's calibration (threshold, live fidelity, guard: server/calibration.py). An agreement proves the
entry; a disagreement contests it: it answers no near-duplicate again. Either way the model's answer
goes to `on_checked` (the worker stores it under the query's key, replacing the alias the hit wrote, and
indexes it: a verified answer is an entry of its own). One owner: the worker's event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import numpy as np

from cachestore.results import now_us
from server.calibration import Calibration

log = logging.getLogger("infercache.shadow")

CAPACITY = 1024              # checks waiting; beyond it the oldest are dropped
MAX_AGE_S = 60.0             # checks waiting longer are dropped (well inside the writer's 120 s fences)
PROVEN_CAPACITY = 1_000_000  # entries remembered as proven or contested (forgotten together when full)
MAX_DEFER_S = 1.0            # a batch of checks waits at most this long for an idle worker, then goes anyway


@dataclass
class Check:
    runtime: Any               # the model's ModelRuntime (its batcher and labels)
    calibration: Calibration
    item: Any                  # the request's worker_pb2.ComputeItem
    model_input: Any           # what the model's batcher takes: the head's feature, or token ids
    embedding: np.ndarray
    served: str                # the answer the hit gave
    margin: float
    entry: bytes               # the key of the entry that answered
    chance: float              # the probability this hit was verified
    created_us: int            # when the hit was served
    fitted: bool = False       # decided with the namespace's fit consulted (it agreed: server/calibration.py)


class ShadowVerifier:
    def __init__(self, on_checked: Callable[[Check, dict, bool], None],
                 batchers: Callable[[], Iterable[Any]]) -> None:
        """`batchers`: every batcher of the worker (checks wait for all of them to be idle)."""
        self.on_checked = on_checked
        self.batchers = batchers
        self.counters: Counter[str] = Counter()
        self._pending: deque[Check] = deque()
        self._proven: set[bytes] = set()
        self._contested: set[bytes] = set()
        self._running = 0  # checks taken into the batch now running
        self._wake = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="shadow-verifier")

    def contested(self, entry: bytes) -> bool:
        """A check found a hit of this entry wrong: near-duplicates no longer take its answer."""
        return entry in self._contested

    def chance(self, entry: bytes, fraction: float) -> float:
        """How likely a hit answered by `entry` is verified: always while the entry is unproven."""
        return fraction if entry in self._proven else 1.0

    def stats(self) -> dict[str, int]:
        """The counters, and the checks not settled yet (waiting, or in a batch)."""
        return {**self.counters, "shadow_pending": len(self._pending) + self._running}

    def offer(self, check: Check) -> None:
        if len(self._pending) >= CAPACITY:
            self._pending.popleft()
            self.counters["shadow_dropped"] += 1
        self._pending.append(check)
        self._wake.set()

    async def close(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending:
                try:
                    await asyncio.wait_for(self._idle(), MAX_DEFER_S)
                except TimeoutError:  # no idle moment: one batch of checks goes anyway
                    self.counters["shadow_unidle"] += 1
                if checks := self._take():
                    self._running = len(checks)
                    try:
                        await self._check(checks)
                    finally:
                        self._running = 0

    async def _idle(self) -> None:
        """Returns once every batcher of the worker is idle at the same moment."""
        while (busy := next((b for b in self.batchers() if not b.idle), None)) is not None:
            await busy.wait_idle()

    def _take(self) -> list[Check]:
        """The oldest waiting check and those of the same model after it, as many as one batch of
        checks takes (`chunk`); stale ones are dropped on the way."""
        runtime = self._pending[0].runtime
        room, taken, others = chunk(runtime.batcher), [], []
        while self._pending and len(taken) < room:
            check = self._pending.popleft()
            if check.runtime is not runtime:
                others.append(check)
            elif now_us() - check.created_us > MAX_AGE_S * 1_000_000:
                self.counters["shadow_stale"] += 1  # its answer may be invalidated past the writer's fences
            else:
                taken.append(check)
        self._pending.extendleft(reversed(others))
        return taken

    async def _check(self, checks: list[Check]) -> None:
        batcher = checks[0].runtime.batcher
        # Enqueued in one go: the batcher cuts them into one batch (server/batcher.py).
        outcomes = await asyncio.gather(*(batcher.submit(c.model_input, None) for c in checks),
                                        return_exceptions=True)
        for check, outputs in zip(checks, outcomes):
            if isinstance(outputs, BaseException):  # a check lost is a sample lost, never an answer
                self.counters["shadow_failed"] += 1
                log.warning("shadow verification failed: %r", outputs)
                continue
            try:
                self._settle(check, outputs)
            except Exception:
                self.counters["shadow_failed"] += 1
                log.exception("shadow verification failed")

    def _settle(self, check: Check, outputs: dict) -> None:
        answer = check.runtime.labels[int(np.argmax(outputs["scores"]))]
        agreed = answer == check.served
        check.calibration.verified_hit(check.margin, agreed, check.chance, check.fitted)
        self.counters["shadow_agreed" if agreed else "shadow_disagreed"] += 1
        if agreed:
            if len(self._proven) >= PROVEN_CAPACITY:
                self._proven.clear()
            self._proven.add(check.entry)
        else:
            if len(self._contested) >= PROVEN_CAPACITY:
                self._contested.clear()
            self._contested.add(check.entry)
            self._proven.discard(check.entry)
        self.on_checked(check, outputs, agreed)


def chunk(batcher) -> int:
    """How many checks go in one batch: where each row adds to a batch's time (the batcher's row model),
    as many as add at most a batch's own cost; else up to max_batch."""
    if not batcher.row_s:
        return batcher.max_batch
    return max(1, min(batcher.max_batch, int(batcher.fixed_s / batcher.row_s)))
