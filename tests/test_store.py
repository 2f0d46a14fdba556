"""The result store on real LMDB files: records, indexes, invalidation, expiry, the byte budget."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import threading
import time

import lmdb
import pytest

from cachestore import diskspace, integrity, records, results
from cachestore.env import DB_EXPIRY, DB_META, DB_RESULTS, DB_STORED, Store, StoreSettings
from cachestore.errors import CorruptRecord, StoreError, StoreFormatError
from cachestore.keys import KEY_BYTES, Namespace, entry_key, parse_hex_key
from cachestore.keys import Selector
from cachestore.sealing import KeyRing
from cachestore.space import RUNWAY
from cachestore.writer import FLUSH_POLL_S, WriteBehind

MB = 1 << 20


def open_store(path, map_mb=64, budget_mb=48) -> Store:
    return Store(StoreSettings(path, map_mb * MB, budget_mb * MB, sync=False), readonly=False)


def put_all(writer: WriteBehind, ns: Namespace, texts, *, ttl_us=0, payload=b"x" * 100) -> list[bytes]:
    now = results.now_us()
    keys = []
    for text in texts:
        key = entry_key(ns.ns_id, text)
        writer.put(key, ns, records.Record(now, now + ttl_us if ttl_us else 0, payload))
        keys.append(key)
    writer.flush().result(10)
    return keys


@pytest.fixture
def store(tmp_path):
    store = open_store(tmp_path / "cache")
    yield store
    store.close()


@pytest.fixture
def writer(store):
    writer = WriteBehind(store, sweep_interval_s=0.2)
    yield writer
    writer.close()


def test_record_roundtrip_and_corruption_detected():
    record = records.Record(created_us=1, expires_us=2, payload=b"payload")
    raw = records.encode(record)
    assert records.decode(raw) == record
    with pytest.raises(CorruptRecord, match="checksum"):
        records.decode(raw[:-1] + b"X")
    with pytest.raises(CorruptRecord, match="format"):
        records.decode(b"\x09" + raw[1:])
    with pytest.raises(CorruptRecord):
        records.decode(b"short")


def test_large_records_are_checked_with_xxh3_and_any_changed_byte_is_found():
    """Payloads from 64 KiB on (prefix key/value blocks) carry xxh3's checksum, flagged; in clear and sealed."""
    payload = os.urandom(records.XXH3_FROM_BYTES)
    for ring in (None, KeyRing((b"k" * 32,))):
        raw = records.encode(records.Record(1, 2, payload), b"key", ring)
        flags = raw[1]
        assert flags & records.FLAG_XXH3 and bool(flags & records.FLAG_ENCRYPTED) == (ring is not None)
        assert records.decode(raw, b"key", ring).payload == payload
        for at in (records.HEADER.size, len(raw) // 2, len(raw) - 1):
            damaged = bytearray(raw)
            damaged[at] ^= 0x01
            with pytest.raises(CorruptRecord, match="checksum"):
                records.decode(bytes(damaged), b"key", ring)
    small = records.encode(records.Record(1, 2, payload[:records.XXH3_FROM_BYTES - 1]))
    assert not small[1] & records.FLAG_XXH3  # crc32, as before


def test_keys_are_fixed_length_and_namespaced():
    a, b = Namespace("t", "m", "1"), Namespace("t", "m", "2")
    ka, kb = entry_key(a.ns_id, "hello"), entry_key(b.ns_id, "hello")
    assert len(ka) == len(kb) == KEY_BYTES and ka != kb
    assert Namespace("a|b", "c", "1").ns_id != Namespace("a", "b|c", "1").ns_id
    assert parse_hex_key(ka.hex()) == ka
    with pytest.raises(ValueError, match="hex digits"):
        parse_hex_key("zz")


def test_put_get_and_freshness(store, writer):
    ns = Namespace("t", "m", "1")
    (key,) = put_all(writer, ns, ["q"], ttl_us=200_000)
    cache = results.ResultCache(store)
    now = results.now_us()
    assert cache.get(key, now).payload == b"x" * 100
    assert cache.get(key, now + 300_000) is None            # expired
    assert cache.get(key, now + 100_000, max_age_us=50_000) is None  # too old for this caller
    assert cache.get(entry_key(ns.ns_id, "other"), now) is None


def test_lookup_answers_with_the_stored_bytes_exactly_where_get_finds_a_fresh_record(store, writer):
    """The exact-hit path (lookup: the payload's bytes plus a CacheInfo suffix) and get agree on every
    state of a record: fresh, expired, too old for the caller, absent, corrupt."""
    from infercache.v1 import infercache_pb2 as pb

    ns = Namespace("t", "m", "1")
    stored = pb.InferResponse(outputs=[pb.Tensor(name="embedding", dtype="float32", shape=[2], data=b"\0" * 8)],
                              cache=pb.CacheInfo(model_version="1"))
    (key,) = put_all(writer, ns, ["q"], ttl_us=60_000_000, payload=stored.SerializeToString())
    cache = results.ResultCache(store)
    answer = pb.InferResponse.FromString(cache.lookup(key))
    assert answer.cache.source == pb.CacheInfo.RESULT_EXACT and 0 < answer.cache.age_s < 2
    assert list(answer.outputs) == list(stored.outputs) and answer.cache.model_version == "1"
    time.sleep(0.01)
    assert cache.lookup(key, max_age_us=5_000) is None and cache.missed_because == "too_old"
    assert cache.get(key, results.now_us(), max_age_us=5_000) is None and cache.missed_because == "too_old"
    assert cache.lookup(entry_key(ns.ns_id, "other")) is None and cache.missed_because == "not_cached"
    with store.begin(write=True) as txn:  # expired a moment ago (put in place: the sweeper would delete it)
        now = results.now_us()
        txn.put(key, records.encode(records.Record(now - 10, now - 1, stored.SerializeToString())),
                db=store.dbs[DB_RESULTS])
    assert cache.lookup(key) is None and cache.missed_because == "expired"
    assert cache.get(key, results.now_us()) is None and cache.missed_because == "expired"
    (key,) = put_all(writer, ns, ["corrupt"], payload=stored.SerializeToString())
    with store.begin(write=True) as txn:
        raw = bytearray(txn.get(key, db=store.dbs[DB_RESULTS]))
        raw[-1] ^= 0xFF
        txn.put(key, bytes(raw), db=store.dbs[DB_RESULTS])
    assert cache.lookup(key) is None and cache.missed_because == "store_error"
    assert cache.counters["records_unreadable"] == 1


def test_entry_reads_what_lookup_reads_and_skips_the_stored_bytes_a_door_kept(store, writer):
    """entry (the doors that reshape answers) finds what lookup finds: the stored bytes, the key, the
    creation time and the age; where the caller kept what it made of (key, creation time), the bytes are
    neither read nor checked, freshness still is; a record stored afresh under the key is read in full."""
    ns = Namespace("t", "m", "1")
    (key,) = put_all(writer, ns, ["q"], ttl_us=60_000_000, payload=b"answer")
    cache = results.ResultCache(store)
    stored, found_key, created, age_s = cache.entry(key)
    assert (stored, found_key) == (b"answer", key) and 0 < age_s < 2 and abs(created - results.now_us()) < 2_000_000
    assert cache.entry(key, kept={(key, created)})[0] is None
    assert cache.entry(key, kept={(key, created - 1)})[0] == b"answer"
    time.sleep(0.01)
    assert cache.entry(key, 5_000, kept={(key, created)}) is None and cache.missed_because == "too_old"
    assert cache.entry(entry_key(ns.ns_id, "other")) is None and cache.missed_because == "not_cached"
    with store.begin(write=True) as txn:  # the payload damaged: a kept entry is still answered from what was made
        raw = bytearray(txn.get(key, db=store.dbs[DB_RESULTS]))
        raw[-1] ^= 0xFF
        txn.put(key, bytes(raw), db=store.dbs[DB_RESULTS])
    assert cache.entry(key, kept={(key, created)})[0] is None
    assert cache.entry(key) is None and cache.missed_because == "store_error"
    (key,) = put_all(writer, ns, ["q"], ttl_us=60_000_000, payload=b"afresh")
    assert cache.entry(key, kept={(key, created)})[0] == b"afresh"


def test_a_store_handle_refuses_to_cross_a_fork(store):
    """LMDB handles must not be used in a forked child; the check costs no system call per read."""
    store.begin().abort()
    pid = os.fork()
    if pid == 0:  # the child: exits 0 only if the handle refused
        try:
            store.begin()
        except StoreError:
            os._exit(0)
        os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    store.begin().abort()  # the parent's handle still works


def test_corrupt_record_reads_as_a_miss(store, writer):
    ns = Namespace("t", "m", "1")
    (key,) = put_all(writer, ns, ["q"])
    with store.begin(write=True) as txn:
        raw = bytearray(txn.get(key, db=store.dbs[DB_RESULTS]))
        raw[-1] ^= 0xFF
        txn.put(key, bytes(raw), db=store.dbs[DB_RESULTS])
    assert results.ResultCache(store).get(key, results.now_us()) is None


def test_overwrite_keeps_indexes_consistent(store, writer):
    ns = Namespace("t", "m", "1")
    for _ in range(3):
        put_all(writer, ns, ["same"], ttl_us=10_000_000)
    with store.begin() as txn:
        assert txn.stat(store.dbs[DB_RESULTS])["entries"] == 1
        assert txn.stat(store.dbs[DB_STORED])["entries"] == 1
        assert txn.stat(store.dbs[DB_EXPIRY])["entries"] == 1


def test_invalidate_selectors(store, writer):
    spaces = [Namespace(t, m, v) for t in ("a", "b") for m in ("m1", "m2") for v in ("1", "2")]
    keys = {ns: put_all(writer, ns, ["x", "y"]) for ns in spaces}

    def count() -> int:
        with store.begin() as txn:
            return txn.stat(store.dbs[DB_RESULTS])["entries"]

    assert count() == 16
    assert writer.invalidate(Selector(key=keys[spaces[0]][0])).result(10) == 1
    assert writer.invalidate(Selector(key=keys[spaces[0]][0], tenant="b")).result(10) == 0
    assert writer.invalidate(Selector(tenant="a", model="m1", version="2")).result(10) == 2
    assert writer.invalidate(Selector(model="m2")).result(10) == 8
    assert writer.invalidate(Selector(tenant="b")).result(10) == 4
    assert count() == 1
    cache = results.ResultCache(store)
    assert cache.get(keys[spaces[0]][1], results.now_us()) is not None


def test_an_invalidation_refuses_entries_created_before_it(store, writer):
    """A result computed before an Invalidate (here, or on another pod and arriving through the fleet
    tier) is not stored after it; one created after it is."""
    ns, other = Namespace("t", "m", "1"), Namespace("u", "m", "1")
    before = results.now_us()
    time.sleep(0.002)
    assert writer.invalidate(Selector(tenant="t")).result(10) == 0
    old, new, elsewhere = (entry_key(n.ns_id, text) for n, text in ((ns, "old"), (ns, "new"), (other, "old")))
    writer.put(old, ns, records.Record(before, 0, b"stale"))
    writer.put(new, ns, records.Record(results.now_us(), 0, b"fresh"))
    writer.put(elsewhere, other, records.Record(before, 0, b"another tenant"))
    writer.flush().result(10)
    cache = results.ResultCache(store)
    now = results.now_us()
    assert cache.get(old, now) is None and writer.counters["fenced"] == 1
    assert cache.get(new, now).payload == b"fresh" and cache.get(elsewhere, now).payload == b"another tenant"


def test_sweeper_deletes_expired_entries(store, writer):
    ns = Namespace("t", "m", "1")
    put_all(writer, ns, [f"short {i}" for i in range(50)], ttl_us=100_000)
    put_all(writer, ns, [f"long {i}" for i in range(5)], ttl_us=600_000_000)
    deadline = time.monotonic() + 10
    while writer.counters["swept"] < 50 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert writer.counters["swept"] == 50
    with store.begin() as txn:
        assert txn.stat(store.dbs[DB_RESULTS])["entries"] == 5
        assert txn.stat(store.dbs[DB_EXPIRY])["entries"] == 5


def test_budget_evicts_least_recently_stored(tmp_path):
    store = open_store(tmp_path / "small", map_mb=16, budget_mb=2)
    writer = WriteBehind(store)
    ns = Namespace("t", "m", "1")
    keys = []
    for batch in range(30):  # ~6 MB of payload into a 2 MB budget
        keys += put_all(writer, ns, [f"{batch}-{i}" for i in range(50)], payload=bytes(4000))
        with store.begin() as txn:
            assert store.used_bytes(txn) <= store.settings.budget
    cache = results.ResultCache(store)
    now = results.now_us()
    assert cache.get(keys[-1], now) is not None
    assert cache.get(keys[0], now) is None
    assert writer.counters["evicted"] > 0 and writer.counters["write_errors"] == 0
    writer.close()
    store.close()


def test_the_budget_holds_when_new_records_are_bigger_than_the_evicted_ones(tmp_path):
    """A commit evicts a bounded number of entries; when each new record is far bigger than the oldest
    ones, eviction-only commits follow until the store is under its budget again."""
    store = open_store(tmp_path / "growing", map_mb=64, budget_mb=2)
    writer = WriteBehind(store, batch_max=64)
    ns = Namespace("t", "m", "1")
    put_all(writer, ns, [f"small {i}" for i in range(12_000)], payload=bytes(100))
    for batch in range(6):
        put_all(writer, ns, [f"big {batch}-{i}" for i in range(64)], payload=bytes(6000))
        with store.begin() as txn:
            assert store.used_bytes(txn) <= store.settings.budget, batch
    assert writer.counters["write_errors"] == 0
    writer.close()
    store.close()


def test_a_store_squeezed_by_its_disk_leaves_room_and_never_fails_a_write(small_disk):
    """Random keys into a budget far above a 12 MiB disk, a third of it someone else's. Copy-on-write makes
    the pages a commit needs far more than its records (a put rewrites a whole leaf page, an eviction frees
    pages all over the tree): the writer's budget leaves room for that churn, keeps the data file short of
    the disk's end and fails no commit for want of space."""
    (small_disk / "someone-elses-file").write_bytes(bytes(4 * MB))
    store = open_store(small_disk / "cache", map_mb=1024, budget_mb=1536)
    writer = WriteBehind(store)
    ns = Namespace("t", "m", "1")
    least_free = shutil.disk_usage(small_disk).free
    for batch in range(24):  # ~9 MiB of 1.5 KiB records
        put_all(writer, ns, [f"{batch}-{i}" for i in range(256)], payload=os.urandom(1500))
        least_free = min(least_free, shutil.disk_usage(small_disk).free)
    assert writer.counters["evicted"] > 0 and writer.counters["write_errors"] == 0, writer.counters
    assert least_free > MB // 2, (least_free, writer.counters)
    assert writer.budget < 8 * MB
    writer.close()
    store.close()


def test_a_disk_filled_under_a_full_store_is_met_with_small_commits(small_disk):
    """Another process takes most of the free space under a store that fills its share: the budget drops
    and the store evicts down to it in small commits (a commit that evicted the difference at once would
    need more new pages than the disk has left), with no failed write, and grows back once space returns."""
    store = open_store(small_disk / "cache", map_mb=1024, budget_mb=1536)
    writer = WriteBehind(store)
    ns = Namespace("t", "m", "1")
    for batch in range(8):
        put_all(writer, ns, [f"{batch}-{i}" for i in range(256)], payload=os.urandom(1500))
    roomy = writer.budget
    filler = small_disk / "someone-elses-file"
    filler.write_bytes(bytes(int(shutil.disk_usage(small_disk).free * 0.9)))
    for batch in range(10):
        put_all(writer, ns, [f"after {batch}-{i}" for i in range(256)], payload=os.urandom(1500))
    assert writer.counters["write_errors"] == 0 and writer.budget < roomy * 0.8, (roomy, writer.counters)
    with store.begin() as txn:
        assert store.used_bytes(txn) <= writer.budget
    filler.unlink()
    put_all(writer, ns, ["once space returned"])
    assert writer.budget > roomy * 0.9 and writer.counters["write_errors"] == 0, (roomy, writer.counters)
    writer.close()
    store.close()


def test_the_writer_holds_disk_blocks_ahead_of_the_data_file(tmp_path):
    """Blocks past the file's end are allocated (another process filling the disk cannot take them) while
    the file's size, which LMDB and the integrity check read, stays LMDB's own."""
    store = open_store(tmp_path / "held")
    writer = WriteBehind(store)
    put_all(writer, Namespace("t", "m", "1"), [str(i) for i in range(200)])
    if not writer.space.holding:
        pytest.skip("this file system cannot allocate blocks past a file's end (fallocate KEEP_SIZE)")
    stat = os.stat(tmp_path / "held" / "data.mdb")
    with store.begin() as txn:
        last_page_end = (store.env.info()["last_pgno"] + 1) * txn.stat()["psize"]
    assert stat.st_size == last_page_end  # what LMDB wrote, no more
    assert diskspace.allocated_bytes(stat) >= stat.st_size + RUNWAY * 3 // 4
    assert writer.counters["held_bytes"] >= stat.st_size + RUNWAY * 3 // 4
    assert integrity.problem(tmp_path / "held") is None
    writer.close()
    store.close()


def test_namespace_rows_go_with_their_last_entry(tmp_path):
    """Evicted, expired or invalidated: a namespace without entries leaves no row behind."""
    store = open_store(tmp_path / "small", map_mb=16, budget_mb=2)
    writer = WriteBehind(store, sweep_interval_s=0.2)
    once = [Namespace(f"tenant-{i}", "m", "1") for i in range(40)]
    for ns in once:  # forty tenants seen once, then enough of another tenant to evict them all
        put_all(writer, ns, [f"{ns.tenant} question"], payload=bytes(4000))
    brief = Namespace("brief", "m", "1")
    put_all(writer, brief, ["expires soon"], ttl_us=100_000)
    for batch in range(30):
        put_all(writer, Namespace("steady", "m", "1"), [f"{batch}-{i}" for i in range(50)], payload=bytes(4000))
    [only] = put_all(writer, Namespace("single", "m", "1"), ["the only entry"])
    assert writer.invalidate(Selector(key=only)).result(10) == 1
    deadline = time.monotonic() + 10
    while writer.counters["swept"] < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    with store.begin() as txn:
        left = {ns.tenant for _, ns in results.namespaces(store, txn)}
    assert left == {"steady"}, left
    writer.close()
    store.close()


def test_map_full_is_absorbed_not_raised(tmp_path):
    # Budget deliberately close to the map size: a put can hit MapFullError before eviction runs.
    store = open_store(tmp_path / "tiny", map_mb=2, budget_mb=1)
    writer = WriteBehind(store, batch_max=4096)
    ns = Namespace("t", "m", "1")
    for round_ in range(5):
        put_all(writer, ns, [f"{round_}-{i}" for i in range(400)], payload=bytes(3000))
    assert writer.counters["write_errors"] + writer.counters["map_full"] > 0
    assert writer.flush().result(10) is None  # the writer thread is alive and serving
    key = put_all(writer, ns, ["after"])[0]
    assert results.ResultCache(store).get(key, results.now_us()) is not None
    writer.close()
    store.close()


def _read_in_child(path: str, key: bytes, queue) -> None:
    store = Store(StoreSettings(__import__("pathlib").Path(path), 64 * MB, 48 * MB), readonly=True)
    record = results.ResultCache(store).get(key, results.now_us())
    queue.put(None if record is None else record.payload)


def test_another_process_reads_committed_entries(store, writer):
    ns = Namespace("t", "m", "1")
    (key,) = put_all(writer, ns, ["shared"], payload=b"from the writer")
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_read_in_child, args=(str(store.settings.path), key, queue))
    child.start()
    assert queue.get(timeout=60) == b"from the writer"
    child.join(30)
    assert child.exitcode == 0


def test_incompatible_store_format_is_refused(tmp_path):
    store = open_store(tmp_path / "old")
    with store.begin(write=True) as txn:
        txn.put(b"settings", b'{"format": 99}', db=store.dbs[DB_META])
    store.close()
    with pytest.raises(StoreFormatError, match="format 99"):
        open_store(tmp_path / "old")


def test_readonly_open_of_missing_store_is_a_store_error(tmp_path):
    from cachestore.errors import StoreError

    with pytest.raises(StoreError):
        Store(StoreSettings(tmp_path / "absent", 64 * MB, 48 * MB), readonly=True)
    assert lmdb  # the real library is what is under test


def test_commits_are_flushed_to_disk_together_once_the_sync_interval_has_passed(tmp_path):
    """cache.sync_interval_ms: commits return without an fsync of their own; the writer flushes the file
    once, sync_interval_s after the first commit that waits for it, and at close."""
    settings = StoreSettings(tmp_path / "s", 64 << 20, 48 << 20, sync=True, sync_interval_s=0.3)
    store = Store(settings, readonly=False)
    writer = WriteBehind(store, threaded=False)
    ns = Namespace("t", "m", "1")
    assert writer.flush_due_in() is None
    for n in range(3):  # three transactions
        writer.put(entry_key(ns.ns_id, f"text {n}"), ns, records.Record(results.now_us(), 0, b"answer"))
        writer.drain()
    assert writer.counters["write_txns"] >= 3 and writer.counters["disk_flushes"] == 0
    assert 0 < writer.flush_due_in() <= 0.3
    time.sleep(0.35)
    flushed_on, slow = [], threading.Event()

    def observed_flush() -> None:  # (the disk's own fsync, seen from here; the first one slowed down)
        flushed_on.append(threading.current_thread().name)
        slow.wait(5.0)
        flush()

    flush, store.flush_to_disk = store.flush_to_disk, observed_flush
    writer.drain()  # nothing queued: the flush that is due, begun on the flusher thread (commits go on)
    assert writer.counters["disk_flushes"] == 1 and writer.flush_due_in() is None
    writer.put(entry_key(ns.ns_id, "last"), ns, records.Record(results.now_us(), 0, b"answer"))
    began = time.monotonic()
    writer.drain()  # committed while the flush runs (not waiting for it)
    assert time.monotonic() - began < 1.0 and not slow.is_set()
    time.sleep(0.35)  # due now, but it waits for the one in flight
    writer.drain()
    assert writer.counters["disk_flushes"] == 1 and writer.flush_due_in() >= FLUSH_POLL_S  # (polled, not spun)
    slow.set()
    writer.close()  # flushes what waits, without waiting for the interval (in the caller's thread)
    assert writer.counters["disk_flushes"] == 2
    assert len(flushed_on) == 2 and flushed_on[0].startswith("store-flush") and flushed_on[1] == threading.current_thread().name
    store.close()
    reopened = Store(settings, readonly=True)
    assert results.ResultCache(reopened).get(entry_key(ns.ns_id, "last"), results.now_us()).payload == b"answer"
    reopened.close()


def test_with_an_fsync_per_commit_the_writer_flushes_nothing_itself(tmp_path):
    store = Store(StoreSettings(tmp_path / "s", 64 << 20, 48 << 20, sync=True), readonly=False)
    writer = WriteBehind(store, threaded=False)
    ns = Namespace("t", "m", "1")
    writer.put(entry_key(ns.ns_id, "text"), ns, records.Record(results.now_us(), 0, b"answer"))
    writer.drain()
    assert writer.flush_due_in() is None
    writer.close()
    assert writer.counters["disk_flushes"] == 0
    store.close()


def test_an_invalidation_is_on_disk_before_it_is_told_done(tmp_path):
    """With the flush interval, puts wait for the next flush; an invalidation is flushed in its commit."""
    store = Store(StoreSettings(tmp_path / "s", 64 << 20, 48 << 20, sync=True, sync_interval_s=30.0), readonly=False)
    writer = WriteBehind(store, threaded=False)
    ns = Namespace("t", "m", "1")
    writer.put(entry_key(ns.ns_id, "text"), ns, records.Record(results.now_us(), 0, b"answer"))
    writer.drain()
    assert writer.counters["disk_flushes"] == 0
    done = writer.invalidate(Selector(tenant="t"))
    writer.drain()
    assert done.result(1) == 1 and writer.counters["disk_flushes"] == 1
    writer.close()
    store.close()
