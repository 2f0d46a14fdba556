"""Encryption at rest on real LMDB files: sealed records and semantic rows, tampering, moving, rotation."""

from __future__ import annotations

import base64
import os
import struct

import numpy as np
import pytest

from cachestore import records, results, semantic_log
from cachestore.env import DB_RESULTS, DB_SEMLOG, Store, StoreSettings
from cachestore.errors import Unsealable
from cachestore.keys import Namespace, entry_key
from cachestore.sealing import KeyFileError, KeyRing, key_id, parse_keys
from cachestore.writer import WriteBehind
from tests.helpers import reseal_crc

MB = 1 << 20
K1, K2 = os.urandom(32), os.urandom(32)
NS = Namespace("tenant", "minilm", "1")
PLANTED = b"planted plaintext 7f3a9c the store must never hold"


def open_store(path, keys=()) -> Store:
    return Store(StoreSettings(path, 64 * MB, 48 * MB, sync=False, keys=keys), readonly=False)


def write(store: Store, text: str, payload: bytes = PLANTED, embedding: np.ndarray | None = None) -> bytes:
    key = entry_key(NS.ns_id, text)
    writer = WriteBehind(store, sweep_interval_s=60)
    now = results.now_us()
    entry = None if embedding is None else semantic_log.SemanticEntry(NS.ns_id, "card_arrival", embedding)
    writer.put(key, NS, records.Record(now, now + 60_000_000, payload), semantic=entry)
    writer.flush().result(10)
    writer.close()
    return key


def test_key_file_formats_and_errors():
    assert parse_keys(K1) == (K1,)
    text = f"# rotated 2026-11\n{base64.b64encode(K2).decode()}\n\n{K1.hex()}  # the old one\n".encode()
    assert parse_keys(text) == (K2, K1)
    for bad, why in ((b"", "no key"), (b"c2hvcnQ=\n", "32 bytes"), (b"not base64 !!\n", "base64"),
                     (bytes(range(200, 240)), "binary")):
        with pytest.raises(KeyFileError, match=why):
            parse_keys(bad)
    assert 1 <= key_id(K1) <= 0xFFFF


def test_plaintext_is_in_a_clear_store_and_nowhere_in_a_sealed_one(tmp_path):
    for name, keys in (("clear", ()), ("sealed", (K1,))):
        store = open_store(tmp_path / name, keys)
        vector = np.full(8, 0.125, dtype=np.float32)
        write(store, "hello", embedding=vector)
        store.close()
        found = PLANTED in (tmp_path / name / "data.mdb").read_bytes()
        assert found == (name == "clear")
        store = open_store(tmp_path / name, keys)
        with store.begin() as txn:
            [row] = semantic_log.scan(store, txn, NS.ns_id)
        assert row.answer == "card_arrival" and np.array_equal(row.embedding, vector)
        assert results.ResultCache(store).get(entry_key(NS.ns_id, "hello"), results.now_us()).payload == PLANTED
        store.close()


def test_flipped_byte_moved_record_and_retired_key_are_misses(tmp_path):
    store = open_store(tmp_path / "cache", (K1,))
    a, b = write(store, "a"), write(store, "b")
    other = entry_key(NS.ns_id, "c")
    with store.begin(write=True) as txn:
        raw = bytes(txn.get(a, db=store.dbs[DB_RESULTS]))
        flipped = bytearray(raw)
        flipped[records.HEADER.size + 20] ^= 0x01
        txn.put(a, reseal_crc(bytes(flipped)), db=store.dbs[DB_RESULTS])
        txn.put(other, txn.get(b, db=store.dbs[DB_RESULTS]), db=store.dbs[DB_RESULTS])  # b's record under c's key
    cache = results.ResultCache(store)
    now = results.now_us()
    assert cache.get(a, now) is None and cache.get(other, now) is None
    assert cache.get(b, now).payload == PLANTED
    assert cache.counters["records_unsealable"] == 2
    store.close()
    # Rotation: the new key first, the old one kept: old records open, new ones are sealed with the new key.
    store = open_store(tmp_path / "cache", (K2, K1))
    d = write(store, "d")
    cache = results.ResultCache(store)
    assert cache.get(b, results.now_us()).payload == PLANTED
    with store.begin() as txn:
        assert records.HEADER.unpack_from(txn.get(d, db=store.dbs[DB_RESULTS]))[2] == key_id(K2)
    store.close()
    # The old key retired: its records are misses, never errors; without any key, sealed ones are too.
    for keys, readable in (((K2,), {d}), ((), set())):
        store = open_store(tmp_path / "cache", keys)
        cache = results.ResultCache(store)
        assert {k for k in (b, d) if cache.get(k, results.now_us()) is not None} == readable
        store.close()


def test_a_record_in_clear_is_a_miss_once_encryption_is_on(tmp_path):
    store = open_store(tmp_path / "cache")
    key = write(store, "written before encryption")
    store.close()
    store = open_store(tmp_path / "cache", (K1,))
    cache = results.ResultCache(store)
    assert cache.get(key, results.now_us()) is None and cache.counters["records_unsealable"] == 1
    with pytest.raises(Unsealable):
        with store.begin() as txn:
            records.decode(txn.get(key, db=store.dbs[DB_RESULTS]), key, store.ring)
    store.close()


def test_a_semantic_row_moved_or_tampered_is_skipped(tmp_path):
    store = open_store(tmp_path / "cache", (K1,))
    write(store, "x", embedding=np.ones(4, dtype=np.float32))
    write(store, "y", embedding=np.ones(4, dtype=np.float32))
    with store.begin(write=True) as txn:
        rows = list(txn.cursor(db=store.dbs[DB_SEMLOG]))
        (first_key, first), (_, second) = [(bytes(k), bytes(v)) for k, v in rows]
        txn.put(first_key, second, db=store.dbs[DB_SEMLOG])  # the second row's value under the first's label
    with store.begin() as txn:
        assert [row.key for row in semantic_log.scan(store, txn, NS.ns_id)] == [entry_key(NS.ns_id, "y")]
    store.close()


def test_sealing_binds_the_header_times():
    ring = KeyRing((K1,))
    raw = records.encode(records.Record(1, 2, PLANTED), b"k" * 24, ring)
    version, flags, kid, crc, created, expires = records.HEADER.unpack_from(raw)
    extended = struct.pack("<BBHIqq", version, flags, kid, crc, created, expires + 10**9) + raw[records.HEADER.size:]
    with pytest.raises(Unsealable):
        records.decode(extended, b"k" * 24, ring)
    assert records.decode(raw, b"k" * 24, ring).payload == PLANTED
