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
every block queued before it.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from cachestore.env import DB_RESULTS, Store, StoreSettings
from cachestore.keys import Namespace, Selector
from cachestore.records import FLAG_ENCRYPTED, Record, checked, opened
from cachestore.results import delete_selected, evict_oldest, now_us, put, sweep_expired

log = logging.getLogger("infercache.prefix")

READERS = 16                  # threads reading blocks back (LMDB reads, checksums and copies release the GIL)
WRITE_TXN_BYTES = 64 << 20    # blocks per write transaction, at most
SWEEP_EVERY = 64              # write transactions between sweeps of expired blocks
_STOP = object()


@dataclass
class _Erase:
    selector: Selector
    done: Future


class BlockStore:
    def __init__(self, settings: StoreSettings, ttl_s: int, queue_bytes: int) -> None:
        """Opens the store (StoreError when it cannot be) and starts its writer thread; at most
        `queue_bytes` of blocks wait for it."""
        self.store = Store(settings, readonly=False)
        self.queue_bytes = queue_bytes
        self.budget = settings.budget
        self.ttl_us = ttl_s * 1_000_000
        self._counts: Counter[str] = Counter()  # written by the writer thread (and reads: failures)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._queued = self._waiting = 0  # bytes and blocks waiting (the loop adds, the writer subtracts,
                                          # under _lock)
        self._lock = threading.Lock()
        self._readers = ThreadPoolExecutor(READERS, thread_name_prefix="prefix-disk-read")
        self._writer = threading.Thread(target=self._write_loop, name="prefix-disk-write", daemon=True)
        self._writer.start()

    # -- reads (any thread) --------------------------------------------------------------------------------

    def contains(self, key: bytes) -> bool:
        try:
            with self.store.begin(buffers=True) as txn:
                return txn.get(key, None, self.store.dbs[DB_RESULTS]) is not None
        except Exception:  # noqa: BLE001 (a store that fails is a miss)
            return False

    def read(self, key: bytes, make):
        """make(payload) of the block of `key`, read within its transaction (no copy before make's); None
        when absent, expired, or unreadable (counted and logged)."""
        try:
            store = self.store
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
        except Exception as exc:  # noqa: BLE001 (a block that does not read is computed again)
            self._counts["unreadable"] += 1
            log.warning("prefix block %s not reused: %s", key.hex(), exc)
            return None

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
            if isinstance(first, _Erase):
                self._erase(first)
                continue
            batch, size = [first], len(first[2])
            while size < WRITE_TXN_BYTES:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if not isinstance(more, tuple):  # stop, or an erasure: after this batch
                    held = more
                    break
                batch.append(more)
                size += len(more[2])
            try:
                self._commit(batch, sweep=txns % SWEEP_EVERY == 0)
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

    def _erase(self, op: _Erase) -> None:
        """An erasure, in a transaction of its own."""
        try:
            with self.store.begin(write=True) as txn:
                count = delete_selected(self.store, txn, op.selector)
        except Exception as exc:  # noqa: BLE001 (the thread goes on; the erasure's caller hears)
            self._counts["write_errors"] += 1
            log.warning("prefix block store: erasure failed: %s", exc)
            op.done.set_exception(exc)
            return
        self._counts["invalidated"] += count
        op.done.set_result(count)

    def _commit(self, batch, sweep: bool) -> None:
        store = self.store
        created = now_us()
        with store.begin(write=True) as txn:
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
        (blocks dropped while the queue was full), unreadable, invalidated, write_errors, and backlog (blocks
        queued)."""
        counters = self._counts.copy()
        with self._lock:
            counters["backlog"] = self._waiting
        return counters

    def close(self) -> None:
        self._queue.put(_STOP)
        self._writer.join(timeout=30)
        self._readers.shutdown(wait=False, cancel_futures=True)
        self.store.close()
