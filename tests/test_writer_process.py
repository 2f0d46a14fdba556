"""The worker's store writer in its own process (server/worker/store/writer.py): a real child process on a real
LMDB store, driven from an event loop as the worker drives it."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from concurrent.futures import Future

import numpy as np
import pytest

from cachestore import records
from cachestore.env import Store, StoreSettings
from cachestore.errors import StoreError
from cachestore.keys import NS_ID_BYTES, Namespace, entry_key
from cachestore.results import ResultCache, now_us
from cachestore.semantic_log import SemanticEntry
from cachestore.keys import Selector
from server.shared.errors import WorkerUnavailable
from server.worker.store.writer import WriterProcess
from tests.helpers import running

MB = 1 << 20
NS = Namespace("tenant", "model", "1")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _settings(path) -> StoreSettings:
    return StoreSettings(path, 64 * MB, 48 * MB, sync=False)


async def _start(path, group_commit_s: float = 0.05, **kwargs) -> WriterProcess:
    return await WriterProcess.start(_settings(path), batch_max=512, sweep_interval_s=30.0, max_ttl_s=0,
                                     group_commit_s=group_commit_s,
                                     what="result store", log_level="WARNING", role="test", **kwargs)


def _put(writer: WriterProcess, text: str, on_done=None, semantic: SemanticEntry | None = None) -> bytes:
    key = entry_key(NS.ns_id, text)
    now = now_us()
    writer.put(key, NS, records.Record(now, 0, f"answer to {text}".encode()), on_done=on_done, semantic=semantic)
    return key


def test_puts_are_committed_and_told_in_order_and_an_invalidation_counts_them(tmp_path):
    async def scenario():
        writer = await _start(tmp_path / "cache")
        told: list[int] = []
        keys = [_put(writer, f"text {i}", on_done=lambda i=i: told.append(i)) for i in range(300)]
        await asyncio.wrap_future(writer.flush())
        assert told == list(range(300))  # every put's callback, in the order put, by the time of the flush
        cache = ResultCache(writer.store)  # the worker's own read-only handle sees the commits
        assert all(cache.get(key, now_us()).payload == f"answer to text {i}".encode() for i, key in enumerate(keys))
        assert writer.counters["writes"] == 300
        assert await asyncio.wrap_future(writer.invalidate(Selector(key=keys[0]))) == 1
        assert await asyncio.wrap_future(writer.invalidate(Selector(tenant="other"))) == 0
        _put(writer, "one more")  # sent before the invalidation below: counted by it
        assert await asyncio.wrap_future(writer.invalidate(Selector(model="model", version="1"))) == 300
        assert cache.get(keys[1], now_us()) is None
        pid = writer.process.pid
        await writer.close()
        assert writer.process.exitcode == 0 and not running(pid)

    asyncio.run(scenario())


def test_a_semantic_entry_comes_back_to_the_worker_as_an_index_row_with_the_vector_it_sent(tmp_path):
    """The process names the row; the vector is the one the worker kept from its put."""
    async def scenario():
        writer = await _start(tmp_path / "cache")
        rows = []
        writer.on_semantic = lambda added, removed: rows.append((added, removed))
        embedding = np.linspace(-1, 1, 384, dtype=np.float32)
        key = _put(writer, "hello", semantic=SemanticEntry(entry_key(NS.ns_id, "hello")[:NS_ID_BYTES], "greeting",
                                                          embedding))
        await asyncio.wrap_future(writer.flush())
        assert not writer.semantic._vectors  # the vector the row named is let go once its put is handled
        removed = await asyncio.wrap_future(writer.invalidate(Selector(key=key)))
        await asyncio.wrap_future(writer.flush())
        await writer.close()
        return rows, removed, key

    rows, removed, key = asyncio.run(scenario())
    (added, _), (_, gone) = rows
    assert removed == 1
    assert [(r.key, r.answer) for r in added] == [(key, "greeting")]
    assert np.array_equal(added[0].embedding, np.linspace(-1, 1, 384, dtype=np.float32))
    assert gone == [(key[:NS_ID_BYTES], added[0].label)]


def _kill_when_sent(writer: WriterProcess, count: int, told: list, prefix: str = "text") -> tuple[list[bytes], Future]:
    """Stops the writer process, makes `count` puts (each told into `told`) and an invalidation of model
    "other model" (nothing of these puts), which it cannot handle; returns their keys and the future."""
    os.kill(writer.process.pid, signal.SIGSTOP)  # nothing it is sent from here on gets handled
    keys = [_put(writer, f"{prefix} {i}", on_done=lambda i=i: told.append(i)) for i in range(count)]
    return keys, writer.invalidate(Selector(model="other model"))


def test_a_writer_killed_with_puts_unconfirmed_is_started_again_and_handed_them(tmp_path):
    """kill -9 of the writer process with puts and an invalidation it had not confirmed: a new process
    commits every one of them, each callback is told once after that, the invalidation is answered, and
    the counters go on from the dead process's."""
    async def scenario():
        lost = asyncio.Event()
        writer = await _start(tmp_path / "cache", on_lost=lost.set)
        for i in range(10):
            _put(writer, f"early {i}")
        await asyncio.wrap_future(writer.flush())
        first = writer.process.pid
        told: list[int] = []
        keys, pending = _kill_when_sent(writer, 200, told)
        await asyncio.sleep(0.1)
        assert not told and not pending.done()
        os.kill(first, signal.SIGKILL)
        late = [_put(writer, f"late {i}", on_done=lambda i=i: told.append(1000 + i)) for i in range(50)]  # while it restarts
        assert await asyncio.wait_for(asyncio.wrap_future(pending), 30) == 0
        await asyncio.wait_for(asyncio.wrap_future(writer.flush()), 30)
        assert told == [*range(200), *range(1000, 1050)]  # each once, in order, after its commit
        assert writer.process.pid != first and not running(first) and not lost.is_set() and not writer.dead
        cache = ResultCache(writer.store)
        assert all(cache.get(key, now_us()) is not None for key in keys + late)
        counters = writer.counters
        assert counters["writes"] == 260 and counters["restarts"] == 1 and counters["backlog"] == 0
        await writer.close()
        assert writer.process.exitcode == 0

    asyncio.run(scenario())


def test_a_new_writer_keeps_refusing_what_an_invalidation_before_its_start_covers(tmp_path):
    """The fence: an answer computed before an Invalidate must not be stored after it, also when the
    writer that ran the invalidation died since."""
    async def scenario():
        writer = await _start(tmp_path / "cache")
        computed_before = now_us()
        assert await asyncio.wrap_future(writer.invalidate(Selector(tenant="tenant"))) == 0
        os.kill(writer.process.pid, signal.SIGKILL)
        key = entry_key(NS.ns_id, "stale")
        writer.put(key, NS, records.Record(computed_before, 0, b"stale answer"))
        fresh = _put(writer, "fresh")
        await asyncio.wait_for(asyncio.wrap_future(writer.flush()), 30)
        cache = ResultCache(writer.store)
        assert cache.get(key, now_us()) is None and cache.get(fresh, now_us()) is not None
        assert writer.counters["fenced"] == 1
        await writer.close()

    asyncio.run(scenario())


def test_a_writer_that_keeps_dying_is_given_up_releasing_every_waiting_write_and_telling_its_worker(tmp_path):
    """Past max_restarts deaths within RESTART_WINDOW_S the worker is told (it stops, and the supervisor
    starts it again) instead of a new process: a put or a store that kills every process must not keep
    the worker spawning them."""
    async def scenario():
        lost = asyncio.Event()
        writer = await _start(tmp_path / "cache", on_lost=lost.set, max_restarts=1)
        os.kill(writer.process.pid, signal.SIGKILL)
        await asyncio.wait_for(asyncio.wrap_future(writer.flush()), 30)  # answered by the new process
        assert writer.counters["restarts"] == 1 and not lost.is_set()
        told: list[int] = []
        _, pending = _kill_when_sent(writer, 50, told)
        os.kill(writer.process.pid, signal.SIGKILL)
        await asyncio.wait_for(lost.wait(), 30)
        assert len(told) == 50 and writer.dead
        with pytest.raises(WorkerUnavailable, match="writer process is gone"):
            await asyncio.wrap_future(pending)
        _put(writer, "after", on_done=lambda: told.append(1))  # dropped, and said so at once
        assert len(told) == 51
        with pytest.raises(WorkerUnavailable):
            await asyncio.wrap_future(writer.flush())
        await writer.close()

    asyncio.run(scenario())


def test_a_store_that_cannot_be_opened_is_a_store_error_and_leaves_no_process(tmp_path):
    (tmp_path / "cache").write_text("a file where the store's folder should be")

    async def scenario():
        with pytest.raises(StoreError, match="cannot open store"):
            await _start(tmp_path / "cache")

    asyncio.run(scenario())
    # (a child that stayed would keep the test process from exiting: multiprocessing joins it at exit)
    import multiprocessing

    assert not multiprocessing.active_children()


WORKER_KILLED = textwrap.dedent("""
    import asyncio, os, signal, sys
    from pathlib import Path
    from tests.test_writer_process import _put, _start

    async def main():
        writer = await _start(Path(sys.argv[1]))
        print(writer.process.pid, flush=True)
        os.kill(writer.process.pid, signal.SIGSTOP)  # it reads nothing until the test lets it go on
        for i in range(500):
            _put(writer, f"text {i}")
        await asyncio.sleep(0.2)  # in the socket's buffer
        os.kill(os.getpid(), signal.SIGKILL)

    asyncio.run(main())
""")


def test_what_a_killed_worker_sent_is_committed_and_its_writer_exits(tmp_path):
    """kill -9 of the worker: its writer process sees the socket close, commits everything it was sent,
    and exits (no orphan holding the store)."""
    worker = subprocess.Popen([sys.executable, "-c", WORKER_KILLED, str(tmp_path / "cache")], cwd=REPO,
                              stdout=subprocess.PIPE, text=True)
    writer_pid = int(worker.stdout.readline())  # (the writer shares this pipe: not read to its end)
    assert worker.wait(60) == -signal.SIGKILL
    worker.stdout.close()
    os.kill(writer_pid, signal.SIGCONT)
    give_up = time.monotonic() + 30
    while running(writer_pid) and time.monotonic() < give_up:
        time.sleep(0.05)
    assert not running(writer_pid)
    store = Store(_settings(tmp_path / "cache"), readonly=True)
    try:
        cache = ResultCache(store)
        missing = [i for i in range(500) if cache.get(entry_key(NS.ns_id, f"text {i}"), now_us()) is None]
        assert not missing
    finally:
        store.close()


def test_answers_nobody_waits_for_any_more_and_a_failing_listener_leave_the_writer_serving(tmp_path):
    """An Invalidate whose caller went away (its future cancelled) and a semantic listener that raises:
    neither may cost the worker its writer (both once closed the connection)."""
    async def scenario():
        lost = asyncio.Event()
        writer = await _start(tmp_path / "cache", on_lost=lost.set)
        writer.on_semantic = lambda added, removed: 1 / 0
        for i in range(200):
            _put(writer, f"text {i}")
        waited = asyncio.ensure_future(asyncio.wrap_future(writer.invalidate(Selector(model="model"))))
        await asyncio.sleep(0)
        waited.cancel()  # as a gRPC handler is cancelled at its deadline
        other = Namespace("tenant", "other model", "1")  # (out of the invalidation's reach: its fence)
        key = entry_key(other.ns_id, "indexed")
        writer.put(key, other, records.Record(now_us(), 0, b"answer"),
                   semantic=SemanticEntry(key[:NS_ID_BYTES], "a", np.ones(4, dtype=np.float32)))
        await asyncio.wrap_future(writer.flush())
        key = _put(writer, "after")
        await asyncio.wrap_future(writer.flush())
        assert not writer.dead and not lost.is_set()
        assert ResultCache(writer.store).get(key, now_us()) is not None
        assert writer.counters["notify_errors"] == 1
        await writer.close()

    asyncio.run(scenario())


def test_a_put_made_after_an_invalidation_in_the_same_loop_iteration_is_applied_after_it(tmp_path):
    """Puts and requests keep their order within one loop iteration (a frame applies its puts first: the
    put after the invalidation goes in the next frame). Applied after it, the later put is not counted
    as removed; the invalidation's fence refuses it (it was created before the invalidation ran)."""
    async def scenario():
        writer = await _start(tmp_path / "cache")
        _put(writer, "before")
        removed = writer.invalidate(Selector(tenant="tenant"))
        _put(writer, "after")  # no await in between
        assert await asyncio.wrap_future(removed) == 1
        await asyncio.wrap_future(writer.flush())
        assert writer.counters["fenced"] == 1 and writer.counters["invalidated"] == 1
        await writer.close()

    asyncio.run(scenario())


def test_a_writer_that_falls_behind_drops_puts_past_the_backlog_bound_and_commits_the_rest(tmp_path):
    async def scenario():
        writer = await _start(tmp_path / "cache", max_backlog=100)
        os.kill(writer.process.pid, signal.SIGSTOP)  # a writer that cannot keep up at all, for now
        try:
            told: list[int] = []
            keys = [_put(writer, f"text {i}", on_done=lambda i=i: told.append(i)) for i in range(150)]
            await asyncio.sleep(0.1)
            assert told == list(range(100, 150))  # past the bound: dropped, and told at once
            assert writer.counters["dropped_backlog"] == 50 and writer.counters["backlog"] == 100
        finally:
            os.kill(writer.process.pid, signal.SIGCONT)
        await asyncio.wrap_future(writer.flush())
        assert sorted(told) == list(range(150)) and writer.counters["backlog"] == 0
        cache = ResultCache(writer.store)
        assert all(cache.get(key, now_us()) is not None for key in keys[:100])
        assert all(cache.get(key, now_us()) is None for key in keys[100:])  # a later miss computes them again
        _put(writer, "caught up")  # room again
        await asyncio.wrap_future(writer.flush())
        assert writer.counters["writes"] == 101 and writer.counters["dropped_backlog"] == 50
        await writer.close()

    asyncio.run(scenario())


def test_behind_the_writer_one_off_answers_are_dropped_before_answers_several_callers_shared(tmp_path):
    async def scenario():
        writer = await _start(tmp_path / "cache", max_backlog=100)
        os.kill(writer.process.pid, signal.SIGSTOP)
        try:
            one_off = [_put(writer, f"one-off {i}") for i in range(110)]
            shared = [entry_key(NS.ns_id, f"shared {i}") for i in range(40)]
            for key in shared:
                writer.put(key, NS, records.Record(now_us(), 0, b"answer"), shared=True)
            await asyncio.sleep(0.1)
            # one-off answers stop at 100 waiting, shared ones at 125
            assert writer.counters["backlog"] == 125
            assert writer.counters["dropped_backlog"] == 10 + 15 and writer.counters["dropped_backlog_shared"] == 15
        finally:
            os.kill(writer.process.pid, signal.SIGCONT)
        await asyncio.wrap_future(writer.flush())
        cache = ResultCache(writer.store)
        assert [cache.get(key, now_us()) is not None for key in one_off] == [True] * 100 + [False] * 10
        assert [cache.get(key, now_us()) is not None for key in shared] == [True] * 25 + [False] * 15
        await writer.close()

    asyncio.run(scenario())


def test_commits_reach_the_disk_within_the_sync_interval_also_when_no_more_puts_come(tmp_path):
    """The process flushes its commits sync_interval_s after the first that waits, though nothing more
    arrives to wake it."""
    async def scenario():
        settings = StoreSettings(tmp_path / "cache", 64 * MB, 48 * MB, sync=True, sync_interval_s=0.2)
        writer = await WriterProcess.start(settings, batch_max=512, sweep_interval_s=30.0, max_ttl_s=0,
                                           group_commit_s=0.0, what="result store", log_level="WARNING",
                                           role="test")
        for i in range(50):
            _put(writer, f"text {i}")
        await asyncio.wrap_future(writer.flush())
        deadline = time.monotonic() + 10
        while writer.counters["disk_flushes"] == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert writer.counters["disk_flushes"] >= 1 and writer.counters["writes"] == 50
        await writer.close()

    asyncio.run(scenario())


def test_puts_sent_one_after_another_share_a_transaction_and_are_told_without_a_flush(tmp_path):
    """Group commit: puts wait up to group_commit_s (cache.group_commit_ms in the server) for others to
    share their transaction. Without the wait each of these frames was a transaction of its own (an fsync
    each). No flush here: what is held is committed, and told, when the wait ends."""
    async def scenario(group_commit_s: float) -> int:
        writer = await _start(tmp_path / f"cache-{group_commit_s}", group_commit_s=group_commit_s)
        told: list[int] = []
        for i in range(20):
            _put(writer, f"text {i}", on_done=lambda i=i: told.append(i))
            await asyncio.sleep(0.005)  # a frame of its own, which the writer has received before the next
        deadline = time.monotonic() + 10
        while (len(told) < 20 or writer.counters["writes"] < 20) and time.monotonic() < deadline:
            await asyncio.sleep(0.005)  # (the counters come with the answer)
        assert told == list(range(20)) and writer.counters["writes"] == 20
        txns = writer.counters["write_txns"]
        await writer.close()
        return txns

    assert asyncio.run(scenario(1.0)) <= 2  # 20 frames within a second: one transaction (two if it ends between)
    assert asyncio.run(scenario(0.0)) >= 5  # the same frames with no wait: about one transaction each


def test_a_flush_or_an_invalidation_commits_held_puts_at_once(tmp_path):
    async def scenario():
        writer = await _start(tmp_path / "cache", group_commit_s=30.0)  # puts alone would wait 30 s
        key = _put(writer, "held")
        started = time.monotonic()
        await asyncio.wrap_future(writer.flush())
        assert ResultCache(writer.store).get(key, now_us()) is not None
        _put(writer, "held too")
        assert await asyncio.wrap_future(writer.invalidate(Selector(tenant="tenant"))) == 2
        assert time.monotonic() - started < 10
        await writer.close()

    asyncio.run(scenario())
