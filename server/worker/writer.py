"""A worker's store writer in a process of its own.

Why a process: py-lmdb releases the GIL inside every call (get, put, commit), so a write-behind thread
beside the worker's event loop hands the GIL back and forth on each LMDB call. Measured with the null
engine and items sent straight to one worker (bench/worker_capacity.py, 2-core machine, the worker alone
on one core), the thread held the worker to 18k items/s with one item per frame and 20k with 32 per
frame, against 44k and 62k with nothing written. The process runs the same WriteBehind
(cachestore/writer.py) without a thread of its own: one thread reads the worker's frames, commits what
arrived (one transaction per batch; puts wait up to `cache.group_commit_ms` for others to join it) and
answers, so nothing inside it contends either; the worker's share of a write is a few protobuf field sets.

The worker side (`WriterProcess`) has WriteBehind's interface: put (with on_done), invalidate and
flush (concurrent futures), counters, store (the worker's own read-only handle) and on_semantic. It
lives on the worker's event loop: operations queued during one loop iteration go as one StoreOps frame
(protos/infercache/v1/writer.proto) over a socket pair, and the process answers with StoreEvents: which
puts are handled (puts are numbered in the order sent), invalidations' counts, the semantic rows each
commit added or removed, and its counters.

The process stops when its socket closes, after committing what it was sent: at the worker's close, and
when the worker dies (kill -9 included: nothing it sent is lost). If the process dies first, the worker
is told (`on_lost`: it stops, and the supervisor starts a new one), every waiting callback and future is
released, and further writes are dropped.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import socket
import threading
from collections import Counter, deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import numpy as np

from cachestore import records
from cachestore.env import Store, StoreSettings
from cachestore.errors import StoreError
from cachestore.keys import Namespace, Selector
from cachestore.semantic_log import Row, SemanticEntry
from infercache.v1 import writer_pb2
from server.shared.errors import WorkerUnavailable
from server.shared.framing import FrameProtocol
from server.worker.writer_child import main as child_main

log = logging.getLogger("infercache.writer_process")

START_TIMEOUT_S = 120.0  # opening a large store can take a while (its integrity was checked before)
# Puts sent and not yet handled, at most: past it new puts are dropped (a later miss computes them
# again), so a writer that falls behind, or hangs, costs neither the worker's memory nor its answers.
# Seen on the H200: four workers at 69k MiniLM texts/s outran their writers (one LMDB write lock).
MAX_BACKLOG = 50_000
# Group commit (`cache.group_commit_ms`, passed as group_commit_s): puts wait up to that long for others
# to share their transaction. A commit under random keys writes about a page per put and fsyncs: with one
# put per commit, as at a few thousand misses/s, the writer spent 169-185 us of CPU per miss (2-core
# machine, null engine), 54-61 us with a 10 ms wait. At a CPU host's few hundred misses/s a 10 ms wait
# still left a handful of puts per commit; 50 ms cuts the writer's CPU per put there (bench/group_commit.py:
# 240 vs 140 us at 500 puts/s in frames of 8; frames of 32, one per 64 ms, gain nothing). Invalidations and
# flushes commit at once. The worker answers a computed key from memory until its put is handled
# (COALESCED), so an exact repeat is not recomputed meanwhile; a near-duplicate may be (semantic index rows
# come from commits: a text's row is searchable up to the window plus a commit later).


class WriterProcess:
    """The worker's handle on its writer process; see the module docstring. Use `await start(...)`."""

    def __init__(self, process, what: str, on_lost: Callable[[], None] | None, max_backlog: int = MAX_BACKLOG) -> None:
        self.process = process
        self.what = what
        self.on_lost = on_lost             # told once if the process dies while the worker still needs it
        self.max_backlog = max_backlog
        self.on_semantic: Callable[[list[Row], list[tuple[bytes, int]]], None] | None = None
        self._reported: Counter[str] = Counter()  # the process's counters, as of its last frame
        self._own: Counter[str] = Counter()       # this side's (notify_errors)
        self.store: Store | None = None
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._protocol: FrameProtocol | None = None
        self._sent = 0                     # puts sent (their numbers)
        self._handled = 0                  # the last put number the process said it handled
        self._callbacks: deque[tuple[int, Callable[[], None]]] = deque()  # (put number, on_done)
        self._requests: dict[int, Future] = {}
        self._next_request = 0
        self._ready: asyncio.Future = self._loop.create_future()
        self._ended: asyncio.Future = self._loop.create_future()
        self._closing = False
        self.dead = False

    @classmethod
    async def start(cls, settings: StoreSettings, *, batch_max: int, sweep_interval_s: float, max_ttl_s: int,
                    what: str, log_level: str, role: str, on_lost: Callable[[], None] | None = None,
                    group_commit_s: float, max_backlog: int = MAX_BACKLOG) -> "WriterProcess":
        """Starts the process, waits until it has the store open, then opens the worker's read-only
        handle. StoreError when the store cannot be opened (the process has exited then)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        process = multiprocessing.get_context("spawn").Process(
            target=child_main, name=f"{role}-writer",
            args=(settings, batch_max, sweep_interval_s, max_ttl_s, group_commit_s, theirs, log_level, f"{role} writer"))
        # From a thread started here, not the loop's default executor (a CPU worker lowers that one's
        # priority): the writer, which commits, sweeps and answers Invalidate, keeps the loop's.
        starter = ThreadPoolExecutor(1, thread_name_prefix="writer-start")
        try:
            await asyncio.get_running_loop().run_in_executor(starter, process.start)
        finally:
            starter.shutdown(wait=False)
        theirs.close()
        self = cls(process, what, on_lost, max_backlog)
        _, self._protocol = await self._loop.create_unix_connection(
            lambda: FrameProtocol(self._on_frame, self._on_end, writer_pb2.StoreOps), sock=ours)
        try:
            await asyncio.wait_for(asyncio.shield(self._ready), START_TIMEOUT_S)
            self.store = await asyncio.to_thread(Store, settings, readonly=True)
        except BaseException:
            await self.close()
            raise
        return self

    # ---- WriteBehind's interface (any thread; the work is done on the loop) --------------------------

    @property
    def counters(self) -> Counter[str]:
        counters = self._reported + self._own
        # A gauge: puts the process has not handled yet (none once it is gone: they were released).
        counters["backlog"] = 0 if self.dead else self._sent - self._handled
        return counters

    def put(self, key: bytes, ns: Namespace, record: records.Record,
            on_done: Callable[[], None] | None = None, semantic: SemanticEntry | None = None) -> None:
        """on_done runs on the worker's loop once the put was committed or dropped."""
        if threading.get_ident() != self._loop_thread:
            try:
                self._loop.call_soon_threadsafe(self.put, key, ns, record, on_done, semantic)
            except RuntimeError:  # the loop has closed: the worker is gone, so is the write
                pass
            return
        behind = self._sent - self._handled >= self.max_backlog
        if self.dead or self._closing or self._protocol is None or behind:
            if behind:
                self._own["dropped_backlog"] += 1
            if on_done is not None:
                on_done()
            return
        if self._protocol.out.requests:  # a frame applies its puts before its requests: keep the order
            self._protocol.flush_now()
        put = self._protocol.out.puts.add()
        put.key, put.payload = key, record.payload
        put.tenant, put.model, put.version = ns.tenant, ns.model, ns.version
        put.created_us, put.expires_us = record.created_us, record.expires_us
        if semantic is not None:
            put.semantic, put.answer = True, semantic.answer
            put.embedding = np.asarray(semantic.embedding, dtype="<f4").tobytes()
        self._sent += 1
        if on_done is not None:
            self._callbacks.append((self._sent, on_done))
        self._protocol.flush_soon()

    def invalidate(self, selector: Selector) -> Future:
        """Future of the number of entries removed; ordered after every put made before it."""
        return self._request(selector)

    def flush(self) -> Future:
        """Future that completes once everything put before it was handled (committed or dropped)."""
        return self._request(None)

    def _request(self, selector: Selector | None) -> Future:
        done: Future = Future()
        if threading.get_ident() == self._loop_thread:
            self._send_request(selector, done)
            return done
        try:
            self._loop.call_soon_threadsafe(self._send_request, selector, done)
        except RuntimeError:
            done.set_exception(self._stopped())
        return done

    def _stopped(self) -> WorkerUnavailable:
        return WorkerUnavailable(f"the {self.what}'s writer process is gone; retry")

    def _send_request(self, selector: Selector | None, done: Future) -> None:
        if self.dead or self._closing or self._protocol is None:
            done.set_exception(self._stopped())
            return
        self._next_request += 1
        request = self._protocol.out.requests.add(id=self._next_request)
        if selector is not None:
            wanted = request.invalidate
            wanted.SetInParent()
            for field in ("tenant", "model", "version", "key"):
                if (value := getattr(selector, field)) is not None:
                    setattr(wanted, field, value)
        self._requests[self._next_request] = done
        self._protocol.flush_soon()

    async def close(self, timeout: float = 30.0) -> None:
        """Sends what is queued, lets the process commit it and exit (killed after `timeout`)."""
        self._closing = True
        if self._protocol is not None and self._protocol.transport is not None:
            await asyncio.sleep(0)  # the frame queued in this loop iteration goes first
            transport = self._protocol.transport
            if transport is not None and not transport.is_closing():
                transport.write_eof()
            try:
                await asyncio.wait_for(asyncio.shield(self._ended), timeout)
            except TimeoutError:
                log.error("%s writer did not finish within %.0f s; killing it", self.what, timeout)
        await asyncio.to_thread(self.process.join, 5.0)
        if self.process.is_alive():
            self.process.kill()
            await asyncio.to_thread(self.process.join)
        if self.store is not None:
            self.store.close()

    # ---- events from the process (on the loop) -----------------------------------------------------

    def _on_frame(self, frame: bytes) -> None:
        events = writer_pb2.StoreEvents.FromString(frame)
        if events.failed and not self._ready.done():
            self._ready.set_exception(StoreError(events.failed))
        elif events.ready and not self._ready.done():
            self._ready.set_result(None)
        if events.counters:
            self._reported = Counter(events.counters)
        self._handled = max(self._handled, events.handled)
        callbacks = self._callbacks
        while callbacks and callbacks[0][0] <= self._handled:
            self._called(callbacks.popleft()[1])
        for done in events.done:
            future = self._requests.pop(done.id, None)
            if future is None or future.done():  # (its caller went away: cancelled)
                continue
            if done.error:
                future.set_exception(StoreError(done.error))
            else:
                future.set_result(done.removed)
        if (events.added or events.removed) and self.on_semantic is not None:
            added = [Row(r.ns_id, r.label, r.key, r.answer, np.frombuffer(r.embedding, dtype="<f4"))
                     for r in events.added]
            try:
                self.on_semantic(added, [(r.ns_id, r.label) for r in events.removed])
            except Exception:  # the index misses these rows; the log in LMDB is still complete
                self._own["notify_errors"] += 1
                log.exception("semantic index notification failed")

    @staticmethod
    def _called(on_done: Callable[[], None]) -> None:
        try:
            on_done()
        except Exception:
            log.exception("a write's callback failed")

    def _on_end(self, exc: Exception | None) -> None:
        self.dead = True
        if not self._ended.done():
            self._ended.set_result(None)
        started = self._ready.done() and self._ready.exception() is None
        if not self._ready.done():  # (start() says so: the worker serves without the store)
            self._ready.set_exception(StoreError(f"the {self.what}'s writer process ended while starting"))
        while self._callbacks:  # nothing waits forever for a write that will never be told of
            self._called(self._callbacks.popleft()[1])
        requests, self._requests = self._requests, {}
        for future in requests.values():
            if not future.done():
                future.set_exception(self._stopped())
        if started and not self._closing:
            log.error("the %s's writer process ended unexpectedly; writes are dropped", self.what)
            if self.on_lost is not None:
                self.on_lost()
