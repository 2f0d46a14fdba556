"""Semantic log: the entries of the semantic index, kept in LMDB beside the results they point to.

    semlog:  ns_id(8) + label(8, big-endian) -> key(24) + answer length(2) + answer (utf-8) + float32 embedding
    semkeys: key(24) -> ns_id(8) + label(8)               (to drop the row when the result goes)
    semnext: ns_id(8) -> next label(8)

Only the writer thread calls add/remove (inside its transactions); the worker rebuilds its in-memory
hnswlib index per namespace from `scan` (after loading a snapshot, only the labels it lacks).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Iterator

import lmdb
import numpy as np

from cachestore.env import DB_SEMKEYS, DB_SEMLOG, DB_SEMNEXT, Store
from cachestore.keys import KEY_BYTES, NS_ID_BYTES

_U64 = struct.Struct(">Q")
_ANSWER_LEN = struct.Struct("<H")


@dataclass(frozen=True)
class SemanticEntry:
    """What a result adds to its namespace's semantic index."""

    ns_id: bytes
    answer: str
    embedding: np.ndarray  # float32, unit length


@dataclass(frozen=True)
class Row:
    ns_id: bytes
    label: int
    key: bytes
    answer: str
    embedding: np.ndarray


def add(store: Store, txn: lmdb.Transaction, key: bytes, entry: SemanticEntry) -> Row:
    dbs = store.dbs
    raw = txn.get(entry.ns_id, db=dbs[DB_SEMNEXT])
    label = _U64.unpack(raw)[0] if raw else 0
    txn.put(entry.ns_id, _U64.pack(label + 1), db=dbs[DB_SEMNEXT])
    answer = entry.answer.encode()
    vector = np.ascontiguousarray(entry.embedding, dtype=np.float32)
    txn.put(entry.ns_id + _U64.pack(label), key + _ANSWER_LEN.pack(len(answer)) + answer + vector.tobytes(),
            db=dbs[DB_SEMLOG])
    txn.put(key, entry.ns_id + _U64.pack(label), db=dbs[DB_SEMKEYS])
    return Row(entry.ns_id, label, key, entry.answer, vector)


def remove(store: Store, txn: lmdb.Transaction, key: bytes) -> tuple[bytes, int] | None:
    """Drops the semantic row of `key`, if it has one; returns (ns_id, label) for the index."""
    dbs = store.dbs
    raw = txn.get(key, db=dbs[DB_SEMKEYS])
    if raw is None:
        return None
    raw = bytes(raw)
    txn.delete(key, db=dbs[DB_SEMKEYS])
    txn.delete(raw, db=dbs[DB_SEMLOG])
    return raw[:NS_ID_BYTES], _U64.unpack(raw[NS_ID_BYTES:])[0]


def _decode(ns_id: bytes, row_key: bytes, value: bytes) -> Row:
    key = value[:KEY_BYTES]
    (length,) = _ANSWER_LEN.unpack_from(value, KEY_BYTES)
    start = KEY_BYTES + _ANSWER_LEN.size
    answer = value[start:start + length].decode()
    vector = np.frombuffer(value[start + length:], dtype=np.float32).copy()
    return Row(ns_id, _U64.unpack(row_key[NS_ID_BYTES:])[0], key, answer, vector)


def namespaces(store: Store, txn: lmdb.Transaction) -> list[bytes]:
    with txn.cursor(db=store.dbs[DB_SEMNEXT]) as cursor:
        return [bytes(k) for k in cursor.iternext(keys=True, values=False)]


def scan(store: Store, txn: lmdb.Transaction, ns_id: bytes, labels_only: bool = False) -> Iterator[Row | int]:
    """Every live row of a namespace in label order (or just the labels)."""
    with txn.cursor(db=store.dbs[DB_SEMLOG]) as cursor:
        if not cursor.set_range(ns_id):
            return
        for row_key, value in cursor:
            row_key = bytes(row_key)
            if not row_key.startswith(ns_id):
                return
            yield _U64.unpack(row_key[NS_ID_BYTES:])[0] if labels_only else _decode(ns_id, row_key, bytes(value))
