"""The prefix cache's disk tier: the host's LMDB block store (the server's `kv` section), shared by its
workers and kept across restarts.

Blocks are megabytes each (8 MiB per 64 tokens of a Llama-3-8B shape), so they do not travel through the
store writer process's frames as answers do: each worker writes its own demoted blocks from a thread of
its own, several to a transaction, straight into the environment (LMDB serializes writers across
processes; a transaction is whole or absent, so kill -9 leaves no half-written block). That thread is
the only writer of this worker's blocks; it keeps the store under `kv.budget_mb` (oldest blocks first)
and sweeps expired ones. What waits for it is bounded by `kv.write_queue_mb`, sized for a long prompt's
blocks demoted at once (4,096 tokens of a Llama-3-8B shape are 512 MiB); past that a block is dropped
(counted). Reads run in a pool of threads, each block checked (checksum, and sealing when encryption is
on) and copied once, from the map into a host block. Any failure is a miss: a block not written, or not
read, is computed again.

A block's key starts with the namespace id of its (tenant, model, version) (a public system prompt's
blocks: the tenant ""), and the store's namespaces table names each id, as L1's does: Invalidate deletes a
tenant's, a model's or a version's blocks as it deletes their answers (erase), on the writer thread, after
every block queued before it. A block that fails its checksum (or does not open) is deleted once read
(counted: unreadable_deleted). A store whose open or any read or write meets damaged pages (LMDB's
CORRUPTION) is set aside as the result store is (cachestore/integrity.py set_aside: `<dir>.damaged-<time>`,
logged once, counted: replaced) and a fresh one opened in its place; another worker of the host that
still maps the old file opens the fresh one when it next writes or meets the damage.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from cachestore import integrity
from cachestore.env import DATA_FILE, DB_RESULTS, Store, StoreSettings, file_identity
from cachestore.errors import CORRUPTION, CorruptRecord, StoreDamaged, StoreError, corrupted
from cachestore.keys import NS_ID_BYTES, Namespace, Selector
from cachestore.records import FLAG_ENCRYPTED, Record, checked, decode, opened
from cachestore.results import delete, delete_selected, drop_namespace_if_empty, evict_oldest, now_us, put, \
    sweep_expired

log = logging.getLogger("infercache.prefix")

WHAT = "prefix block store"
READERS = 16                  # threads reading blocks back (LMDB reads, checksums and copies release the GIL)
WRITE_TXN_BYTES = 64 << 20    # blocks per write transaction, at most
SWEEP_EVERY = 64              # write transactions between sweeps of expired blocks
_STOP = object()


@dataclass
class _Erase:
    selector: Selector
    done: Future


@dataclass
class _Drop:
    key: bytes  # a block that did not read back: deleted if it still does not


class BlockStore:
    def __init__(self, settings: StoreSettings, ttl_s: int, queue_bytes: int) -> None:
        """Opens the store (a damaged one is set aside first; StoreError when it cannot be opened) and
        starts its writer thread; at most `queue_bytes` of blocks wait for it."""
        self.settings = settings
        self._counts: Counter[str] = Counter()  # written by the writer thread (and reads: failures)
        self._replacing = threading.Lock()
        self._retired: list[Store] = []  # handles on stores set aside (closed at close: readers may hold them)
        self.store = self._open()
        self.queue_bytes = queue_bytes
        self.budget = settings.budget
        self.ttl_us = ttl_s * 1_000_000
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._queued = self._waiting = 0  # bytes and blocks waiting (the loop adds, the writer subtracts,
                                          # under _lock)
        self._lock = threading.Lock()
        self._readers = ThreadPoolExecutor(READERS, thread_name_prefix="prefix-disk-read")
        self._writer = threading.Thread(target=self._write_loop, name="prefix-disk-write", daemon=True)
        self._writer.start()

    def _open(self) -> Store:
        """The store at the settings' path; one whose pages are damaged is set aside and a fresh one opened
        (one another worker of the host set aside meanwhile is not set aside again)."""
        data = self.settings.path / DATA_FILE
        before = file_identity(data)
        try:
            return Store(self.settings, readonly=False)
        except StoreError as exc:
            if not (isinstance(exc, StoreDamaged) or corrupted(exc.__cause__)):
                raise
            if file_identity(data) == before:
                integrity.set_aside(self.settings.path, f"at open: {exc.__cause__ or exc}", WHAT)
                self._counts["replaced"] += 1
            return Store(self.settings, readonly=False)

    def _damaged(self, store: Store, exc: Exception | None) -> None:
        """`store` met damaged pages (exc), or its file was replaced by another worker (None): unless this
        worker moved on from it already, it is set aside (when it is still at the path) and a fresh store
        opened. Any thread."""
        with self._replacing:
            if self.store is not store:
                return
            if exc is not None and not store.replaced():
                integrity.set_aside(self.settings.path, f"at run time: {exc}", WHAT)
                self._counts["replaced"] += 1
            fresh = self._open()
            self._retired.append(store)
            self.store = fresh

    # -- reads (any thread) --------------------------------------------------------------------------------

    def contains(self, key: bytes) -> bool:
        store = self.store
        try:
            with store.begin(buffers=True) as txn:
                return txn.get(key, None, store.dbs[DB_RESULTS]) is not None
        except CORRUPTION as exc:
            self._met_damage(store, exc)
        except Exception:  # noqa: BLE001 (a store that fails is a miss)
            pass
        return False

    def read(self, key: bytes, make):
        """make(payload) of the block of `key`, read within its transaction (no copy before make's); None
        when absent, expired, or unreadable (counted and logged; a block that fails its checksum or does
        not open is deleted)."""
        store = self.store
        try:
            with store.begin(buffers=True) as txn:
                raw = txn.get(key, None, store.dbs[DB_RESULTS])
                if raw is None:
                    return None
                flags, kid, created, expires, stored = checked(raw)
                if expires and now_us() >= expires:
                    return None
                clear = opened(flags, kid, created, expires, stored, key, store.ring) \
                    if flags & FLAG_ENCRYPTED or store.ring else stored
                return make(clear)
        except CORRUPTION as exc:
            self._met_damage(store, exc)
        except CorruptRecord as exc:
            self._counts["unreadable"] += 1
            log.warning("prefix block %s not reused, deleting it: %s", key.hex(), exc)
            self._queue.put(_Drop(key))
        except Exception as exc:  # noqa: BLE001 (a block that does not read is computed again)
            self._counts["unreadable"] += 1
            log.warning("prefix block %s not reused: %s", key.hex(), exc)
        return None

    def _met_damage(self, store: Store, exc: Exception) -> None:
        self._counts["read_errors"] += 1
        try:
            self._damaged(store, exc)
        except Exception as again:  # noqa: BLE001 (no fresh store: reads go on missing)
            log.error("%s not replaced: %s", WHAT, again)

    @property
    def readers(self) -> ThreadPoolExecutor:
        return self._readers

    # -- writes --------------------------------------------------------------------------------------------

    def write(self, key: bytes, ns: Namespace, payload, done) -> None:
        """Queues a block of namespace `ns` (its key starts with ns's id; payload: a bytes-like view that
        stays valid until done() is called, from the writer thread, once it is committed or dropped)."""
        size = len(payload)
        with self._lock:
            if self._queued + size > self.queue_bytes:
                self._counts["dropped_backlog"] += 1
                done()
                return
            self._queued += size
            self._waiting += 1
        self._queue.put((key, ns, payload, done))

    def erase(self, selector: Selector) -> Future:
        """Future of the number of blocks Invalidate's `selector` names deleted from the store, after every
        block queued before it (the first of the host's workers to get there counts what the store held)."""
        done: Future = Future()
        self._queue.put(_Erase(selector, done))
        return done

    def _write_loop(self) -> None:
        txns = 0
        held = None  # what ended the last batch: the next to handle
        while True:
            first, held = (held if held is not None else self._queue.get()), None
            if first is _STOP:
                return
            if not isinstance(first, tuple):
                self._apply(first)
                continue
            batch, size = [first], len(first[2])
            while size < WRITE_TXN_BYTES:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if not isinstance(more, tuple):  # stop, an erasure or a drop: after this batch
                    held = more
                    break
                batch.append(more)
                size += len(more[2])
            try:
                self._transaction(self._commit, batch, txns % SWEEP_EVERY == 0)
                self._counts["written"] += len(batch)
            except Exception as exc:  # noqa: BLE001 (blocks not written are computed again)
                self._counts["write_errors"] += 1
                log.warning("%d prefix blocks not written: %s", len(batch), exc)
            txns += 1
            with self._lock:
                self._queued -= size
                self._waiting -= len(batch)
            for *_, done in batch:
                done()

    def _apply(self, op) -> None:
        """An erasure or a drop, in a transaction of its own."""
        try:
            if isinstance(op, _Erase):
                count = self._transaction(lambda store, txn: delete_selected(store, txn, op.selector))
                self._counts["invalidated"] += count
                op.done.set_result(count)
            elif self._transaction(_drop, op.key):
                self._counts["unreadable_deleted"] += 1
        except Exception as exc:  # noqa: BLE001 (the thread goes on; an erasure's caller hears)
            self._counts["write_errors"] += 1
            log.warning("prefix block store: %s failed: %s", type(op).__name__.strip("_").lower(), exc)
            if isinstance(op, _Erase):
                op.done.set_exception(exc)

    def _transaction(self, fn, *args):
        """fn(store, txn, *args) in a write transaction. Another worker's replacing the store has this one
        open the fresh one first; a store met damaged is set aside and fn runs again in a fresh one."""
        store = self.store
        data = file_identity(self.settings.path / DATA_FILE)
        if data is not None and data != store.identity[0]:  # (None: being set aside, the fresh one not made yet)
            self._damaged(store, None)
            store = self.store
        try:
            with store.begin(write=True) as txn:
                return fn(store, txn, *args)
        except CORRUPTION as exc:
            self._damaged(store, exc)
            with self.store.begin(write=True) as txn:
                return fn(self.store, txn, *args)

    def _commit(self, store: Store, txn, batch, sweep: bool) -> None:
        created = now_us()
        for key, ns, payload, _ in batch:
            expires = created + self.ttl_us if self.ttl_us else 0
            put(store, txn, key, ns, Record(created, expires, payload))
        if sweep:
            self._counts["swept"] += sweep_expired(store, txn, created)
        while store.used_bytes(txn) > self.budget:
            evicted = evict_oldest(store, txn, max(1, len(batch)))
            self._counts["evicted"] += evicted
            if not evicted:
                break

    @property
    def counters(self) -> Counter[str]:
        """As a store writer's (server/worker/metrics.py reads both): written, evicted, swept, dropped_backlog
        (blocks dropped while the queue was full), unreadable, unreadable_deleted, invalidated, read_errors,
        write_errors, replaced (damaged stores set aside), and backlog (blocks queued)."""
        counters = self._counts.copy()
        with self._lock:
            counters["backlog"] = self._waiting
        return counters

    def close(self) -> None:
        self._queue.put(_STOP)
        self._writer.join(timeout=30)
        self._readers.shutdown(wait=False, cancel_futures=True)
        for store in (*self._retired, self.store):
            store.close()


def _drop(store: Store, txn, key: bytes) -> bool:
    """Deletes the block of `key` if it still does not read back (it may have been written anew since)."""
    raw = txn.get(key, db=store.dbs[DB_RESULTS])
    if raw is None:
        return False
    try:
        decode(raw, key, store.ring)
        return False
    except CorruptRecord:
        pass
    delete(store, txn, key)
    drop_namespace_if_empty(store, txn, key[:NS_ID_BYTES])
    return True
