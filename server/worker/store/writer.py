"""A worker's store writer in a process of its own.

Why a process, and what it measured against a thread: docs/architecture.md ("Writers"). The process
(server/worker/store/writer_child.py) runs the same WriteBehind (cachestore/writer.py) without a thread of
its own: one thread reads the worker's frames, commits what arrived and answers.

The worker side (`WriterProcess`) has WriteBehind's interface: put (with on_done), invalidate and
flush (concurrent futures), counters, store (the worker's own read-only handle) and on_semantic. It
lives on the worker's event loop: operations queued during one loop iteration go as one StoreOps frame
(protos/infercache/v1/writer.proto) over a socket pair, and the process answers with StoreEvents: which
puts are handled (puts are numbered in the order sent), invalidations' counts, the semantic rows each
commit added or removed, and its counters.

The process stops when its socket closes, after committing what it was sent: at the worker's close, and
when the worker dies (kill -9 included: nothing it sent is lost). If the process dies first (kill -9, the
OOM killer, a crash), nothing the worker answered is lost either: every frame sent stays here until the
process has handled all of it, a new process is started at once, and it is handed what the dead one had
not confirmed (the puts in order, the requests it had not answered) and what was queued meanwhile, with
the invalidations of the last FENCE_S, which it goes on refusing older entries for. Its counters go on
from the dead one's. A writer that dies more than MAX_RESTARTS times within RESTART_WINDOW_S, or one
that cannot start again, is given up: the worker is told (`on_lost`: it stops taking items at once,
its frontends send them elsewhere, and the supervisor restarts it), every waiting callback and future is
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
from dataclasses import dataclass
from typing import Callable

import numpy as np

from cachestore import records
from cachestore.env import Store, StoreSettings
from cachestore.errors import StoreError
from cachestore.keys import Namespace, Selector
from cachestore.results import now_us
from cachestore.semantic_log import SemanticEntry
from cachestore.writer import FENCE_S, GAUGES
from infercache.v1 import writer_pb2
from server.shared.errors import WorkerUnavailable
from server.shared.framing import FrameProtocol
from server.worker.store.semantic_rows import SemanticRows
from server.worker.store.unconfirmed import Unconfirmed
from server.worker.store.writer_child import SOCKET_BUFFER, main as child_main

log = logging.getLogger("infercache.writer_process")

START_TIMEOUT_S = 120.0  # opening a large store can take a while (its integrity was checked before)
# Puts sent and not yet handled, at most: past it new puts are dropped (a later miss computes them
# again), so a writer that falls behind, or hangs, costs neither the worker's memory nor its answers.
# Seen on an H200: four workers at 69k MiniLM texts/s outran their writers (one LMDB write lock).
MAX_BACKLOG = 50_000
# Answers that went to several callers are the likeliest to be asked for again: they are dropped only
# past this many times max_backlog (one-off answers, at max_backlog).
SHARED_HEADROOM = 1.25
# A writer that dies more often than this within the window is given up (the worker is restarted instead):
# a put or a store that kills every process it meets must not keep the worker starting processes.
MAX_RESTARTS = 3
RESTART_WINDOW_S = 60.0


@dataclass(frozen=True)
class _Launch:
    """What starts a writer process (each new one gets the same)."""

    settings: StoreSettings
    batch_max: int
    sweep_interval_s: float
    max_ttl_s: int
    group_commit_s: float
    log_level: str
    role: str


class WriterProcess:
    """The worker's handle on its writer process; see the module docstring. Use `await start(...)`."""

    def __init__(self, launch: _Launch, what: str, on_lost: Callable[[], None] | None, max_backlog: int,
                 max_restarts: int) -> None:
        self.launch = launch
        self.what = what
        self.on_lost = on_lost             # told once if the writer is given up while the worker still needs it
        self.max_backlog = max_backlog
        self.max_restarts = max_restarts
        # Told the new read handle when the process replaced a damaged store with a fresh one (the
        # readers of `store`: the core's L1, the feature tier, the semantic tier).
        self.on_store: list[Callable[[Store], None]] = []
        self.process = None
        self.store: Store | None = None
        self._replacements = 0              # stores the process replaced (the latest's handle is opened)
        self._checking = False              # a check the process has not answered yet (one at a time)
        self._reported: Counter[str] = Counter()  # the running process's counters, as of its last frame
        self._carried: Counter[str] = Counter()   # the counters of the processes that died
        self._own: Counter[str] = Counter()       # this side's (notify_errors, restarts)
        self.semantic = SemanticRows(self._own)  # on_semantic: told the rows each commit added or removed
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._protocol: FrameProtocol | None = None  # None while a process starts (operations are held)
        self._sent = 0                     # puts made (their numbers)
        self._handled = 0                  # the last put number the process said it handled
        self._callbacks: deque[tuple[int, Callable[[], None]]] = deque()  # (put number, on_done)
        self._requests: dict[int, tuple[Future, Selector | None]] = {}    # id -> (future, invalidation's selector)
        self._next_request = 0
        self._unconfirmed = Unconfirmed()  # frames written and made that no process confirmed yet
        self._fences: list[tuple[Selector, int]] = []  # invalidations of the last FENCE_S, as (selector, us)
        self._deaths: deque[float] = deque()  # when processes died unexpectedly (loop time)
        self._respawning: asyncio.Task | None = None
        self._spawning = False  # a process is starting: how it ends is its spawner's to say
        self._ready: asyncio.Future | None = None
        self._ended: asyncio.Future | None = None
        self._closing = False
        self.dead = False

    @classmethod
    async def start(cls, settings: StoreSettings, *, batch_max: int, sweep_interval_s: float, max_ttl_s: int,
                    what: str, log_level: str, role: str, on_lost: Callable[[], None] | None = None,
                    group_commit_s: float, max_backlog: int = MAX_BACKLOG,
                    max_restarts: int = MAX_RESTARTS) -> "WriterProcess":
        """Starts the process, waits until it has the store open, then opens the worker's read-only
        handle. StoreError when the store cannot be opened (the process has exited then)."""
        self = cls(_Launch(settings, batch_max, sweep_interval_s, max_ttl_s, group_commit_s, log_level, role),
                   what, on_lost, max_backlog, max_restarts)
        try:
            await self._spawn()
            self.store = await asyncio.to_thread(Store, settings, readonly=True)
        except BaseException:
            await self.close()
            raise
        return self

    async def _spawn(self) -> None:
        """A process on the store, connected; returns once it has the store open, its protocol in place
        and what it is handed written (StoreError, or TimeoutError, when it does not get there)."""
        self._spawning = True
        try:
            await self._start_one()
        finally:
            self._spawning = False

    async def _start_one(self) -> None:
        launch = self.launch
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        for end in (ours, theirs):  # (writer_child.SOCKET_BUFFER says why)
            for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
                end.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER)
        self.process = multiprocessing.get_context("spawn").Process(
            target=child_main, name=f"{launch.role}-writer",
            args=(launch.settings, launch.batch_max, launch.sweep_interval_s, launch.max_ttl_s, launch.group_commit_s,
                  theirs, launch.log_level, f"{launch.role} writer", self._handled, self._live_fences(), self.what))
        self._ready, self._ended = self._loop.create_future(), self._loop.create_future()
        self._ready.add_done_callback(lambda f: f.cancelled() or f.exception())  # (seen: one nobody awaits is no warning)
        # From a thread started here, not the loop's default executor (a CPU worker lowers that one's
        # priority): the writer, which commits, sweeps and answers Invalidate, keeps the loop's.
        starter = ThreadPoolExecutor(1, thread_name_prefix="writer-start")
        try:
            await self._loop.run_in_executor(starter, self.process.start)
        finally:
            starter.shutdown(wait=False)
            theirs.close()
        _, protocol = await self._loop.create_unix_connection(
            lambda: FrameProtocol(self._on_frame, self._on_end, writer_pb2.StoreOps, self._on_flush), sock=ours)
        try:
            await asyncio.wait_for(asyncio.shield(self._ready), START_TIMEOUT_S)
            if self._ended.done():
                raise StoreError(f"the {self.what}'s writer process ended as it started")
        except BaseException:
            protocol.close()
            raise
        self._hand_over(protocol)

    def _hand_over(self, protocol: FrameProtocol) -> None:
        """Makes `protocol` the one operations go to, after writing to it what no process confirmed (the
        dead one's frames, less the puts it handled and the requests it answered) and what was held."""
        frames = self._unconfirmed.replay(self._handled, self._requests)
        self._protocol = protocol
        for frame in frames:
            protocol.out = frame
            protocol.flush_now()

    # ---- WriteBehind's interface (any thread; the work is done on the loop) --------------------------

    @property
    def on_semantic(self) -> Callable[[list, list], None] | None:
        return self.semantic.on_semantic

    @on_semantic.setter
    def on_semantic(self, told: Callable[[list, list], None] | None) -> None:
        self.semantic.on_semantic = told

    @property
    def counters(self) -> Counter[str]:
        counters = self._carried + self._reported + self._own
        # A gauge: puts the process has not handled yet (none once it is gone: they were released).
        counters["backlog"] = 0 if self.dead else self._sent - self._handled
        return counters

    def _soon(self) -> None:
        if self._protocol is not None:
            self._protocol.flush_soon()

    def put(self, key: bytes, ns: Namespace, record: records.Record,
            on_done: Callable[[], None] | None = None, semantic: SemanticEntry | None = None,
            ttl_class: str = "", shared: bool = False) -> None:
        """on_done runs on the worker's loop once the put was committed or dropped. `ttl_class`: the
        TTL class the entry was stored for (the store counts entries by class). `shared`: its answer
        went to more than one caller; behind the writer, one-off answers are dropped first (at
        max_backlog puts waiting), shared ones past SHARED_HEADROOM times that."""
        if threading.get_ident() != self._loop_thread:
            try:
                self._loop.call_soon_threadsafe(self.put, key, ns, record, on_done, semantic, ttl_class, shared)
            except RuntimeError:  # the loop has closed: the worker is gone, so is the write
                pass
            return
        waiting = self._sent - self._handled
        behind = waiting >= (self.max_backlog * SHARED_HEADROOM if shared else self.max_backlog)
        if self.dead or self._closing or behind:
            if behind:
                self._own["dropped_backlog"] += 1
                self._own["dropped_backlog_shared"] += shared
            if on_done is not None:
                on_done()
            return
        put = self._unconfirmed.frame(self._protocol, put=True).puts.add()
        put.key, put.payload = key, record.payload
        put.tenant, put.model, put.version = ns.tenant, ns.model, ns.version
        put.created_us, put.expires_us, put.ttl_class = record.created_us, record.expires_us, ttl_class
        self._sent += 1
        if semantic is not None:
            put.semantic, put.answer = True, semantic.answer
            put.embedding = np.asarray(semantic.embedding, dtype="<f4").tobytes()
            self.semantic.keep(self._sent, key, put.embedding)
        if on_done is not None:
            self._callbacks.append((self._sent, on_done))
        self._soon()

    def invalidate(self, selector: Selector) -> Future:
        """Future of the number of entries removed; ordered after every put made before it."""
        return self._request(selector)

    def flush(self) -> Future:
        """Future that completes once everything put before it was handled (committed or dropped)."""
        return self._request(None)

    def check(self, key: bytes, exc: Exception | None = None) -> None:
        """A read of `key` met a damaged page (ResultCache.on_corrupt): the process reads it too, and
        replaces the store if it is damaged. One check at a time; those meanwhile are not sent."""
        if threading.get_ident() != self._loop_thread:  # (the semantic tier's thread reads too)
            self._loop.call_soon_threadsafe(self.check, key)
            return
        if self._checking or self.dead or self._closing:
            return
        self._checking = True
        self._request(None, check=key).add_done_callback(lambda _: setattr(self, "_checking", False))

    def _request(self, selector: Selector | None, check: bytes = b"") -> Future:
        done: Future = Future()
        if threading.get_ident() == self._loop_thread:
            self._send_request(selector, done, check)
            return done
        try:
            self._loop.call_soon_threadsafe(self._send_request, selector, done)
        except RuntimeError:
            done.set_exception(self._stopped())
        return done

    def _stopped(self) -> WorkerUnavailable:
        return WorkerUnavailable(f"the {self.what}'s writer process is gone; retry")

    def _send_request(self, selector: Selector | None, done: Future, check: bytes = b"") -> None:
        if self.dead or self._closing:
            done.set_exception(self._stopped())
            return
        self._next_request += 1
        request = self._unconfirmed.frame(self._protocol, put=False).requests.add(id=self._next_request, check=check)
        if selector is not None:
            wanted = request.invalidate
            wanted.SetInParent()
            for field in ("tenant", "model", "version", "key"):
                if (value := getattr(selector, field)) is not None:
                    setattr(wanted, field, value)
        self._requests[self._next_request] = (done, selector)
        self._soon()

    async def close(self, timeout: float = 30.0) -> None:
        """Sends what is queued, lets the process commit it and exit (killed after `timeout`)."""
        self._closing = True
        if self._respawning is not None:  # what is held goes to the process starting, then it closes too
            await asyncio.gather(self._respawning, return_exceptions=True)
        if self._protocol is not None and self._protocol.transport is not None:
            await asyncio.sleep(0)  # the frame queued in this loop iteration goes first
            transport = self._protocol.transport
            if transport is not None and not transport.is_closing():
                transport.write_eof()
            try:
                await asyncio.wait_for(asyncio.shield(self._ended), timeout)
            except TimeoutError:
                log.error("%s writer did not finish within %.0f s; killing it", self.what, timeout)
        if self.process is not None:
            await asyncio.to_thread(self.process.join, 5.0)
            if self.process.is_alive():
                self.process.kill()
                await asyncio.to_thread(self.process.join)
        self._release()
        if self.store is not None:
            self.store.close()

    # ---- events from the process (on the loop) -----------------------------------------------------

    def _on_flush(self, frame: writer_pb2.StoreOps) -> None:
        """Each frame as it is written: kept until the process has handled all of it."""
        self._unconfirmed.written(frame)

    def _on_frame(self, frame: bytes) -> None:
        events = writer_pb2.StoreEvents.FromString(frame)
        if events.failed and not self._ready.done():
            self._ready.set_exception(StoreError(events.failed))
        elif events.ready and not self._ready.done():
            self._ready.set_result(None)
        if events.counters:
            self._reported = Counter(events.counters)
        if events.replaced:  # (the process logged it): the rows that follow are the fresh store's
            self.semantic.defer()
            self._replacements += 1
            self._loop.create_task(self._reopen(self._replacements))
        self._handled = max(self._handled, events.handled)
        callbacks = self._callbacks
        while callbacks and callbacks[0][0] <= self._handled:
            self._called(callbacks.popleft()[1])
        for done in events.done:
            future, selector = self._requests.pop(done.id, (None, None))
            if selector is not None and not done.error:  # a new process refuses older entries too
                self._fences.append((selector, now_us()))
            if future is None or future.done():  # (its caller went away: cancelled)
                continue
            if done.error:
                future.set_exception(StoreError(done.error))
            else:
                future.set_result(done.removed)
        self._unconfirmed.confirmed(self._handled, self._requests)
        self.semantic.committed(events, self._handled)

    async def _reopen(self, replacement: int) -> None:
        """After the process replaced a damaged store: the worker's read handle on the fresh one, to
        each reader (on_store), then the semantic rows that came meanwhile, in order. (A handle that is
        on the fresh one already, opened by start() after a replacement at open, stays.)"""
        store = None
        if self.store is not None and self.store.replaced():
            try:
                store = await asyncio.to_thread(Store, self.launch.settings, readonly=True)
            except StoreError as exc:  # (its readers go on with the damaged one: misses where it is damaged)
                log.error("the fresh %s could not be opened for reading: %s", self.what, exc)
        if replacement != self._replacements:  # replaced again meanwhile: the latest reopen takes over
            return
        if store is not None:
            self.store = store  # (the old handle closes with the last transaction that holds it)
            for use in self.on_store:
                use(store)
        self.semantic.resume()

    def _live_fences(self) -> list[tuple[Selector, int]]:
        cutoff = now_us() - int(FENCE_S * 1_000_000)
        self._fences = [(selector, at) for selector, at in self._fences if at > cutoff]
        return list(self._fences)

    @staticmethod
    def _called(on_done: Callable[[], None]) -> None:
        try:
            on_done()
        except Exception:
            log.exception("a write's callback failed")

    def _on_end(self, exc: Exception | None) -> None:
        self._protocol = None
        if not self._ended.done():
            self._ended.set_result(None)
        if self._spawning:  # its spawner says so: start() to the worker, or a restart gives up
            if not self._ready.done():
                self._ready.set_exception(StoreError(f"the {self.what}'s writer process ended while starting"))
            return
        if self.dead:  # given up already (a process that could not start again)
            return
        if self._closing:
            self._release()
            return
        now = self._loop.time()
        self._deaths.append(now)
        while self._deaths and self._deaths[0] < now - RESTART_WINDOW_S:
            self._deaths.popleft()
        if len(self._deaths) > self.max_restarts:
            self._give_up(f"it ended {len(self._deaths)} times within {RESTART_WINDOW_S:.0f} s")
            return
        log.error("the %s's writer process (pid %d) ended unexpectedly; starting a new one and handing it the "
                  "%d write(s) not yet confirmed", self.what, self.process.pid, self._sent - self._handled)
        self._respawning = self._loop.create_task(self._respawn())

    async def _respawn(self) -> None:
        self._own["restarts"] += 1
        self._carried += Counter({k: v for k, v in self._reported.items() if k not in GAUGES})
        self._reported = Counter()
        dead = self.process
        try:
            await asyncio.to_thread(dead.join, 5.0)  # (reaped: no zombie per restart)
            await self._spawn()
        except (StoreError, TimeoutError, OSError) as exc:
            self._give_up(f"a new one did not start: {exc}")
            return
        finally:
            self._respawning = None
        log.warning("the %s's writer process is back (pid %d; the one before exited with code %s); %d write(s) "
                    "handed to it", self.what, self.process.pid, dead.exitcode, self._sent - self._handled)

    def _give_up(self, why: str) -> None:
        log.error("the %s's writer process is not started again (%s); its writes are dropped and the worker "
                  "stops", self.what, why)
        self._release()
        if self.on_lost is not None and not self._closing:
            self.on_lost()

    def _release(self) -> None:
        """No process will handle what waits: every callback is told and every request failed, once."""
        self.dead = True
        self._unconfirmed.clear()
        self.semantic.clear()
        while self._callbacks:  # nothing waits forever for a write that will never be told of
            self._called(self._callbacks.popleft()[1])
        requests, self._requests = self._requests, {}
        for future, _ in requests.values():
            if not future.done():
                future.set_exception(self._stopped())
