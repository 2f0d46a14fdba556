"""Semantic log: the entries of the semantic index, kept in LMDB beside the results they point to.

    semlog:  ns_id(8) + label(8, big-endian) -> key(24) + answer length(2) + answer (utf-8) + float32 embedding
             with encryption on: key(24) + 0xFFFF + key id(2) + sealed(answer length + answer + embedding)
    semkeys: key(24) -> ns_id(8) + label(8)               (to drop the row when the result goes)
    semnext: ns_id(8) -> next label(8)

The sealed form binds a row to its row key and entry key (cachestore/sealing.py); a row that does not
open is skipped (a lost match, never a wrong one). Only the writer thread calls add/remove (inside its
transactions); the worker rebuilds its in-memory hnswlib index per namespace from `scan` (after loading a
snapshot, only the labels it lacks).
"""

from __future__ import annotations

import logging
import struct
from dataclasses import dataclass
from typing import Iterator

import lmdb
import numpy as np

from cachestore.env import DB_SEMKEYS, DB_SEMLOG, DB_SEMNEXT, Store
from cachestore.errors import Unsealable
from cachestore.keys import KEY_BYTES, NS_ID_BYTES

log = logging.getLogger("infercache.store")

_U64 = struct.Struct(">Q")
_ANSWER_LEN = struct.Struct("<H")
_SEALED = 0xFFFF              # in the answer-length field: the rest is sealed (answers are shorter)
_KEY_ID = struct.Struct("<H")
_TABLE = b"semlog\x00"


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


def add(store: Store, txn: lmdb.Transaction, key: bytes, entry: SemanticEntry, labels: dict[bytes, int]) -> Row:
    """The entry's row, under its namespace's next label. `labels`: the next label of each namespace this
    transaction has added to so far (read once, here; the caller writes them back with save_labels)."""
    dbs = store.dbs
    label = labels.get(entry.ns_id)
    if label is None:
        raw = txn.get(entry.ns_id, db=dbs[DB_SEMNEXT])
        label = _U64.unpack(raw)[0] if raw else 0
    labels[entry.ns_id] = label + 1
    answer = entry.answer.encode()[:_SEALED - 1]
    vector = np.ascontiguousarray(entry.embedding, dtype=np.float32)
    row_key = entry.ns_id + _U64.pack(label)
    body = _ANSWER_LEN.pack(len(answer)) + answer + vector.tobytes()
    if store.ring is not None:
        sealed = store.ring.seal(body, _TABLE + row_key + key)
        body = _ANSWER_LEN.pack(_SEALED) + _KEY_ID.pack(store.ring.sealing_id) + sealed
    txn.put(row_key, key + body, db=dbs[DB_SEMLOG])
    txn.put(key, row_key, db=dbs[DB_SEMKEYS])
    return Row(entry.ns_id, label, key, entry.answer, vector)


def save_labels(store: Store, txn: lmdb.Transaction, labels: dict[bytes, int]) -> None:
    """The next labels `add` moved on, written back (once per namespace and transaction)."""
    for ns_id, label in labels.items():
        txn.put(ns_id, _U64.pack(label), db=store.dbs[DB_SEMNEXT])


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


def _decode(store: Store, ns_id: bytes, row_key: bytes, value: bytes) -> Row:
    key, body = value[:KEY_BYTES], value[KEY_BYTES:]
    (length,) = _ANSWER_LEN.unpack_from(body)
    if length == _SEALED:
        if store.ring is None:
            raise Unsealable("semantic row is encrypted and no encryption key is configured")
        (kid,) = _KEY_ID.unpack_from(body, _ANSWER_LEN.size)
        body = store.ring.open(kid, body[_ANSWER_LEN.size + _KEY_ID.size:], _TABLE + row_key + key)
        (length,) = _ANSWER_LEN.unpack_from(body)
    elif store.ring is not None:
        raise Unsealable("semantic row stored in clear, and encryption is on")
    start = _ANSWER_LEN.size
    answer = body[start:start + length].decode()
    vector = np.frombuffer(body[start + length:], dtype=np.float32).copy()
    return Row(ns_id, _U64.unpack(row_key[NS_ID_BYTES:])[0], key, answer, vector)


def namespaces(store: Store, txn: lmdb.Transaction) -> list[bytes]:
    with txn.cursor(db=store.dbs[DB_SEMNEXT]) as cursor:
        return [bytes(k) for k in cursor.iternext(keys=True, values=False)]


def scan(store: Store, txn: lmdb.Transaction, ns_id: bytes, labels_only: bool = False) -> Iterator[Row | int]:
    """Every live row of a namespace in label order (or just the labels); rows that do not open or
    parse are skipped, with one warning per scan."""
    skipped = 0
    with txn.cursor(db=store.dbs[DB_SEMLOG]) as cursor:
        if not cursor.set_range(ns_id):
            return
        for row_key, value in cursor:
            row_key = bytes(row_key)
            if not row_key.startswith(ns_id):
                break
            if labels_only:
                yield _U64.unpack(row_key[NS_ID_BYTES:])[0]
                continue
            try:
                yield _decode(store, ns_id, row_key, bytes(value))
            except (Unsealable, ValueError, struct.error):
                skipped += 1
    if skipped:
        log.warning("skipped %d unreadable semantic row(s) of namespace %s (they match nothing)", skipped, ns_id.hex())
