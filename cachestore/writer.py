"""Write-behind: the single writer of the store.

One thread owns every write transaction. Callers on the event loop enqueue operations without
blocking; the thread applies whatever has queued up in one transaction (so the write lock is taken
once per batch, not once per entry), keeps the store under its byte budget, and sweeps expired
entries. A failed write is logged and dropped: a lost cache write is a future miss, never an error.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import lmdb

from cachestore import integrity, records, results, semantic_log
from cachestore.errors import CORRUPTION, corrupted
from cachestore.log_limit import RateLimitedLog
from cachestore.semantic_log import Row, SemanticEntry
from cachestore.env import Store
from cachestore.space import StoreSpace
from cachestore.keys import Namespace, Selector

log = logging.getLogger("infercache.writer")

# One sweep deletes at most this many expired entries (in commits no bigger than an eviction's); the
# next sweep goes on.
SWEEP_MAX = 20_000
# How long an invalidation keeps refusing entries created before it: a result computed before an
# Invalidate (here or on another pod, arriving through the fleet tier) must not be stored after it.
FENCE_S = 120.0
GAUGES = ("budget_bytes", "held_bytes")  # counters that hold a value rather than count events
# While a flush is in flight, the owner of a writer without a thread of its own looks this often whether
# it has ended (the commits waiting for the next one would otherwise have it poll without pause).
FLUSH_POLL_S = 0.005
FAILURE_LOG_S = 10.0  # a failing write is logged (with its traceback) at most this often, with a count


@dataclass(slots=True)
class _Put:
    key: bytes
    ns: Namespace
    record: records.Record
    on_done: Callable[[], None] | None = None
    semantic: SemanticEntry | None = None
    ttl_class: str = ""


@dataclass(frozen=True)
class _Invalidate:
    selector: Selector
    done: Future


@dataclass(frozen=True)
class _Flush:
    done: Future


@dataclass(frozen=True)
class _Check:
    """A reader met a damaged page reading `key`: the writer reads it too (Future: whether it replaced
    the store)."""

    key: bytes
    done: Future


_STOP = object()


class WriteBehind:
    def __init__(self, store: Store, *, batch_max: int = 512, sweep_interval_s: float = 30.0,
                 on_semantic: Callable[[list[Row], list[tuple[bytes, int]]], None] | None = None,
                 max_ttl_s: int = 0, threaded: bool = True, fences: list[tuple[Selector, int]] = (),
                 what: str = "store", on_replaced: Callable[[str], None] | None = None) -> None:
        """threaded=False: no thread of its own; whoever owns it calls `drain` (server/worker/store/writer.py,
        where py-lmdb's releasing the GIL on every call would hand it back and forth between two threads).
        fences: invalidations made before (a writer that died made them), as (selector, microseconds).
        on_replaced(why): told once the store was found damaged, set aside and replaced by a fresh one
        (`store` is then the new one; its readers open it anew)."""
        self.store = store
        self.what = what
        self.on_replaced = on_replaced
        self._failed_log = RateLimitedLog(log, FAILURE_LOG_S)
        self.max_ttl_us = max_ttl_s * 1_000_000  # retention: the sweep also deletes entries older than this
        # Told after each commit which semantic rows were added and which (ns_id, label) went.
        self.on_semantic = on_semantic
        self.batch_max = batch_max
        self.sweep_interval_s = sweep_interval_s
        self.counters: Counter[str] = Counter()
        self.space = StoreSpace(store, batch_max, self.counters)  # (writer thread only, after this)
        self._over = False                   # the last commit left the store over its budget
        self._fences: list[tuple[Selector, int]] = list(fences)  # recent invalidations (writer thread only)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._next_sweep = time.monotonic()  # one sweep at start: a retention cap lowered while down applies at once
        # Flushing to disk every sync_interval_s instead of at each commit (StoreSettings): since when
        # commits are waiting for it (None: none are).
        settings = store.settings
        self._flush_every = settings.sync_interval_s if settings.sync else 0.0
        self._unflushed_since: float | None = None
        # The interval's flushes run on a thread of their own, so commits go on while the disk syncs (an
        # fsync of a few megabytes took tens of milliseconds on a 2-core host's disk, and the commits
        # waited for it). One at a time: commits made while one runs wait for the next.
        self._flusher = ThreadPoolExecutor(1, thread_name_prefix="store-flush") if self._flush_every else None
        self._flushing: Future | None = None
        self._thread: threading.Thread | None = None
        if threaded:
            self._thread = threading.Thread(target=self._run, name="write-behind", daemon=True)
            self._thread.start()

    @property
    def budget(self) -> int:
        """The store's effective byte budget (cachestore/space.py)."""
        return self.space.budget

    # ---- called from any thread; never block -------------------------------------------------------

    def put(self, key: bytes, ns: Namespace, record: records.Record,
            on_done: Callable[[], None] | None = None, semantic: SemanticEntry | None = None,
            ttl_class: str = "") -> None:
        """on_done runs on the writer thread once the put was committed or dropped. With `semantic`,
        the entry also joins its namespace's semantic index. `ttl_class`: what the store counts it as."""
        self._queue.put(_Put(key, ns, record, on_done, semantic, ttl_class))

    def invalidate(self, selector: Selector) -> Future:
        """Future of the number of entries removed; ordered after every put enqueued before it."""
        done: Future = Future()
        self._queue.put(_Invalidate(selector, done))
        return done

    def flush(self) -> Future:
        """Future that completes once everything enqueued before it was handled (committed or dropped)."""
        done: Future = Future()
        self._queue.put(_Flush(done))
        return done

    def check(self, key: bytes) -> Future:
        """A reader found the page holding `key` damaged: read it here too, and replace the store if it
        is (Future of whether it was). Handled before the writes queued with it."""
        done: Future = Future()
        self._queue.put(_Check(key, done))
        return done

    def close(self, timeout: float = 10.0) -> None:
        self._queue.put(_STOP)
        if self._thread is not None:
            self._thread.join(timeout)
        else:
            self.drain()
            self.sync_to_disk(force=True)
        if self._flusher is not None and (self._thread is None or not self._thread.is_alive()):
            self._flusher.shutdown(wait=True)  # (a thread still running past the timeout may yet flush)

    def flush_due_in(self) -> float | None:
        """Seconds until the commits not flushed to disk yet are due to be (while a flush is in flight, at
        least FLUSH_POLL_S: theirs waits for it to end); None when none are waiting."""
        if self._unflushed_since is None:
            return None
        due = max(0.0, self._unflushed_since + self._flush_every - time.monotonic())
        flushing = self._flushing
        return max(due, FLUSH_POLL_S) if flushing is not None and not flushing.done() else due

    def queued(self) -> int:
        """Operations waiting to be handled (approximate while a thread of its own takes them)."""
        return self._queue.qsize()

    def drain(self) -> None:
        """Without a thread of its own: handles everything queued so far in the caller's thread (one
        transaction per `space.commit_ops` operations), and sweeps when a sweep is due."""
        while not self._step(0.0) and not self._queue.empty():
            pass

    # ---- the writer thread -------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._step(None):
            pass
        self.sync_to_disk(force=True)

    def _step(self, wait: float | None) -> bool:
        """Takes up to `space.commit_ops` queued operations (batch_max, or SMALL_COMMIT_OPS where the disk is
        short; waiting for the first until the next sweep is due, at most `wait` seconds), applies them in
        one transaction (then evicts in commits of their own while the store is still over its budget),
        sweeps when due; True once stopped."""
        timeout = max(0.0, self._next_sweep - time.monotonic())
        if (flush_in := self.flush_due_in()) is not None:
            timeout = min(timeout, flush_in)
        batch = []
        try:
            batch.append(self._queue.get(timeout=timeout if wait is None else min(wait, timeout)))
        except queue.Empty:
            pass
        while batch and len(batch) < self.space.commit_ops:
            try:
                batch.append(self._queue.get_nowait())
            except queue.Empty:
                break
        ops = [op for op in batch if op is not _STOP]
        if ops:
            self._guarded(self._apply, ops)
            while self._over:  # evictions capped per commit fell behind (records bigger than those evicted)
                self._guarded(self._commit, [])
            for op in ops:
                if isinstance(op, _Put) and op.on_done is not None:
                    self._guarded(op.on_done)
        swept = time.monotonic() >= self._next_sweep
        if swept:  # also under constant load, not only when idle
            self._guarded(self.space.check, self.store)  # space may have come back while nothing was written
            self._guarded(self._sweep)
            self._next_sweep = time.monotonic() + self.sweep_interval_s
        if self._flush_every and (ops or swept) and self._unflushed_since is None:
            self._unflushed_since = time.monotonic()
        self.sync_to_disk()
        return _STOP in batch

    def sync_to_disk(self, force: bool = False) -> None:
        """Flushes the commits waiting for it to disk once they are due: on the flusher thread, once the
        flush before has ended (force: now, in this thread, after the one in flight)."""
        flushing = self._flushing
        if flushing is not None and (force or flushing.done()):
            self._flush_ended()
        # (a flush still in flight keeps flush_due_in() above 0: the commits since it began wait for it)
        if self._unflushed_since is None or (not force and self.flush_due_in()):
            return
        self._unflushed_since = None
        self.counters["disk_flushes"] += 1  # (begun)
        if not force and self._flusher is not None:
            try:
                self._flushing = self._flusher.submit(self.store.flush_to_disk)
                return
            except RuntimeError:  # the flusher is shut down (interpreter exit): flushed here instead
                pass
        self._guarded(self.store.flush_to_disk)

    def _flush_ended(self) -> None:
        """Waits for the flush in flight (if it has not ended); a failure is counted and logged."""
        flushing, self._flushing = self._flushing, None
        self._guarded(flushing.result)

    def _guarded(self, fn, *args) -> None:
        try:
            fn(*args)
        except Exception as exc:  # the thread must survive anything; the cache just misses
            self.counters["write_errors"] += 1
            self._failed_log(logging.ERROR, "write-behind failed; entries dropped: %r", exc, exc_info=True)
            if corrupted(exc):  # (a sweep or an eviction met the damage)
                self._guarded(self._replace, exc)

    def _replace(self, exc: Exception) -> None:
        """The store reported damage (CORRUPTION): it is set aside, as the start-up check does
        with a truncated one, and a fresh store takes its place while the server serves."""
        settings = self.store.settings
        if self._flushing is not None:  # not closed while the flusher syncs it (how that ends no longer matters)
            flushing, self._flushing = self._flushing, None
            futures.wait([flushing])
        self.store.close()
        why = f"at run time: {exc}"
        try:
            integrity.set_aside(settings.path, why, self.what)
        finally:  # the fresh store, or (when the files could not be moved) the damaged one again
            self.store = Store(settings, readonly=False)
        self.counters["replaced"] += 1
        self.space.check(self.store)
        if self.on_replaced is not None:
            self.on_replaced(why)

    def _verify(self, key: bytes) -> bool:
        """Reads `key` (a reader met damage there); replaces the store if this read meets it too."""
        try:
            with self.store.begin(buffers=True) as txn:
                txn.get(key, db=self.store.dbs[results.DB_RESULTS])
        except CORRUPTION as exc:
            self._replace(exc)
            return True
        self.counters["damage_unconfirmed"] += 1
        return False

    def _apply(self, batch: list) -> None:
        try:
            for op in batch:
                if isinstance(op, _Check):
                    op.done.set_result(self._verify(op.key))
            try:
                self._commit(batch)
            except CORRUPTION as exc:
                # The writes go to the fresh store instead: nothing acknowledged is lost with the damaged one.
                self._replace(exc)
                self._commit(batch)
            except lmdb.MapFullError:
                # Full despite the budget (budget too close to the map size, or huge records): free a
                # tenth of the store and retry once; if that fails too, the batch is dropped.
                self.counters["map_full"] += 1
                log.warning("store map full; evicting 10%% and retrying %d operation(s)", len(batch))
                self._evict_fraction(0.1)
                self._commit(batch)
        except Exception as exc:
            for op in batch:
                if isinstance(op, (_Invalidate, _Check)) and not op.done.done():
                    op.done.set_exception(exc)
            self.space.check(self.store)  # a full disk: the next commits evict to the smaller budget
            raise
        finally:
            for op in batch:  # "handled", committed or dropped: failures are counted, not raised
                if isinstance(op, _Flush):
                    op.done.set_result(None)

    def _commit(self, batch: list) -> None:
        self._over = False
        invalidated: list[tuple[_Invalidate, int]] = []
        added: list[Row] = []
        removed: list[tuple[bytes, int]] = []
        namespaces: set[bytes] = set()
        labels: dict[bytes, int] = {}  # semantic namespaces' next labels, written back once
        with self.store.begin(write=True) as txn:
            for op in batch:
                if isinstance(op, _Put):
                    if self._fences and self._fenced(op):
                        self.counters["fenced"] += 1
                        continue
                    results.put(self.store, txn, op.key, op.ns, op.record, removed, namespaces, op.ttl_class)
                    if op.semantic is not None:
                        added.append(semantic_log.add(self.store, txn, op.key, op.semantic, labels))
                elif isinstance(op, _Invalidate):
                    semantic_log.save_labels(self.store, txn, labels)  # (before it may drop a namespace's)
                    labels.clear()
                    invalidated.append((op, self._invalidate(txn, op.selector, removed)))
                    self._fence(op.selector)
                    namespaces.clear()  # it may have deleted namespace rows: later puts write theirs again
            semantic_log.save_labels(self.store, txn, labels)
            evicted, over = self.space.enforce(self.store, txn, removed)
        self.counters["writes"] += sum(isinstance(op, _Put) for op in batch)
        self.counters["write_txns"] += 1
        self.counters["evicted"] += evicted  # (counted once committed: a failed commit evicted nothing)
        self._over = over
        self.space.check(self.store)
        self._notify(added, removed)
        if invalidated and self._flush_every:  # on disk before it is told done: power loss never undoes it
            self._guarded(self.store.flush_to_disk)
            self.counters["disk_flushes"] += 1
        for op, count in invalidated:
            self.counters["invalidated"] += count
            op.done.set_result(count)

    def _fence(self, selector: Selector) -> None:
        now = results.now_us()
        self._fences = [(s, t) for s, t in self._fences if now - t < FENCE_S * 1_000_000] + [(selector, now)]

    def _fenced(self, op: "_Put") -> bool:
        """The put's entry was created before an invalidation that covers it."""
        for selector, at in self._fences:
            if op.record.created_us < at and selector.matches(op.ns) and selector.key in (None, op.key):
                return True
        return False

    def _notify(self, added: list[Row], removed: list[tuple[bytes, int]]) -> None:
        """After a commit; a failing listener never turns a committed transaction into a failed one."""
        if self.on_semantic is not None and (added or removed):
            try:
                self.on_semantic(added, removed)
            except Exception:
                self.counters["notify_errors"] += 1
                log.exception("semantic index notification failed (the log in LMDB is still complete)")

    def _invalidate(self, txn: lmdb.Transaction, selector: Selector, removed: list) -> int:
        return results.delete_selected(self.store, txn, selector, removed)

    def _evict_fraction(self, fraction: float) -> None:
        removed: list[tuple[bytes, int]] = []
        with self.store.begin(write=True) as txn:
            entries = txn.stat(self.store.dbs[results.DB_RESULTS])["entries"]
            self.counters["evicted"] += results.evict_oldest(self.store, txn, max(1, int(entries * fraction)), removed)
        self._notify([], removed)

    def _sweep(self) -> None:
        """Deletes expired entries (and, with a retention cap, older ones) in commits no bigger than an
        eviction's, up to SWEEP_MAX a sweep; frees the reader slots of processes that died."""
        self.store.clear_stale_readers()
        chunk, swept = self.space.evict_chunk, 0
        while swept < SWEEP_MAX:
            removed: list[tuple[bytes, int]] = []
            now = results.now_us()
            with self.store.begin(write=True) as txn:
                n = results.sweep_expired(self.store, txn, now, chunk, removed)
                if self.max_ttl_us and n < chunk:  # entries stored before the cap was lowered
                    n += results.sweep_created_before(self.store, txn, now - self.max_ttl_us, chunk - n, removed)
            self._notify([], removed)
            self.space.check(self.store)
            swept += n
            if n < chunk:
                break
        if swept:
            self.counters["swept"] += swept
            log.info("swept %d expired entries", swept)
