"""A frontend's connections to the inference workers: one long-lived item connection per worker,
items routed by key, failover while a worker is down.

Each WorkerLink has one task that owns its connection and reconnects it; everything queued during one
event-loop iteration goes to the worker as one frame, and each answer resolves its item's future by id.
Routing: an item goes to worker `route % n` (route = the key's hash, or the namespace's for semantic models, so identical
requests meet in one worker and a namespace's semantic index lives in one worker); while that worker is
down, the next live one takes it; items in flight on a worker that dies are sent again elsewhere
(computing a miss twice is harmless), within the caller's deadline.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import Counter
from pathlib import Path

import grpc

from infercache.v1 import worker_pb2, worker_pb2_grpc
from server.shared.admission import admits, discounted, over, wait_bound
from server.shared.errors import DeadlineExceeded, Overloaded, WorkerUnavailable, from_worker_error, from_wire
from server.shared.framing import FrameProtocol, items_socket

log = logging.getLogger("infercache.workers")

MARGIN_S = 0.05        # answer UNAVAILABLE this long before the caller's own deadline fires
RECONNECT_S = 0.05     # first retry after a connection the worker dropped; doubles up to MAX_RECONNECT_S
MAX_RECONNECT_S = 0.5
LISTEN_POLL_S = 0.02   # a worker not listening (loading, restarting) is tried this often: a refused connect
                       # costs microseconds, and its first misses flow as soon as it listens
COPY_DELAY_S = 0.005   # copies into L1 (WorkerLink.send) wait at most this long for a write
STABLE_S = 1.0         # a connection that lived this long resets the backoff


class LinkLost(Exception):
    """The connection to a worker broke while the item was in flight: send it elsewhere."""


def _channel(socket_path: Path) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(
        f"unix:{socket_path}",
        options=[
            # Reconnect quickly after a worker restart (gRPC's default backoff grows to minutes).
            ("grpc.initial_reconnect_backoff_ms", 50),
            ("grpc.min_reconnect_backoff_ms", 50),
            ("grpc.max_reconnect_backoff_ms", 500),
        ],
    )


def _deadline_passed() -> DeadlineExceeded:
    return DeadlineExceeded("deadline passed while the worker computed")


async def _first_refusal(sent: dict):
    """Waits until every item sent is answered, or one is answered with an error, which it returns (None
    otherwise): a call of many texts whose last ones the worker refused at once (its queue too long) is
    refused then, not after the texts before them were computed."""
    loop = asyncio.get_running_loop()
    refused = loop.create_future()
    futures = [future for _, _, future in sent.values()]

    def on_answer(future: asyncio.Future) -> None:
        if not refused.done() and not future.cancelled() and future.exception() is None and future.result().code:
            refused.set_result(future.result())

    for future in futures:
        future.add_done_callback(on_answer)
    every = asyncio.gather(*futures, return_exceptions=True)
    try:
        await asyncio.wait((every, refused), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for future in futures:
            future.remove_done_callback(on_answer)
    return refused.result() if refused.done() else None


def _expire(sent: dict, expired: list) -> None:
    """At a compute's deadline: its items in flight fail (their awaiter raises DeadlineExceeded), and
    `expired` says so to items sent later (asyncio may run a timer a clock tick early)."""
    expired.append(True)
    for _, _, future in sent.values():
        if not future.done():
            future.set_exception(_deadline_passed())


class WorkerLink:
    """One worker: its item connection (server/shared/framing.py) and a gRPC channel for unary calls. One task
    owns the connection: it (re)connects and waits for the connection to end."""

    def __init__(self, index: int, socket_path: Path, on_change, counters: Counter) -> None:
        self.index = index
        self.items_path = items_socket(socket_path)
        self.channel = _channel(socket_path)
        self.stub = worker_pb2_grpc.WorkerStub(self.channel)
        self.up = False
        self.counters = counters             # the frontend's, written on its event loop only
        self._on_change = on_change          # called when `up` flips
        self._protocol: FrameProtocol | None = None
        self._pending: dict[int, asyncio.Future] = {}
        self._streams: dict[int, asyncio.Queue] = {}  # generations: their frames as they come
        # (model, version) -> (seconds to answer a new item, loop time told): from the last answer frame
        self._waits: dict[tuple[str, str], tuple[float, float]] = {}
        self._ids = itertools.count(1)
        self._closing = False
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"worker-link-{index}")

    def submit(self, fill, timeout_s: float) -> tuple[int, asyncio.Future]:
        """Queues one item (`fill(item)` sets its fields; the worker drops it after `timeout_s`): its id
        and the future of its ComputeResult. Whoever gives up on the future calls forget(id)."""
        item_id = self._queue(fill, timeout_s)
        future = self._pending[item_id] = asyncio.get_running_loop().create_future()
        return item_id, future

    def _queue(self, fill, timeout_s: float) -> int:
        """Adds one item to the next frame (sent at the end of this loop iteration): its id."""
        if not self.up:
            raise LinkLost()
        item = self._protocol.out.items.add()
        fill(item)
        item.timeout_s = timeout_s
        item.id = item_id = next(self._ids)
        self._protocol.flush_soon()
        return item_id

    def submit_stream(self, fill, timeout_s: float) -> tuple[int, asyncio.Queue]:
        """Queues one generation item: its id and the queue its frames arrive in (ComputeResults, the
        last without `more`; LinkLost if the connection breaks first). Whoever stops reading calls
        forget(id)."""
        item_id = self._queue(fill, timeout_s)
        frames = self._streams[item_id] = asyncio.Queue()
        return item_id, frames

    def send(self, fill) -> None:
        """Queues one item that gets no answer (a record a frontend answered from, to copy into L1): it
        goes with the next items sent, or within COPY_DELAY_S."""
        fill(self._protocol.out.items.add())
        self._protocol.flush_later(COPY_DELAY_S)

    def forget(self, item_id: int) -> None:
        """Nobody waits for the item any more: its worker is told, so it need not compute it."""
        if (self._pending.pop(item_id, None) or self._streams.pop(item_id, None)) is not None and self.up:
            self._protocol.out.cancel.append(item_id)
            self._protocol.flush_soon()

    def _on_frame(self, frame: bytes) -> None:
        batch = worker_pb2.ResultBatch.FromString(frame)
        for result in batch.results:
            future = self._pending.pop(result.id, None)
            if future is not None:
                if not future.done():
                    future.set_result(result)
            elif (frames := self._streams.get(result.id)) is not None:
                frames.put_nowait(result)
                if not result.more:
                    del self._streams[result.id]
        now = asyncio.get_running_loop().time()
        self._waits = {(w.model, w.version): (w.seconds, now) for w in batch.waits}

    def queue_wait(self, model: str, version: str, now: float) -> float:
        """Seconds until the worker would answer a new item of this model version, from its last answer
        frame less the time since (the queue drains meanwhile); 0 when it told of none."""
        seconds, told = self._waits.get((model, version), (0.0, now))
        return discounted(seconds, told, now)

    def _on_flush(self, out) -> None:
        self.counters["frames"] += 1
        self.counters["frame_items"] += len(out.items)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        delay = RECONNECT_S
        while not self._closing:
            lost = loop.create_future()
            try:
                _, self._protocol = await loop.create_unix_connection(
                    lambda: FrameProtocol(self._on_frame, lambda exc: lost.done() or lost.set_result(exc),
                                          worker_pb2.ComputeBatch, self._on_flush),
                    str(self.items_path))
            except OSError:  # not listening yet, or restarting
                await asyncio.sleep(LISTEN_POLL_S)
                continue
            self._set_up(True)
            connected_at = loop.time()
            try:
                await lost
            finally:
                self._set_up(False)
            if loop.time() - connected_at > STABLE_S:  # a worker that accepts and drops at once backs off
                delay = RECONNECT_S
            else:
                await asyncio.sleep(delay)
                delay = min(MAX_RECONNECT_S, delay * 2)

    def _set_up(self, up: bool) -> None:
        if up == self.up:
            return
        self.up = up
        if not up:
            self._waits = {}
            pending, self._pending = self._pending, {}
            for future in pending.values():
                if not future.done():
                    future.set_exception(LinkLost())
            streams, self._streams = self._streams, {}
            for frames in streams.values():
                frames.put_nowait(LinkLost())
            if not self._closing:
                self.counters["worker_lost"] += 1
                self.counters["items_lost_with_worker"] += len(pending) + len(streams)
                log.warning("worker %d unreachable; its keys go to the other workers meanwhile", self.index)
        else:
            log.info("worker %d connected", self.index)
        self._on_change()

    async def close(self) -> None:
        """Closes the connection (the frontend drained its calls first) and the channel."""
        self._closing = True
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        if self._protocol is not None:
            self._protocol.close()
        await self.channel.close()


class WorkerPool:
    def __init__(self, socket_paths: list[Path], *, wait_s: float, default_timeout_s: float, counters: Counter,
                 max_queue_wait_s: float = 0.0) -> None:
        self.wait_s = wait_s
        self.max_queue_wait_s = max_queue_wait_s  # 0: only the caller's deadline bounds the queue wait
        self.default_timeout_s = default_timeout_s
        self.counters = counters
        self._changed = asyncio.Event()
        self.links = [WorkerLink(i, path, self._changed.set, counters) for i, path in enumerate(socket_paths)]

    async def all_up(self, timeout: float | None = None) -> bool:
        """Waits until every worker's connection is open (at most `timeout` seconds); True if they are."""
        loop = asyncio.get_running_loop()
        give_up = None if timeout is None else loop.time() + timeout
        while not all(link.up for link in self.links):
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), None if give_up is None else give_up - loop.time())
            except TimeoutError:
                return False
        return True

    def _live_link(self, route: int, avoid: set[WorkerLink] | None) -> WorkerLink | None:
        """The item's own worker if it is up, else the next live one, or None. Workers in `avoid` lost
        this item already; they are taken last."""
        n = len(self.links)
        own = self.links[route % n]
        if own.up and (avoid is None or own not in avoid):
            return own
        live = [link for link in (self.links[(route + k) % n] for k in range(n)) if link.up]
        if not live:
            return None
        if live[0] is not own:
            self.counters["rerouted"] += 1  # the item's own worker is down
        return next((link for link in live if avoid is None or link not in avoid), live[0])

    async def _link_for(self, route: int, avoid: set[WorkerLink] | None, deadline: float) -> WorkerLink:
        """_live_link, waiting (up to worker_wait_s, within the deadline) while no worker is up."""
        loop = asyncio.get_running_loop()
        give_up = min(loop.time() + self.wait_s, deadline - MARGIN_S)
        while (link := self._live_link(route, avoid)) is None:
            remaining = give_up - loop.time()
            if remaining <= 0:
                raise WorkerUnavailable("no inference worker is reachable (restarting?); retry")
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except TimeoutError:
                pass
        return link

    def admit(self, model: str, version: str, routes, time_remaining: float | None) -> None:
        """Admission control: Overloaded, before anything is sent, when a worker these routes go to told
        that new items of this model version would wait longer than allowed (with the worker's own
        headroom: admission.admits): the budget the items carry (the caller's deadline, or worker_timeout_s
        where it set none) or server.max_queue_wait_s. What the worker tells is held at its last refusal's
        wait while work remains (Batcher.told_wait), so a burst is refused here, not sent to be refused
        there. The worker checks again when the items arrive (its queue may have grown)."""
        bound = wait_bound(self.max_queue_wait_s, self._budget(time_remaining))
        now = asyncio.get_running_loop().time()
        n = len(self.links)
        for index in {route % n for route in routes}:
            wait = self.links[index].queue_wait(model, version, now)
            if not admits(wait, bound):
                self.counters["rejected_wait"] += 1
                raise Overloaded(f"worker {index} would answer {model} {version} in about {wait:.2f} s, past "
                                 f"{over(bound)}; retry later")

    def _budget(self, time_remaining: float | None) -> float:
        """Seconds a call to the workers may take: the caller's deadline, or worker_timeout_s where it set none."""
        return self.default_timeout_s if time_remaining is None else time_remaining

    async def compute(self, items: list[tuple[int, object]], time_remaining: float | None) -> list:
        """ComputeResults of items [(route, fill)], in order; fails with the first item's error. Items
        lost with a worker that died are sent again to another one, within the deadline. The path of
        every miss: a live worker is taken without awaiting, the deadline is one timer that fails the
        items in flight (asyncio.timeout cost twice as much per call), and an item that ends unanswered
        (an error, the deadline, the caller gone) is forgotten here rather than through a callback per
        future."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._budget(time_remaining)
        results: list = [None] * len(items)
        avoid: dict[int, set[WorkerLink]] = {}  # item -> the workers it was lost with
        todo = range(len(items))
        sent: dict[int, tuple[WorkerLink, int, asyncio.Future]] = {}
        expired: list = []
        expiry = loop.call_at(deadline, _expire, sent, expired)
        attempts = 0
        try:
            while todo:
                attempts += 1
                if attempts > len(self.links) + 1:  # a request that takes every worker down is not retried forever
                    raise WorkerUnavailable(f"lost the inference worker {attempts - 1} times while computing; retry")
                sent.clear()
                lost = []
                for i in todo:
                    route, fill = items[i]
                    link = self._live_link(route, avoid.get(i)) or await self._link_for(
                        route, avoid.get(i), deadline)
                    if len(self.links) > 1:
                        avoid.setdefault(i, set()).add(link)
                    try:
                        sent[i] = (link, *link.submit(fill, max(0.001, deadline - loop.time())))
                    except LinkLost:
                        lost.append(i)
                if expired or loop.time() >= deadline:  # (passed while a link was awaited: nothing to fail then)
                    raise _deadline_passed()
                if len(sent) > 1 and (refusal := await _first_refusal(sent)) is not None:
                    raise from_wire(refusal.code, refusal.error)
                for i, (_, _, future) in sent.items():
                    try:
                        result = await future
                    except LinkLost:
                        lost.append(i)
                        continue
                    if result.code:
                        raise from_wire(result.code, result.error)
                    results[i] = result
                todo = lost
        finally:
            expiry.cancel()
            for i, (link, item_id, future) in sent.items():
                if results[i] is None:  # unanswered: its worker need not compute it
                    if not future.done():
                        future.cancel()
                    elif not future.cancelled():
                        future.exception()  # (retrieved: asyncio logs an exception nobody retrieved)
                    link.forget(item_id)
            # A raised DeadlineExceeded is also its future's: without these references its traceback's
            # frame would hold it in a cycle until the collector's next pass.
            sent.clear()
            future = None
        return results

    async def stream(self, route: int, fill, time_remaining: float | None):
        """The frames of one generation item (ComputeResults; the last one has no `more`), as they come.
        Before its first frame, a generation lost with its worker is sent to another one; after it, the
        caller has part of the answer and the call fails with UNAVAILABLE (never a hang). Ends with an
        error frame's error, or DeadlineExceeded at the deadline. Closing the iterator early (the caller
        went away) tells the worker, which frees the generation's place at its next step."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._budget(time_remaining)
        avoid: set[WorkerLink] = set()
        started = False
        while True:
            link = self._live_link(route, avoid) or await self._link_for(route, avoid, deadline)
            avoid.add(link)
            try:
                item_id, frames = link.submit_stream(fill, max(0.001, deadline - loop.time()))
            except LinkLost:
                continue
            held = None  # a frame taken from the queue while merging, not merged: the next one
            try:
                while True:
                    remaining = deadline - loop.time()
                    if remaining <= 0:
                        raise _deadline_passed()
                    if held is not None:
                        frame, held = held, None
                    else:
                        try:
                            frame = await asyncio.wait_for(frames.get(), remaining)
                        except TimeoutError:
                            raise _deadline_passed() from None
                    if isinstance(frame, LinkLost):
                        break
                    if frame.code:
                        raise from_wire(frame.code, frame.error)
                    if frame.more:
                        held = _merge_queued(frame, frames)
                    started = True
                    yield frame
                    if not frame.more:
                        return
            finally:
                link.forget(item_id)
            if started or len(avoid) > len(self.links):
                raise WorkerUnavailable("the inference worker was lost while it generated this answer; retry")

    def send(self, route: int, fill) -> bool:
        """An item without an answer to the route's worker, or the next live one; False when none is up
        (what it carries is then dropped: it is a copy)."""
        n = len(self.links)
        for step in range(n):
            link = self.links[(route + step) % n]
            if link.up:
                link.send(fill)
                return True
        return False

    async def call_all(self, method: str, request, time_remaining: float | None) -> list:
        """The same unary call on every live worker (at least one, waiting for it as `compute` does)."""
        await self._link_for(0, None, asyncio.get_running_loop().time() + self._budget(time_remaining))
        live = [link for link in self.links if link.up]
        return await asyncio.gather(*(self.call(link, method, request, time_remaining) for link in live))

    async def call(self, link: WorkerLink, method: str, request, time_remaining: float | None):
        """A unary call (Invalidate, Stats) on one worker."""
        try:
            return await getattr(link.stub, method)(request, timeout=self._budget(time_remaining))
        except grpc.aio.AioRpcError as exc:
            raise from_worker_error(exc.code(), exc.details() or "") from None

    async def close(self) -> None:
        await asyncio.gather(*(link.close() for link in self.links))


def _merge_queued(frame, frames: asyncio.Queue):
    """Deltas that queued up behind `frame` (its caller reads slower than the model writes) join it: one
    message for them all, not one each. Returns the first queued frame that is not a delta, if any."""
    while not frames.empty():
        following = frames.get_nowait()
        if isinstance(following, LinkLost) or following.code or not following.more:
            return following
        frame.text += following.text
        frame.token_ids.extend(following.token_ids)
    return None
