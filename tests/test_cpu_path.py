"""The CPU path: on a host without GPUs the default runtime (auto) is ONNX Runtime and no server
process loads torch; worker placement (server/shared/devices.py); the null runtime."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from harness.servers import REPO
from server import mps
from server.shared.devices import WorkerPlacement, auto_per_gpu, plan_workers, resolve_runtime, visible_gpus
from tests.helpers import running, unique

MODEL = "minilm"


def process_tree(pid: int) -> list[int]:
    """pid and all its descendants (children of every thread, not only the main one's)."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        for task in Path(f"/proc/{current}/task").iterdir():
            try:
                todo.extend(int(child) for child in (task / "children").read_text().split())
            except FileNotFoundError:  # the thread ended meanwhile
                pass
    return found


def torch_mappings(pid: int) -> list[str]:
    """Lines of the process's memory map that belong to torch."""
    maps = Path(f"/proc/{pid}/maps").read_text()
    return [line for line in maps.splitlines() if "libtorch" in line or "/torch/" in line]


def test_the_torch_probe_sees_torch_where_it_is_loaded():
    """The check below could fail: a process that imported torch has it in its maps."""
    with subprocess.Popen([sys.executable, "-c", "import sys, torch; print('ok', flush=True); sys.stdin.read()"],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as proc:
        try:
            assert proc.stdout.readline().strip() == "ok"
            lines = torch_mappings(proc.pid)
        finally:
            proc.stdin.close()
    assert any("libtorch" in line for line in lines) and any("/torch/" in line for line in lines)


def test_no_server_process_loads_torch_on_a_cpu_host(start_server):
    if visible_gpus():
        pytest.skip("a GPU is visible: auto picks a GPU runtime here")
    server = start_server()  # engines.runtime left at its default, auto
    with server.client() as client:
        assert client.infer(MODEL, unique("cpu path")).source == "MISS"  # the engine ran
        models = {m.name: m for m in client.models()}
        stats = client.stats()
    assert [(e.runtime, e.device) for e in models[MODEL].engines] == [("onnxruntime", "cpu")]
    assert "cpu onnxruntime" in server.log_text()  # the supervisor's placement line

    pids = process_tree(server.proc.pid)
    assert {stats.frontend.pid, *(w.pid for w in stats.workers)} <= set(pids)
    assert len(pids) >= 4  # supervisor, worker, two frontends (and multiprocessing's helpers)
    loaded = {pid: lines[:2] for pid in pids if (lines := torch_mappings(pid))}
    assert not loaded, f"torch is mapped into server processes: {loaded}"


def test_a_workers_start_is_timed_phase_by_phase(start_server):
    """GetStats and the log say where a worker's start went (the phases of server/worker/startup.py)."""
    server = start_server()
    with server.client() as client:
        assert client.infer(MODEL, unique("start profile")).source == "MISS"
        [worker] = client.stats().workers
    start = dict(worker.start_seconds)
    assert {"imports", "runtime_import", "device_init", "ready", "warm"} <= set(start), start
    assert 0 < start["imports"] < start["ready"] <= start["warm"], start
    assert sum(start[p] for p in ("imports", "runtime_import", "device_init")) <= start["ready"], start
    [engine] = [e for e in worker.engines if e.model == MODEL]
    assert engine.warmup_seconds["load"] > 0 and engine.warmup_seconds["warmup"] > 0, engine
    assert "capture" not in engine.warmup_seconds  # ONNX Runtime captures nothing
    log = server.log_text()
    assert re.search(r"worker 0 ready on .* [0-9.]+ s after its start: imports [0-9.]+ s, runtime_import "
                     rf"[0-9.]+ s, device_init [0-9.]+ s; {MODEL} 1: load [0-9.]+ s, warmup", log), log[-3000:]
    assert re.search(r"at full speed [0-9.]+ s after its start", log)


def test_server_processes_run_numpy_on_one_blas_thread(start_server):
    """OpenBLAS's threads spin beside the engine's (server/__main__.py): every process the supervisor
    starts (frontends, worker, writers) inherits one thread, unless the operator set otherwise. (The
    supervisor's own /proc environ is the one it was started with, before it set the variable.)"""
    server = start_server()
    with server.client() as client:
        assert client.infer(MODEL, unique("blas")).source == "MISS"  # the writers are running
    pids = process_tree(server.proc.pid)
    assert len(pids) >= 5  # supervisor, worker, its writer, two frontends
    wanted = os.environ.get("OPENBLAS_NUM_THREADS", "1")
    for pid in pids[1:]:
        environ = dict(line.split("=", 1) for line in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in line)
        assert environ.get("OPENBLAS_NUM_THREADS") == wanted, (pid, Path(f"/proc/{pid}/cmdline").read_text())


def _thread_cpu(pid: int) -> dict[int, int]:
    """CPU ticks each thread of `pid` has used."""
    ticks = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            ticks[int(task.name)] = int(fields[11]) + int(fields[12])
        except (FileNotFoundError, ProcessLookupError):  # ended meanwhile
            pass
    return ticks


@pytest.mark.parametrize("nice", [5, 0])
def test_cpu_workers_engine_threads_run_nicer_than_their_event_loop(start_server, nice):
    """server.cpu_worker_nice: on shared cores a frontend's hit or refusal, and the worker's own event
    loop (admission, refusals, answers), go before the engine's batches. Every thread that did a good
    share of the work while misses were computed (the engine's: its batch thread and ONNX Runtime's
    pool) runs `nice` steps nicer; the worker's event loop, its writer process and the frontends keep
    the supervisor's priority."""
    if visible_gpus():
        pytest.skip("a GPU is visible: auto picks a GPU runtime here, whose workers keep the frontends' priority")
    server = start_server(settings=(f"server.cpu_worker_nice={nice}",))
    worker = server.stats().workers[0].pid
    before = _thread_cpu(worker)
    with server.client() as client:
        for _ in range(40):  # long texts: the engine's threads work for many clock ticks
            assert client.infer(MODEL, unique("nice") + " a long enough text to keep the encoder busy" * 20).source == "MISS"
        stats = client.stats()
    used = {t: ticks - before.get(t, 0) for t, ticks in _thread_cpu(worker).items() if t != worker}
    most = max(used.values())
    assert most > 0
    engine = [t for t, ticks in used.items() if ticks >= most / 5]
    base = os.getpriority(os.PRIO_PROCESS, server.proc.pid)
    assert os.getpriority(os.PRIO_PROCESS, stats.frontend.pid) == base
    assert os.getpriority(os.PRIO_PROCESS, worker) == base  # its main thread: the event loop
    assert {os.getpriority(os.PRIO_PROCESS, t) for t in engine} == {min(19, base + nice)}
    writers = process_tree(worker)[1:]
    assert writers and {os.getpriority(os.PRIO_PROCESS, pid) for pid in writers} == {base}


def test_a_nicer_executor_lowers_its_threads_and_what_they_start():
    """Niceness is a thread's on Linux: an executor's threads are lowered, threads they start inherit
    it, and the thread that made the executor keeps its own."""
    code = """if True:
        import os, threading
        from server.shared.process import nicer_executor
        base, ids = os.getpriority(os.PRIO_PROCESS, 0), []
        def work():
            ids.append(os.getpriority(os.PRIO_PROCESS, 0))
            started = threading.Thread(target=lambda: ids.append(os.getpriority(os.PRIO_PROCESS, 0)))
            started.start()
            started.join()
        with nicer_executor(3, 1) as pool:
            pool.submit(work).result()
        print(ids[0] - base, ids[1] - base, os.getpriority(os.PRIO_PROCESS, 0) - base)
    """
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["3", "3", "0"] or os.getpriority(os.PRIO_PROCESS, 0) > 16  # (already near 19)


def test_importing_and_planning_does_not_import_torch():
    code = ("import sys; from server.shared import devices; "
            "devices.plan_workers('auto', 0, devices.visible_gpus()); devices.resolve_runtime('auto', ['0']); "
            "print(sorted(m for m in ('torch', 'tensorrt', 'cuda') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_auto_without_gpus_is_one_onnxruntime_worker_on_cpu():
    assert resolve_runtime("auto", []) == "onnxruntime"
    [placement] = plan_workers("auto", 0, [])
    assert placement == WorkerPlacement(0, "onnxruntime", None) and placement.device == "cpu"


def test_cpu_runtime_ignores_gpus_and_takes_the_worker_count():
    placements = plan_workers("onnxruntime", 2, ["0"])
    assert placements == [WorkerPlacement(0, "onnxruntime", None), WorkerPlacement(1, "onnxruntime", None)]
    assert [p.device for p in placements] == ["cpu", "cpu"]
    assert plan_workers("null", 0, ["0", "1"]) == [WorkerPlacement(0, "null", None)]


def test_gpu_runtime_takes_one_worker_per_gpu():
    placements = plan_workers("torch-cuda", 0, ["0", "1"])
    assert [(p.index, p.runtime, p.gpu, p.device) for p in placements] == [
        (0, "torch-cuda", "0", "cuda:0"), (1, "torch-cuda", "1", "cuda:1")]


def test_more_workers_than_gpus_share_them_round_robin():
    assert [(p.index, p.gpu) for p in plan_workers("torch-cuda", 3, ["0"])] == [(0, "0"), (1, "0"), (2, "0")]
    assert [p.gpu for p in plan_workers("tensorrt", 3, ["4", "7"])] == ["4", "7", "4"]
    assert [p.ordinal for p in plan_workers("tensorrt", 3, ["4", "7"])] == [0, 1, 0]  # as an MPS server numbers them


def test_workers_per_gpu_feed_each_gpu_equally():
    assert [p.gpu for p in plan_workers("torch-cuda", 0, ["0", "1"], per_gpu=2)] == ["0", "1", "0", "1"]
    assert [p.gpu for p in plan_workers("onnxruntime", 0, ["0", "1"], per_gpu=2)] == [None]  # CPU: one
    assert [p.gpu for p in plan_workers("onnxruntime", 0, ["0"], per_gpu=0)] == [None]


def test_automatic_workers_per_gpu_follow_the_cpus_per_gpu():
    assert auto_per_gpu(1, cpus=16) == 4 and auto_per_gpu(1, cpus=64) == 4   # an H200 host: 4, never more
    assert auto_per_gpu(2, cpus=16) == 2 and auto_per_gpu(1, cpus=8) == 2
    assert auto_per_gpu(8, cpus=16) == 1 and auto_per_gpu(1, cpus=2) == 1    # at least one


def test_explicit_runtime_is_kept():
    for runtime in ("onnxruntime", "torch-cuda", "tensorrt", "null"):
        assert resolve_runtime(runtime, ["0"]) == runtime


@pytest.mark.parametrize("listed, gpus", [
    ("2,3", ["2", "3"]),
    (" 2 , 3 ", ["2", "3"]),
    ("", []),
    ("-1", []),
    ("GPU-5c9e1f3a", ["GPU-5c9e1f3a"]),
])
def test_visible_gpus_follow_cuda_visible_devices(listed, gpus):
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": listed}) == gpus


def test_null_runtime_answers_zeros_of_the_right_shape(start_server):
    server = start_server(settings=("engines.runtime=null",), frontends=1)
    with server.client() as client:
        result = client.infer(MODEL, unique("null engine"))
        models = {m.name: m for m in client.models()}
    assert result.source == "MISS"
    embedding = result.outputs["embedding"]
    assert embedding.shape == (384,) and embedding.dtype == np.float32
    assert not embedding.any()
    assert [(e.runtime, e.device) for e in models[MODEL].engines] == [("null", "cpu")]
    assert {e.runtime for m in models.values() for e in m.engines} == {"null"}  # every model, every version


def test_a_private_mps_daemon_is_wanted_only_where_workers_share_a_gpu(monkeypatch, tmp_path):
    monkeypatch.delenv(mps.PIPE_ENV, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no control program
    assert not mps.wanted("auto", True)          # auto: where installed only
    assert mps.wanted("mps", True)               # required: the start then says it is missing
    control = tmp_path / mps.CONTROL
    control.write_text("#!/bin/sh\n")
    control.chmod(0o755)
    assert mps.wanted("auto", True)
    assert not mps.wanted("auto", False)         # one worker per GPU: nothing to share
    assert not mps.wanted("timeslice", True)
    monkeypatch.setenv(mps.PIPE_ENV, "/run/operators-mps")
    assert not mps.wanted("auto", True) and not mps.wanted("mps", True)  # an operator's daemon is used


def test_mps_required_without_its_control_program_is_refused_with_the_reason(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(mps.MpsUnavailable, match="nvidia-cuda-mps-control is not installed"):
        mps.MpsDaemon(tmp_path).start()


def test_the_mps_daemons_launch_prefix_ends_it_with_the_supervisor_killed_with_9(tmp_path):
    prefix = mps._ended_with_parent()
    if not prefix:
        pytest.skip("needs util-linux setpriv with --pdeathsig (the daemon then outlives a killed supervisor)")
    pid_file = tmp_path / "child.pid"
    parent = subprocess.Popen([sys.executable, "-c", (
        "import subprocess, sys; child = subprocess.Popen(sys.argv[1:] + ['sleep', '60']); "
        f"open({str(pid_file)!r}, 'w').write(str(child.pid)); child.wait()"), *prefix])
    give_up = time.monotonic() + 10
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < give_up, "the child never started"
        time.sleep(0.02)
    child = int(pid_file.read_text())
    # setpriv sets the signal and then execs the command: a parent killed before that (a busy machine)
    # would leave the child without it, which is the launch's own window, not what this test is about.
    while Path(f"/proc/{child}/comm").read_text().strip() != "sleep":
        assert time.monotonic() < give_up, "the child never reached its command"
        time.sleep(0.02)
    assert running(child)
    parent.kill()  # SIGKILL: no cleanup of its own runs
    parent.wait()
    while running(child):
        assert time.monotonic() < give_up + 5, "the child outlived its parent"
        time.sleep(0.02)
