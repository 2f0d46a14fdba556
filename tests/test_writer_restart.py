"""kill -9 of a worker's store writer process while callers send distinct misses, through a real server:
every answer acknowledged before, during and after the kill is in the store afterwards, and the worker
serves on (a new writer process took over). It used to keep answering for server.drain_s with every
write dropped, then exit: 1,324 acknowledged answers of 10 s missing from the store."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import grpc

from harness.servers import settled
from tests.helpers import is_cached, running, unique, wait_for

CALLERS = 4


def writer_pid(worker: int, store_dir: Path) -> int:
    """The worker's child process that maps the store's data file: its writer."""
    children = [int(p) for p in Path(f"/proc/{worker}/task/{worker}/children").read_text().split()]
    data = str(store_dir / "data.mdb")
    [pid] = [pid for pid in children if data in Path(f"/proc/{pid}/maps").read_text()]
    return pid


def test_answers_acknowledged_around_a_writer_kill_are_all_stored(start_server):
    server = start_server(frontends=1)
    worker = server.worker_pid()
    first = writer_pid(worker, server.cache_dir)
    acknowledged: list[str] = []
    failures: list[str] = []
    stop = threading.Event()

    def caller(n: int) -> None:
        with server.client(timeout_s=30) as client:
            while not stop.is_set():
                text = unique(f"writer kill {n}")
                try:
                    if client.infer("minilm", text).source == "MISS":
                        acknowledged.append(text)
                except grpc.RpcError as exc:  # none expected: the worker never goes away
                    failures.append(exc.code().name)

    threads = [threading.Thread(target=caller, args=(n,)) for n in range(CALLERS)]
    for thread in threads:
        thread.start()
    try:
        wait_for(lambda: len(acknowledged) >= 20, 60, "misses before the kill")
        os.kill(first, signal.SIGKILL)
        at_kill = len(acknowledged)
        time.sleep(3.0)  # misses keep coming while a new writer starts and after
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
    assert len(acknowledged) > at_kill + 20, "the test sent too few misses after the kill to say anything"
    assert not failures, failures
    settled(server, "writer.writes")
    with server.client() as client:
        missing = [text for text in acknowledged if not is_cached(client, "minilm", text)]
    assert not missing, f"{len(missing)} of {len(acknowledged)} acknowledged answers are not in the store"
    assert server.worker_pid() == worker  # it served on
    assert not running(first) and writer_pid(worker, server.cache_dir) != first
    assert "writer process is back" in server.log_text()
    assert server.stats().worker.counters["writer.restarts"] == 1


def test_a_writer_that_keeps_dying_stops_its_worker_at_once_and_the_supervisor_starts_it_again(start_server):
    """Past MAX_RESTARTS deaths within a minute the worker gives its writer up and stops taking items at
    once (its frontends send them elsewhere, or to the worker started again), rather than answering for
    server.drain_s with nothing stored."""
    from server.worker.store.writer import MAX_RESTARTS

    server = start_server(frontends=1, settings=("server.drain_s=60",))
    worker = server.worker_pid()
    for _ in range(MAX_RESTARTS + 1):
        pid = wait_for(lambda: _writer_if_any(worker, server.cache_dir), 60, "a writer process")
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not running(pid), 10, "the writer to go")
    wait_for(lambda: not running(worker), 30, "the worker to stop (it would take server.drain_s = 60 s to drain)")
    assert "stopping at once: a store writer was given up" in server.log_text()
    text = unique("after the worker came back")
    with server.client(timeout_s=60) as client:
        wait_for(lambda: server.worker_pid() not in (0, worker), 60, "the supervisor to start the worker again")
        assert client.infer("minilm", text).source == "MISS"
        settled(server, "writer.writes")
        assert is_cached(client, "minilm", text)


def _writer_if_any(worker: int, store_dir: Path) -> int | None:
    try:
        return writer_pid(worker, store_dir)
    except (ValueError, FileNotFoundError):  # none yet (a new one starting), or one that just went
        return None
