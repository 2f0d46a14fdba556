"""L1 result cache: whole responses by exact key.

Reading (`ResultCache.lookup`, the exact-hit path; `get` for a Record) is what frontends do on every
request: one read transaction on the memory map, lock-free with respect to the writer (LMDB's MVCC), a
few microseconds. The write-side
functions below run only inside the worker's write-behind transactions (writer.py); they keep the two
indexes (`stored` for eviction order, `expiry` for the sweeper) consistent with `results`.
"""

from __future__ import annotations

import logging
import struct
import time
from collections import Counter
from typing import Callable, Container

import lmdb
from google.protobuf.message import DecodeError

from cachestore import records, semantic_log, wire
from cachestore.env import DB_CLASSES, DB_EXPIRY, DB_NAMESPACES, DB_RESULTS, DB_STORED, Store
from cachestore.errors import CorruptRecord, Unsealable, corrupted
from cachestore.log_limit import RateLimitedLog
from cachestore.keys import NS_ID_BYTES, Namespace, Selector
from infercache.v1 import infercache_pb2 as pb

log = logging.getLogger("infercache.store")

_U64 = struct.Struct(">Q")
_RESULT_EXACT = int(pb.CacheInfo.RESULT_EXACT)  # (a protobuf enum attribute costs ~1 us: this is per hit)


def now_us() -> int:
    return time.time_ns() // 1000


WARN_EVERY_S = 10.0  # unreadable records and failed reads are counted each time, logged at most this often


class ResultCache:
    """Read side of L1. Every failure is counted, logged (at most every WARN_EVERY_S) and a miss."""

    def __init__(self, store: Store) -> None:
        self.counters: Counter[str] = Counter()  # written by the thread that reads (the event loop)
        self.use(store)
        self._unreadable_log = RateLimitedLog(log, WARN_EVERY_S)
        self._failed_log = RateLimitedLog(log, WARN_EVERY_S)
        # Told (key, exception) of a read that met a damaged page (CORRUPTION): a worker has its
        # writer look, a frontend looks whether the store was replaced.
        self.on_corrupt: Callable[[bytes, Exception], None] | None = None
        # Why the latest read found nothing: not_cached, expired, too_old (older than max_age_us) or
        # store_error (/metrics miss reasons; set on the miss path only, read right after by the caller).
        self.missed_because = ""

    def use(self, store: Store) -> None:
        """Reads `store` from now on (a fresh one its writer started in place of a damaged one); the
        counters go on."""
        self.store = store
        self._results = store.dbs[DB_RESULTS]
        self._ring = store.ring

    def _unreadable(self, key: bytes, exc: Exception) -> None:
        self.counters["records_unsealable" if isinstance(exc, Unsealable) else "records_unreadable"] += 1
        self._unreadable_log(logging.WARNING, "serving a miss for record %s: %s (counted in GetStats)", key.hex(), exc)

    def get(self, key: bytes, now: int, max_age_us: int | None = None, txn: lmdb.Transaction | None = None
            ) -> records.Record | None:
        """With `txn`, reads in that read transaction (one for many lookups) instead of its own."""
        return self._read(self._record, key, now, max_age_us, txn)

    def _read(self, make, key: bytes, now: int, max_age_us: int | None, txn: lmdb.Transaction | None, *more):
        """make(raw record, key, now, max_age_us, *more) inside a read transaction (`txn`, or one of its own);
        an absent record is a miss (None), and so is one that does not read (counted and logged)."""
        own = None
        try:
            if txn is None:
                txn = own = self.store.begin(buffers=True)
            raw = txn.get(key, None, self._results)
            if raw is None:
                self.missed_because = "not_cached"
                return None
            return make(raw, key, now, max_age_us, *more)
        except CorruptRecord as exc:
            self._unreadable(key, exc)
        except lmdb.Error as exc:
            self.counters["read_errors"] += 1
            self._failed_log(logging.WARNING, "result cache read failed, serving a miss: %s", exc)
            if self.on_corrupt is not None and corrupted(exc):
                self.on_corrupt(key, exc)
        finally:
            if own is not None:
                own.abort()
        self.missed_because = "store_error"
        return None

    def _stale(self, expires: int, now: int) -> None:
        """Notes why a record that records.fresh refused is a miss (on the miss path only)."""
        self.missed_because = "expired" if expires and now >= expires else "too_old"

    def _record(self, raw, key: bytes, now: int, max_age_us: int | None) -> records.Record | None:
        record = records.decode(raw, key, self._ring)
        if records.fresh(record.created_us, record.expires_us, now, max_age_us):
            return record
        self._stale(record.expires_us, now)
        return None

    def answer(self, key: bytes, max_age_us: int | None, source: int, txn: lmdb.Transaction | None = None
               ) -> tuple[records.Record, pb.InferResponse] | None:
        """A fresh entry and its response, marked with `source` and the entry's age; None otherwise."""
        now = now_us()
        record = self.get(key, now, max_age_us, txn)
        if record is None:
            return None
        try:
            response = pb.InferResponse.FromString(record.payload)
        except DecodeError as exc:
            self._unreadable(key, exc)
            return None
        response.cache.source = source
        response.cache.age_s = record.age_s(now)
        return record, response

    def lookup(self, key: bytes, max_age_us: int | None = None, txn: lmdb.Transaction | None = None
               ) -> bytes | None:
        """A fresh entry's answer, serialized and marked RESULT_EXACT with its age, or None: the stored
        bytes plus a CacheInfo suffix (cachestore/wire.py), never parsed. The record's checksum has
        vouched for the stored bytes. This is the exact-hit path: for a record in clear, one copy of the
        payload straight from the memory map and no Record built."""
        return self._read(self._answer_bytes, key, now_us(), max_age_us, txn)

    def entry(self, key: bytes, max_age_us: int | None = None, kept: Container[tuple[bytes, int]] = ()
              ) -> tuple[bytes | None, bytes, int, float] | None:
        """A fresh entry as (stored answer, key, creation time in microseconds since the epoch, age in
        seconds), or None: lookup's read for a door that reshapes answers and keeps what it made of one by
        (key, creation time), which name the stored bytes without hashing them. The checksum has vouched
        for the bytes. An entry in clear whose (key, creation time) is in `kept` comes back with None for
        its answer, neither read nor checked again: the caller made what it needs of them when they were."""
        return self._read(self._entry, key, now_us(), max_age_us, None, kept)

    def _entry(self, raw, key: bytes, now: int, max_age_us: int | None, kept: Container[tuple[bytes, int]]
               ) -> tuple[bytes | None, bytes, int, float] | None:
        if kept and self._ring is None:
            created, expires = records.decode_times(raw)
            if (key, created) in kept:
                if records.fresh(created, expires, now, max_age_us):
                    return None, key, created, records.age_s(created, now)
                self._stale(expires, now)
                return None
        flags, kid, created, expires, payload = records.checked(raw)
        if flags & records.FLAG_ENCRYPTED or self._ring is not None:
            payload = records.opened(flags, kid, created, expires, payload, key, self._ring)
        if records.fresh(created, expires, now, max_age_us):
            return bytes(payload), key, created, records.age_s(created, now)
        self._stale(expires, now)
        return None

    def _answer_bytes(self, raw, key: bytes, now: int, max_age_us: int | None) -> bytes | None:
        flags, kid, created, expires, payload = records.checked(raw)
        if flags & records.FLAG_ENCRYPTED or self._ring is not None:  # sealed, or encryption is on: opened, or refused
            payload = records.opened(flags, kid, created, expires, payload, key, self._ring)
        if records.fresh(created, expires, now, max_age_us):
            return b"".join((payload, wire.cache_info(_RESULT_EXACT, records.age_s(created, now))))
        self._stale(expires, now)
        return None


# ---- write side: called by the writer thread inside its write transaction -------------------------

def put(store: Store, txn: lmdb.Transaction, key: bytes, ns: Namespace, record: records.Record,
        removed: list | None = None, namespaces_written: set | None = None, ttl_class: str = "") -> None:
    """`namespaces_written`: ns ids whose namespace row this transaction already wrote (one per batch).
    `ttl_class`: the TTL class the entry was stored for, kept in its eviction-index row and counted
    (Store.class_counts); "" = not counted."""
    dbs = store.dbs
    delete(store, txn, key, removed)
    txn.put(key, records.encode(record, key, store.ring), db=dbs[DB_RESULTS])
    name = ttl_class.encode()
    txn.put(_U64.pack(record.created_us) + key, name, db=dbs[DB_STORED])
    if name:
        _count(store, txn, name, 1)
    if record.expires_us:
        txn.put(_U64.pack(record.expires_us) + key, b"", db=dbs[DB_EXPIRY])
    ns_id = key[:NS_ID_BYTES]
    if namespaces_written is None or ns_id not in namespaces_written:
        txn.put(ns_id, ns.to_json(), db=dbs[DB_NAMESPACES], overwrite=False)
        if namespaces_written is not None:
            namespaces_written.add(ns_id)


def delete(store: Store, txn: lmdb.Transaction, key: bytes, removed: list | None = None) -> bool:
    """Deletes an entry with its index rows; its semantic row's (ns_id, label) goes to `removed`."""
    dbs = store.dbs
    raw = txn.get(key, db=dbs[DB_RESULTS])
    if raw is None:
        return False
    gone = semantic_log.remove(store, txn, key)
    if gone is not None and removed is not None:
        removed.append(gone)
    try:
        created, expires = records.decode_times(raw)
        name = txn.pop(_U64.pack(created) + key, db=dbs[DB_STORED])
        if name:
            _count(store, txn, bytes(name), -1)
        if expires:
            txn.delete(_U64.pack(expires) + key, db=dbs[DB_EXPIRY])
    except CorruptRecord:
        pass  # its index rows (if any) age out through sweep/evict, which skip missing records
    return txn.delete(key, db=dbs[DB_RESULTS])


def _count(store: Store, txn: lmdb.Transaction, name: bytes, step: int) -> None:
    """Entries of a TTL class, up or down by one (within the transaction that adds or removes one)."""
    db = store.dbs[DB_CLASSES]
    raw = txn.get(name, db=db)
    count = max(0, (int.from_bytes(raw, "big") if raw is not None else 0) + step)
    txn.put(name, count.to_bytes(8, "big"), db=db)


def delete_namespace(store: Store, txn: lmdb.Transaction, ns_id: bytes, removed: list | None = None) -> int:
    """Deletes every entry whose key starts with ns_id, and the namespace row itself."""
    keys = []
    with txn.cursor(db=store.dbs[DB_RESULTS]) as cursor:
        if cursor.set_range(ns_id):
            for key in cursor.iternext(keys=True, values=False):
                if not key.startswith(ns_id):
                    break
                keys.append(bytes(key))
    count = sum(delete(store, txn, key, removed) for key in keys)
    txn.delete(ns_id, db=store.dbs[DB_NAMESPACES])
    return count


def delete_selected(store: Store, txn: lmdb.Transaction, selector: Selector, removed: list | None = None) -> int:
    """Invalidate: deletes the entries `selector` names (the namespaces it matches, or its one key);
    how many went."""
    spaces = namespaces(store, txn)
    if selector.key is not None:
        ns = dict(spaces).get(selector.key[:NS_ID_BYTES])
        if ns is None or not selector.matches(ns):
            return 0
        deleted = delete(store, txn, selector.key, removed)
        drop_namespace_if_empty(store, txn, selector.key[:NS_ID_BYTES])
        return int(deleted)
    return sum(delete_namespace(store, txn, ns_id, removed) for ns_id, ns in spaces if selector.matches(ns))


def namespaces(store: Store, txn: lmdb.Transaction) -> list[tuple[bytes, Namespace]]:
    with txn.cursor(db=store.dbs[DB_NAMESPACES]) as cursor:
        return [(bytes(k), Namespace.from_json(bytes(v))) for k, v in cursor]


def _delete_index_prefix(store: Store, txn: lmdb.Transaction, index: bytes, stop: int | None, limit: int,
                         removed: list | None) -> int:
    """Deletes entries in index order (oldest first) until `stop` (a time) or `limit` entries."""
    victims = []
    with txn.cursor(db=store.dbs[index]) as cursor:
        for row in cursor.iternext(keys=True, values=False):
            if len(victims) >= limit or (stop is not None and _U64.unpack_from(row)[0] > stop):
                break
            victims.append(bytes(row))
    for row in victims:
        delete(store, txn, row[_U64.size:], removed)  # (with its index rows: its class is counted down)
        txn.delete(row, db=store.dbs[index])          # a row whose record is gone or unreadable
    for ns_id in {row[_U64.size:_U64.size + NS_ID_BYTES] for row in victims}:
        drop_namespace_if_empty(store, txn, ns_id)
    return len(victims)


def drop_namespace_if_empty(store: Store, txn: lmdb.Transaction, ns_id: bytes) -> bool:
    """Deletes the namespace row of a namespace with no entry left: rows of namespaces that come and go
    (many tenants) must not outlive their entries and grow the store past its budget."""
    with txn.cursor(db=store.dbs[DB_RESULTS]) as cursor:
        if cursor.set_range(ns_id) and bytes(cursor.key()).startswith(ns_id):
            return False
    return txn.delete(ns_id, db=store.dbs[DB_NAMESPACES])


def sweep_expired(store: Store, txn: lmdb.Transaction, now: int, limit: int = 10_000,
                  removed: list | None = None) -> int:
    return _delete_index_prefix(store, txn, DB_EXPIRY, now, limit, removed)


def sweep_created_before(store: Store, txn: lmdb.Transaction, cutoff: int, limit: int = 10_000,
                         removed: list | None = None) -> int:
    """Retention: deletes entries created at or before `cutoff`, whatever their expiry."""
    return _delete_index_prefix(store, txn, DB_STORED, cutoff, limit, removed)


def evict_oldest(store: Store, txn: lmdb.Transaction, count: int, removed: list | None = None) -> int:
    """Least-recently-stored eviction (readers never write, so there is no access time to use)."""
    return _delete_index_prefix(store, txn, DB_STORED, None, count, removed)
