"""Shadow verification of semantic hits (calibrated rule, server/shared/match_policy.py).

A share of the semantic hits served (`semantic.verify_fraction`), and every hit answered by an entry no
verification has proven yet, is recomputed by the model in the background and compared with the answer
served. Checks run at low priority: only while every batcher of the worker is idle (nothing queued, no
batch running, no generation running: on one CPU or one GPU the encoder's batches, the heads' and the
decoders' steps compete for the same device, so an idle head batcher beside a busy encoder is no idle
capacity). Waiting checks of one model and length
group (server/worker/batcher.py) go together: up to the batcher's max_batch where a row costs next to nothing (a
head, a GPU), one at a time where each row adds to a batch's time (the batcher's row model, a CPU), so a
foreground miss that arrives meanwhile waits for at most one such batch. Where no idle moment comes
within MAX_DEFER_S, one batch of checks goes anyway, so verification goes on, slowly, under sustained
load: the oldest check whose model's queue has room for it within half of max_queue (QUEUE_SHARE), with
those of its model and length group that fit (a model with no room holds back its own checks only; when
none has room, they wait on, counted in shadow_deferred once per MAX_DEFER_S). A check is never refused,
which would count as a user's refusal and raise the wait the frontends are told, and no wait bound
applies to it (it has no deadline). When checks come faster than that, the oldest are dropped, and so is
one that waited over a minute (all counted). Each outcome feeds the model version's calibration
(threshold, live fidelity, guard: server/worker/semantic/calibration.py). An agreement proves the entry; a disagreement
contests it: it answers no near-duplicate again. Either way the model's answer goes to `on_checked` (the
worker stores it under the query's key, replacing the alias the hit wrote, and indexes it: a verified
answer is an entry of its own). A generative model's answers are checked by regenerating them
(server/worker/semantic/regeneration.py): a check whose model input yields to foreground work (`Preempted`) is
offered again, in its place, for the next idle moment. One owner: the worker's event loop."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import numpy as np

from cachestore.results import now_us
from server.worker.semantic.calibration import Calibration

log = logging.getLogger("infercache.shadow")

CAPACITY = 1024              # checks waiting; beyond it the oldest are dropped
MAX_AGE_S = 60.0             # checks waiting longer are dropped (well inside the writer's 120 s fences)
PROVEN_CAPACITY = 1_000_000  # entries remembered as proven or contested (forgotten together when full)
MAX_DEFER_S = 1.0            # a batch of checks waits at most this long for an idle worker, then goes if it fits
QUEUE_SHARE = 0.5            # checks never fill more of a batcher's queue: requests after them find the rest


class Preempted(Exception):
    """A check's computation gave way to foreground work: the check waits for the next idle moment."""


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
    fitted: bool = False       # decided with the namespace's fit consulted (it agreed: server/worker/semantic/calibration.py)
    residual: float = 0.0      # the query's distance from its neighbours' hull (match_policy.Assessment)
    agrees: Callable[[dict], bool] | None = None  # whether the model's outputs agree with the hit (None: the
    #                                               label its scores rank first is `served`)


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
        self._task.add_done_callback(_ended)

    def contested(self, entry: bytes) -> bool:
        """A check found a hit of this entry wrong: near-duplicates no longer take its answer."""
        return entry in self._contested

    def proven(self, entry: bytes) -> bool:
        """A check found a hit of this entry right (and none since wrong)."""
        return entry in self._proven

    def chance(self, entry: bytes, fraction: float) -> float:
        """How likely a hit answered by `entry` is verified: always while the entry is unproven."""
        return fraction if entry in self._proven else 1.0

    def drawn(self, entry: bytes, fraction: float) -> float | None:
        """Whether a hit answered by `entry` is drawn for a check: its chance of being drawn if it is (a
        check weighs its outcome by it), None if not. A fraction of 0 turns verification off: no checks,
        no live fidelity, even of unproven entries."""
        if fraction == 0:
            return None
        chance = self.chance(entry, fraction)
        return chance if chance >= 1.0 or np.random.random() < chance else None

    def judged(self, entry: bytes, agreed: bool) -> None:
        """A verdict on `entry` reached outside a check (a miss computed what a check would have): proves
        or contests it as a check does."""
        if agreed:
            if len(self._proven) >= PROVEN_CAPACITY:
                self._proven.clear()
            self._proven.add(entry)
        else:
            if len(self._contested) >= PROVEN_CAPACITY:
                self._contested.clear()
            self._contested.add(entry)
            self._proven.discard(entry)

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
            while self._drop_stale():
                idle = True
                try:
                    async with asyncio.timeout(MAX_DEFER_S):  # (in this task: a close's cancel is never lost)
                        await self._idle()
                except TimeoutError:
                    idle = False
                if not self._drop_stale():
                    break
                # Without an idle moment, only checks whose batcher has room for them within their
                # share go (the oldest such, with those of its model and length group): a model whose
                # queue is full holds back its own checks, not another model's.
                checks = self._take() if idle else self._take(_room)
                if not checks:
                    self.counters["shadow_deferred"] += 1
                    continue
                if not idle:
                    self.counters["shadow_unidle"] += 1
                self._running = len(checks)
                try:
                    await self._check(checks)
                except Exception:  # a bug outside one check's own handling: those checks are lost, not the verifier
                    self.counters["shadow_failed"] += len(checks)
                    log.exception("a batch of %d shadow checks failed", len(checks))
                finally:
                    self._running = 0

    async def _idle(self) -> None:
        """Returns once every batcher of the worker is idle at the same moment."""
        while (busy := next((b for b in self.batchers() if not b.idle), None)) is not None:
            await busy.wait_idle()

    def _drop_stale(self) -> bool:
        """Drops the checks that waited past MAX_AGE_S (the oldest are first); whether any is left."""
        oldest = now_us() - MAX_AGE_S * 1_000_000
        while self._pending and self._pending[0].created_us < oldest:
            self._pending.popleft()
            self.counters["shadow_stale"] += 1  # its answer may be invalidated past the writer's fences
        return bool(self._pending)

    def _take(self, room_in=None) -> list[Check]:
        """The oldest waiting check and those after it that go in the same batch (same model and
        length group), as many as one batch of checks takes: one where rows add to a batch's time (the
        batcher's row model, a CPU: there a row costs more than a batch's own cost), else max_batch.
        With `room_in(batcher)` (how many more checks it may take now), the oldest check whose batcher
        has room, and at most that many; none when no batcher has room."""
        first = next((c for c in self._pending if room_in is None or room_in(c.runtime.batcher) > 0), None)
        if first is None:
            return []
        batcher = first.runtime.batcher
        group = batcher.group_of(len(first.model_input))
        room = 1 if batcher.row_s else min(batcher.max_batch, _share(batcher))
        if room_in is not None:
            room = min(room, room_in(batcher))
        taken, kept = [], deque()
        for check in self._pending:
            same = check.runtime is first.runtime and batcher.group_of(len(check.model_input)) == group
            (taken if same and len(taken) < room else kept).append(check)
        self._pending = kept
        return taken

    async def _check(self, checks: list[Check]) -> None:
        batcher = checks[0].runtime.batcher
        enqueued, failed, preempted = [], [], []
        for check in checks:  # with no await between: the batcher cuts them into one batch
            try:
                enqueued.append((check, batcher.enqueue(check.model_input, None, waits=True)))
            except Exception as exc:
                failed.append(exc)
        outcomes = await asyncio.gather(*(future for _, future in enqueued), return_exceptions=True)
        for (check, _), outputs in zip(enqueued, outcomes):
            if isinstance(outputs, Preempted):
                preempted.append(check)
                continue
            if isinstance(outputs, BaseException):
                failed.append(outputs)
                continue
            try:
                self._settle(check, outputs)
            except Exception as exc:
                failed.append(exc)
        if preempted:  # back in front, in their order: they wait for the next idle moment
            self.counters["shadow_preempted"] += len(preempted)
            self._pending.extendleft(reversed(preempted))
        if failed:  # a check lost is a sample lost, never an answer
            self.counters["shadow_failed"] += len(failed)
            log.warning("%d of %d shadow checks failed", len(failed), len(checks), exc_info=failed[0])

    def _settle(self, check: Check, outputs: dict) -> None:
        if check.agrees is not None:
            agreed = bool(check.agrees(outputs))
        else:
            agreed = check.runtime.labels[int(np.argmax(outputs["scores"]))] == check.served
        check.calibration.verified_hit(check.margin, agreed, check.chance, check.fitted, check.residual)
        self.counters["shadow_agreed" if agreed else "shadow_disagreed"] += 1
        self.judged(check.entry, agreed)
        self.on_checked(check, outputs, agreed)


def _share(batcher) -> int:
    return max(1, int(batcher.max_queue * QUEUE_SHARE))


def _room(batcher) -> int:
    """How many checks go into this busy batcher's queue within their share (then max_queue cannot refuse
    them, and no wait bound applies to them: Batcher.enqueue's `waits`)."""
    return _share(batcher) - batcher.depth


def has_room(batcher) -> bool:
    """Whether background work (a check, an answer's embedding) may join this batcher's queue now."""
    return _room(batcher) > 0


def _ended(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("shadow verification stopped", exc_info=task.exception())
