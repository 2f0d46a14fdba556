"""Dynamic batcher: one task owns the pending requests and cuts them into engine batches.

Requests are grouped by sequence-length bucket (one engine profile each), and cut into batches by
group: a group is a bucket where the engine pads a batch to its profile (TensorRT, CUDA graphs), and a
finer length within one where it runs any length at that length's own cost (ONNX Runtime on a CPU pads
a batch to its longest row): `length_groups` (server/shared/admission.py), steps of at most a quarter
of a length, so a batch's rows pad less. On a 2-core host a Banking77 text (13 tokens at the median) cost
15.8 ms of CPU in batches of 32 padded to their longest row, 10.3 ms in batches of like lengths (ONNX
Runtime, 2 threads). A group is cut when it holds max_batch requests or its oldest request has waited
max_delay. A cut waits for a free engine slot first, so while the engine is busy requests keep joining the
next batch. The engine's recent seconds per text (metrics: what a hit saves) are kept per bucket.

Admission is bounded and answered at once: `enqueue` raises Overloaded past `max_queue` waiting
requests, and when the time the queue implies until this request's batch is done exceeds two thirds of
the caller's deadline or `max_wait_s` (ADMIT_HEADROOM), so an admitted request is one that can finish in
time even if batches run somewhat slower than estimated. That time is the full
batches ahead, this one's included, shared by the engine slots, times the batch duration: the larger of
the recent average, the last batch, and the age of the oldest batch still running (so a machine that
slows down, by contention or a burst of long texts, raises the estimate within one batch, not after
several). The worker seeds it from a timed warmup batch (one text of the longest profile). When a batch
is markedly slower than the estimate, queued requests that can no longer finish before their deadline
are refused at once (Overloaded, counted as `shed`) instead of expiring in the queue; a batch that runs
on past the estimate re-checks them while it runs.

Where an engine's time grows with the rows of a batch (a CPU), one text's time says little about a
burst of long texts: admitted at that estimate, most of such a burst was shed seconds later. So the
warmup also times four rows, and the estimate is at least what that row model gives: a batch of n
rows padded to length b (their group) takes fixed + n x row x b / (longest bucket), summed over the
rows admitted, scaled by how recent batches compared with the model (its `speed`, which starts from
the slots sharing the cores; the queue is re-checked after every batch). A GPU, where a row adds next
to nothing, keeps the batch estimate; short texts cost a proportionally small share of a row. The frontends read the estimate from
every answer frame (`told_wait`: held at the last refused request's wait while work remains) and refuse
before sending, against the same bound (`wait_bound`). Cancelled and expired requests are dropped when
the batch is cut, before they reach the engine.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import heapq
import inspect
import logging
from collections import Counter, deque
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Awaitable, Callable, Sequence

from server.shared.errors import DeadlineExceeded, Overloaded, WorkerUnavailable
from server.shared.admission import admits, bucket_of, discounted, over, wait_bound
from server.shared.process import nicer_executor

log = logging.getLogger("infercache.batcher")

# sequences (token ids, or texts) -> one result (or Exception) each: run in an engine thread, or a
# coroutine (an upstream model's calls) run on the event loop
RunBatch = Callable[[list], list[Any]] | Callable[[list], Awaitable[list[Any]]]
DURATION_WEIGHT = 0.2       # weight of the newest batch in the average batch duration
SLOWDOWN = 1.1              # a batch this much slower than the estimate re-checks the queued deadlines
                            # (when it ends, and every such interval while it still runs)
RECHECK_MIN_S = 0.002       # and at most this often while it runs (a deadline is milliseconds or more)
ROW_MODEL_MIN = 0.5         # the row model is on where a row adds at least this share of one row's batch


@dataclass(eq=False, slots=True)
class _Request:
    ids: Sequence[int]
    bucket: int
    group: int              # the queue it waits in: its bucket, or a finer length group (module docstring)
    deadline: float | None  # loop time
    enqueued: float
    future: asyncio.Future = field(repr=False)

    def dead(self, now: float) -> bool:
        return self.future.done() or (self.deadline is not None and now >= self.deadline)


class _Running:
    """A batch being computed: when it started, its modelled and expected durations, and the timer that
    re-checks the queue while it runs (shed(now) every `period` seconds; none at period 0)."""

    __slots__ = ("batch", "started", "modelled", "expected", "period", "shed", "timer")

    def __init__(self, batch: list[_Request], started: float, modelled: float, expected: float, period: float,
                 shed: Callable[[float], None]) -> None:
        self.batch, self.started, self.modelled, self.expected = batch, started, modelled, expected
        self.period, self.shed = period, shed
        self.timer = asyncio.get_running_loop().call_later(period, self._recheck) if period else None

    def _recheck(self) -> None:
        loop = asyncio.get_running_loop()
        self.shed(loop.time())
        self.timer = loop.call_later(self.period, self._recheck)

    def ended(self) -> None:
        if self.timer is not None:
            self.timer.cancel()


class Batcher:
    def __init__(
        self, run_batch: RunBatch, *, buckets: tuple[int, ...], max_batch: int, max_delay_s: float,
        max_queue: int, concurrency: int = 1, name: str = "batcher", max_wait_s: float = 0.0, nice: int = 0,
        groups: tuple[int, ...] | None = None,
    ) -> None:
        self.run_batch = run_batch          # token ids -> one result per sequence (RunBatch)
        self._on_loop = inspect.iscoroutinefunction(run_batch)
        self.buckets = buckets
        self.groups = groups or buckets     # the lengths a batch is cut by (length_groups), at most the buckets'
        if not set(buckets) <= set(self.groups) or max(self.groups) != max(buckets):
            raise ValueError(f"length groups {self.groups} must include the buckets {buckets} and end with them")
        self.max_batch = max_batch
        self.max_delay_s = max_delay_s
        self.max_queue = max_queue
        self.max_wait_s = max_wait_s        # 0: no bound but the caller's deadline
        self.name = name
        self.concurrency = concurrency
        self.batch_s = 0.0                  # average duration of an engine batch (0: none timed yet)
        self._last_batch_s = 0.0            # the latest batch's duration
        self.fixed_s = 0.0                  # the row model (module docstring): a batch's own cost,
        self.row_s = 0.0                    # a row's of the longest bucket (0: no model),
        self.speed = 1.0                    # and recent batches' duration over the model's
        self._rows: Counter[int] = Counter()  # admitted rows not yet cut, by group (the length they pad to)
        self.counters: Counter[str] = Counter()
        # For /metrics (server/worker/metrics.py): launches by size, engine seconds, and each bucket's
        # recent engine seconds per text (what a hit of that bucket saves).
        self.sizes: Counter[int] = Counter()
        self.seconds = 0.0
        self.text_s: dict[int, float] = {}
        self._incoming: deque[_Request] = deque()
        self._pending: dict[int, deque[_Request]] = {g: deque() for g in self.groups}
        self._waiting = 0                   # admitted, not yet cut into a batch
        self._refused = (0.0, 0.0)          # (expected wait, loop time) of the last request refused for it
        self._running: set[_Running] = set()
        self._wakeup = asyncio.Event()
        self._became_idle = asyncio.Event()  # set when the last batch ends with nothing waiting
        self._slots = asyncio.Semaphore(concurrency)
        self._executor = nicer_executor(nice, concurrency, name)  # the engine's threads (`nice`: steps below the loop's)
        self._closed = False
        self._task = asyncio.get_running_loop().create_task(self._loop(), name=name)
        self._task.add_done_callback(self._loop_ended)

    @property
    def depth(self) -> int:
        return self._waiting

    @property
    def idle(self) -> bool:
        """Nothing waits and no batch runs (low-priority work may go in: server/worker/semantic/shadow.py)."""
        return self._waiting == 0 and not self._running and not self._incoming

    async def wait_idle(self) -> None:
        """Returns once the batcher is idle (woken when it becomes so, not by polling)."""
        while not self.idle:
            self._became_idle.clear()
            await self._became_idle.wait()

    def bucket_of(self, length: int) -> int:
        return bucket_of(self.buckets, length)

    def group_of(self, length: int) -> int:
        """The queue a sequence of `length` tokens waits in: the rows it may share a batch with."""
        return bucket_of(self.groups, length)

    def enqueue(self, ids, deadline: float | None, waits: bool = False) -> asyncio.Future:
        """Admits one sequence; its future gets the engine's result for it. Cancelling the future
        drops the sequence before it reaches the engine. Raises Overloaded when the queue is full.
        `waits`: low-priority work with no deadline that may wait however long (server/worker/semantic/shadow.py): no
        bound on its wait applies (max_wait_s is for callers), only max_queue."""
        if self._closed:
            raise WorkerUnavailable("inference worker is shutting down")
        if self._waiting >= self.max_queue:
            self.counters["rejected_full"] += 1
            raise Overloaded(f"batch queue of {self.name} is full ({self.max_queue} waiting); retry later")
        loop = asyncio.get_running_loop()
        now = loop.time()
        group = self.group_of(len(ids))  # here, not in the owner task: a bad item fails its caller only
        if not waits:
            self._admit(now, deadline, group)
        request = _Request(ids, self.bucket_of(len(ids)), group, deadline, now, loop.create_future())
        self._waiting += 1
        self._rows[group] += 1
        self._incoming.append(request)
        self._wakeup.set()
        return request.future

    def _batch_estimate(self, now: float) -> float:
        """Seconds an engine batch takes now (0: no estimate yet)."""
        oldest = min((running.started for running in self._running), default=now)
        return max(self.batch_s, self._last_batch_s, now - oldest)

    def expected_wait(self, now: float | None = None, group: int | None = None) -> float:
        """Seconds until a request (of length `group`, where known) admitted now would have its result;
        0 when nothing is queued (an empty queue admits anything) or there is no estimate yet."""
        if not self._waiting:
            return 0.0
        batch_s = self._batch_estimate(asyncio.get_running_loop().time() if now is None else now)
        if batch_s <= 0.0:
            return 0.0
        batches = self._batches_queued() + self._starts_batch(group)
        if self.row_s:
            modelled = batches * self.fixed_s + sum(n * self._row_cost(b) for b, n in self._rows.items())
            modelled += 0.0 if group is None else self._row_cost(group)
            batch_s = max(batch_s, modelled * self.speed / batches)
        return batches / self.concurrency * batch_s

    def _batches_queued(self) -> int:
        """The batches the queue makes: each group's rows cut max_batch at a time."""
        return sum(-(-n // self.max_batch) for n in self._rows.values() if n > 0)

    def _starts_batch(self, group: int | None) -> bool:
        """Whether a new request of `group` needs a batch of its own (its group's last is full or there
        is none); of an unknown group, whether no queued batch has room."""
        if group is not None:
            return self._rows[group] % self.max_batch == 0
        return all(n % self.max_batch == 0 for n in self._rows.values() if n > 0)

    def told_wait(self) -> float:
        """What the frontends are told a new request would wait (their admission control): the expected
        wait, or the wait of the last request refused for it, discounted since, if longer, but at most a
        batch longer (the queue may have drained faster than the estimate, or been cancelled), and
        nothing once idle. Without the second, a frontend would refuse almost nothing itself: the worker
        keeps its queue just under the bound both use, its expected wait falls under it again at each
        cut, and every request of a burst would be sent to be refused here."""
        now = asyncio.get_running_loop().time()
        if self.idle:
            self._refused = (0.0, 0.0)
            return 0.0
        expected = self.expected_wait(now)
        return max(expected, min(discounted(*self._refused, now), expected + self._batch_estimate(now)))

    def _row_cost(self, length: int) -> float:
        """A row padded to `length` tokens (its group), under the row model."""
        return self.row_s * length / self.buckets[-1]

    def _admit(self, now: float, deadline: float | None, group: int) -> None:
        """Overloaded when the queue ahead cannot be served within the caller's deadline or max_wait_s,
        with ADMIT_HEADROOM to spare (admits)."""
        expected = self.expected_wait(now, group)
        if not expected:
            return
        bound = wait_bound(self.max_wait_s, None if deadline is None else deadline - now)
        if not admits(expected, bound):
            self.counters["rejected_wait"] += 1
            self._refused = (self.expected_wait(now), now)  # (without this request's own length)
            raise Overloaded(f"{self.name} would answer this in about {expected:.2f} s ({self._waiting} waiting, "
                             f"{self._batch_estimate(now) * 1000:.1f} ms per batch), past {over(bound)}; retry later")

    def _shed(self, now: float) -> None:
        """Refuses queued requests whose batch, at the current estimate, would end after their deadline
        (in the order batches are cut: oldest first)."""
        if not self._waiting:
            return
        batch_s = self._batch_estimate(now)
        if batch_s <= 0.0:
            return
        self._take_incoming()
        queued = heapq.merge(*self._pending.values(), key=lambda r: r.enqueued)
        late, work, batches, in_group = set(), 0.0, 0, Counter()
        for request in queued:  # a request starts a batch where its group's last one is full
            batches += in_group[request.group] % self.max_batch == 0
            in_group[request.group] += 1
            done_at = now + batches / self.concurrency * batch_s
            if self.row_s:  # the row model: the rows ahead and this one, and a batch's own cost each
                work += self._row_cost(request.group)
                done_at = max(done_at, now + (batches * self.fixed_s + work) * self.speed / self.concurrency)
            if request.deadline is not None and done_at > request.deadline > now and not request.future.done():
                late.add(request)  # (one already past its deadline is dropped as expired at the cut)
        if not late:
            return
        for group, queue in self._pending.items():
            self._pending[group] = deque(r for r in queue if r not in late)
        self._waiting -= len(late)
        self._rows.subtract(r.group for r in late)
        self.counters["shed"] += len(late)
        for request in late:
            request.future.set_exception(Overloaded(
                f"{self.name} slowed down ({batch_s * 1000:.1f} ms per batch): this request would not be answered "
                "before its deadline; retry later"))

    def seed_timing(self, seconds: float, rows_seconds: float | None = None, rows: int = 1) -> None:
        """The first estimate, from the worker's warmup (before it serves anything): `seconds` for a
        batch of one row of the longest bucket and, where timed, `rows_seconds` for `rows` such rows (the
        row model's seed). An engine whose rows cost runs its slots on the same cores: while all of them
        run, each batch takes about `concurrency` times as long (ONNX Runtime's two slots gave 1.15x the
        throughput of one), which the model's speed starts from."""
        self.batch_s = seconds
        # A row that adds under half of a batch's own cost (a GPU; timing noise) leaves the model off.
        if rows_seconds is not None and rows > 1 and rows_seconds > seconds * (1 + ROW_MODEL_MIN * (rows - 1)):
            self.row_s = (rows_seconds - seconds) / (rows - 1)
            self.fixed_s = max(0.0, seconds - self.row_s)
            self.speed = float(self.concurrency)

    async def submit(self, ids, deadline: float | None) -> Any:
        return await self.enqueue(ids, deadline)

    async def close(self) -> None:
        """Stops admitting, lets everything admitted run, then stops the owner task."""
        self._closed = True
        while self._waiting or self._running:
            self._wakeup.set()
            await asyncio.sleep(0.01)
        self._task.cancel()
        self._executor.shutdown(wait=False)

    # ---- the owner task ----------------------------------------------------------------------------

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._take_incoming()
            now = loop.time()
            group, next_at = self._next_cut(now)
            if group is None:
                if self.idle:  # (shedding may have emptied the queue with no batch left to end)
                    self._became_idle.set()
                # (a timer where a group falls due, not wait_for: it wraps each wait in a task of its own)
                due = None if next_at is None else loop.call_at(next_at, self._wakeup.set)
                await self._wakeup.wait()
                if due is not None:
                    due.cancel()
                self._wakeup.clear()
                continue
            await self._slots.acquire()     # engine busy: the batches keep growing meanwhile
            self._take_incoming()
            now = loop.time()
            # An older group may lead now, or none: while this waited, a slow batch may have shed
            # every request of the group that was due.
            group, _ = self._next_cut(now)
            batch = self._cut(group, now) if group is not None else []
            if not batch:
                self._slots.release()
                continue
            self._start(batch, now)

    def _loop_ended(self, task: asyncio.Task) -> None:
        """The owner task ends only at close; anything else is a bug that would leave every request
        queued forever: said loudly, not kept in an exception nobody reads."""
        if not task.cancelled() and task.exception() is not None:
            log.critical("batcher %s stopped: %r; this worker answers no more misses until restarted",
                         self.name, task.exception(), exc_info=task.exception())

    def _take_incoming(self) -> None:
        while self._incoming:
            request = self._incoming.popleft()
            self._pending[request.group].append(request)

    def _next_cut(self, now: float) -> tuple[int | None, float | None]:
        """(group to cut now, None) or (None, when the next group falls due; None if all are empty).

        A group is due when full or when its oldest request has waited max_delay; among due groups
        the one whose oldest request has waited longest goes first, so no group starves another."""
        due, next_at = [], None
        for group, queue in self._pending.items():
            if not queue:
                continue
            head = queue[0].enqueued
            if len(queue) >= self.max_batch or head + self.max_delay_s <= now:
                due.append((head, group))
            elif next_at is None or head + self.max_delay_s < next_at:
                next_at = head + self.max_delay_s
        return (min(due)[1], None) if due else (None, next_at)

    def _cut(self, group: int, now: float) -> list[_Request]:
        queue, batch = self._pending[group], []
        while queue and len(batch) < self.max_batch:
            request = queue.popleft()
            self._waiting -= 1
            self._rows[request.group] -= 1
            if request.dead(now):
                if not request.future.done():
                    self.counters["dropped_expired"] += 1
                    request.future.set_exception(DeadlineExceeded("deadline passed while queued"))
                else:
                    self.counters["dropped_cancelled"] += 1
                continue
            batch.append(request)
        return batch

    def _start(self, batch: list[_Request], now: float) -> None:
        """Hands a batch to an engine thread on the owner task's turn, and the thread's end back to the
        loop in one callback (a task per batch, and an asyncio future wrapping the thread's, cost a loop
        iteration each on every miss's path); a coroutine's batch is a task of the loop's. While it runs
        past its estimate, its age raises the estimate: the queue is re-checked every SLOWDOWN x expected
        (RECHECK_MIN_S at least) until it ends; a timer, not a wait per period."""
        loop = asyncio.get_running_loop()
        modelled = self.fixed_s + len(batch) * self._row_cost(batch[0].group)
        expected = max(self.batch_s, self._last_batch_s, modelled * self.speed)
        running = _Running(batch, now, modelled, expected, expected and max(RECHECK_MIN_S, SLOWDOWN * expected),
                           self._shed)
        self._running.add(running)
        if self._on_loop:
            loop.create_task(self.run_batch([r.ids for r in batch])).add_done_callback(partial(self._ended, running))
            return

        def ended(thread_future: concurrent.futures.Future) -> None:  # (in the engine thread)
            with contextlib.suppress(RuntimeError):  # (the loop closed meanwhile: nobody waits for these answers)
                loop.call_soon_threadsafe(self._ended, running, thread_future)

        self._executor.submit(self.run_batch, [r.ids for r in batch]).add_done_callback(ended)

    def _ended(self, running: _Running, future: concurrent.futures.Future | asyncio.Future) -> None:
        """A batch's results to its requests, its timing to the estimates; its slot freed."""
        batch, loop = running.batch, asyncio.get_running_loop()
        try:
            running.ended()
            if future.cancelled():
                raise WorkerUnavailable("inference worker is shutting down")
            results = future.result()  # (the engine's exception, raised here, fails the batch below)
            took = loop.time() - running.started
            self._running.discard(running)
            self._last_batch_s = took
            self.batch_s = took if self.batch_s <= 0.0 else self.batch_s + DURATION_WEIGHT * (took - self.batch_s)
            if self.row_s and running.modelled > 0.0:
                self.speed += DURATION_WEIGHT * (took / running.modelled - self.speed)
            # What was admitted at an older estimate may not finish in time: re-checked when a batch
            # ran slow, and after every batch under the row model (its speed moves a little each batch).
            if took > SLOWDOWN * running.expected or self.row_s:
                self._shed(loop.time())
            for request, result in zip(batch, results, strict=True):  # (a row's error fails that row alone)
                if not request.future.done():
                    if isinstance(result, Exception):
                        request.future.set_exception(result)
                    else:
                        request.future.set_result(result)
            self.counters["batches"] += 1
            self.counters["batched_requests"] += len(batch)
            self.sizes[len(batch)] += 1
            self.seconds += took
            per_text, bucket = took / len(batch), batch[0].bucket
            known = self.text_s.get(bucket)
            self.text_s[bucket] = per_text if known is None else known + DURATION_WEIGHT * (per_text - known)
        except Exception as exc:  # (also results that do not match the batch: its requests fail, not the loop)
            log.exception("engine batch of %d failed", len(batch))
            self.counters["batch_errors"] += 1
            for request in batch:
                if not request.future.done():
                    request.future.set_exception(exc)
        finally:
            self._running.discard(running)
            self._slots.release()
            if self.idle:
                self._became_idle.set()
