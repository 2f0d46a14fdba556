"""What a supervisor killed with kill -9 leaves on the host: no named semaphores (it uses none), and a
temporary socket folder that the next supervisor to start removes."""

from __future__ import annotations

import os
import signal
import tempfile
import time
from pathlib import Path

from tests.helpers import running, wait_for

DEFAULT_SOCKET_DIR = ("server.socket_dir=", "server.drain_s=1")  # "" = a fresh temporary folder


def _children(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _semaphores(pid: int) -> set[str]:
    """The named POSIX semaphores a process has mapped (multiprocessing's locks and queues)."""
    return {line.split(None, 5)[5] for line in Path(f"/proc/{pid}/maps").read_text().splitlines()
            if "/dev/shm/sem." in line}


def _socket_dirs() -> set[Path]:
    return set(Path(tempfile.gettempdir()).glob("infercache-*"))


def test_a_supervisor_killed_with_kill_9_leaves_no_semaphore_and_its_socket_folder_goes_at_the_next_start(
        start_server):
    before = _socket_dirs()
    first = start_server(frontends=1, settings=DEFAULT_SOCKET_DIR)
    supervisor = first.proc.pid
    ours = [d for d in _socket_dirs() - before if (d / "worker-0.sock").exists()]
    assert len(ours) == 1, ours
    stats = first.stats()
    family = [supervisor, *_children(supervisor), stats.frontend.pid, stats.worker.pid]
    mapped = set().union(*(_semaphores(pid) for pid in family if running(pid)))
    # kill -9 of the supervisor and of the helpers it started itself (multiprocessing's resource tracker,
    # which unlinks semaphores after a supervisor that dies alone: an OOM kill of the pod's group is not alone)
    for pid in [supervisor, *(p for p in _children(supervisor)
                              if b"resource_tracker" in Path(f"/proc/{p}/cmdline").read_bytes())]:
        os.kill(pid, signal.SIGKILL)
    first.proc.wait(10)
    wait_for(lambda: not running(stats.frontend.pid) and not running(stats.worker.pid), 30, "the orphans to stop")
    assert not mapped, f"the server's processes use named semaphores, which kill -9 leaves in /dev/shm: {mapped}"
    assert ours[0].is_dir()  # left behind, as nobody stopped the server

    second = start_server(frontends=1, settings=DEFAULT_SOCKET_DIR)
    assert not ours[0].exists(), f"{ours[0]} was left behind by a supervisor killed -9 and is still there"
    assert "left by a supervisor that did not stop" in second.log_text()
    mine = [d for d in _socket_dirs() if (d / "worker-0.sock").exists() and d not in before]
    assert len(mine) == 1 and mine[0] != ours[0]  # the live server's folder is left alone (it holds its lock)
    assert second.stop() == 0
    deadline = time.monotonic() + 10
    while mine[0].exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not mine[0].exists()  # and a supervisor that stops removes its own


def test_a_second_supervisor_on_a_configured_socket_folder_in_use_is_refused(start_server, tmp_path):
    shared = tmp_path / "run"
    first = start_server(frontends=1, settings=(f"server.socket_dir={shared}",))
    second = start_server(frontends=1, settings=(f"server.socket_dir={shared}",), wait=False)
    assert second.proc.wait(60) != 0
    assert f"server.socket_dir {shared} is in use by another infercache supervisor (pid {first.proc.pid})" \
        in second.log_text()
    assert first.stats().worker.pid  # the first one still serves
