"""What the benchmarks measure processes with: a server's processes by role, their CPU seconds over a
call, a GPU busy-fraction sampler, py-spy profiles, and waiting for the writers to catch up."""

from __future__ import annotations

import os
import statistics
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable, TypeVar

from infercache.v1 import infercache_pb2 as pb
from harness.servers import ServerProcess

T = TypeVar("T")


def gpu_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def _task_children(pid: int) -> list[int]:
    """The children of every thread of `pid` (a worker starts its writer processes from a thread, and
    /proc/<pid>/task/<pid>/children lists the main thread's only)."""
    kids = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return []
    for task in tasks:
        try:
            kids += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            pass
    return kids


def server_roles(server: ServerProcess, workers: set[int] | None = None) -> dict[int, str]:
    """pid -> role of each live process of the server: supervisor, frontend, worker (`workers`: their
    pids, asked of the server when not given), writer (a worker's store writer), or other (the MPS
    control daemon and its server, multiprocessing's resource tracker)."""
    if workers is None:
        workers = {w.pid for w in server.stats().workers}
    roles = {server.proc.pid: "supervisor"}
    pending = [server.proc.pid]
    while pending:
        parent = pending.pop()
        for pid in _task_children(parent):
            if pid in workers:
                roles[pid] = "worker"
            elif roles[parent] == "worker":
                roles[pid] = "writer"
            elif roles[parent] == "supervisor" and _runs_spawned_python(pid):
                roles[pid] = "frontend"
            else:
                roles[pid] = "other"
            pending.append(pid)
    return roles


def _runs_spawned_python(pid: int) -> bool:
    try:
        return b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def cpu_seconds(pid: int) -> float:
    """CPU seconds (user and system) process `pid` has used; 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_during(pids: list[int], call: Callable[[], T]) -> tuple[T, float]:
    """call()'s result, and the CPU seconds the processes `pids` used while it ran."""
    before = sum(cpu_seconds(pid) for pid in pids)
    result = call()
    return result, sum(cpu_seconds(pid) for pid in pids) - before


def frontend_pids(server: ServerProcess) -> list[int]:
    return [pid for pid, role in server_roles(server).items() if role == "frontend"]


class GpuSampler:
    """nvidia-smi's utilization.gpu of every GPU every 100 ms while a run lasts (None without nvidia-smi),
    each sample with the time.perf_counter() it was read at."""

    def __init__(self) -> None:
        self.samples: dict[str, list[tuple[float, float]]] = {}
        try:
            self.proc = subprocess.Popen(["nvidia-smi", "--query-gpu=index,utilization.gpu",
                                          "--format=csv,noheader,nounits", "-lms", "100"],
                                         stdout=subprocess.PIPE, text=True)
        except OSError:
            self.proc = None
            return
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                index, busy = (part.strip() for part in line.split(","))
                self.samples.setdefault(index, []).append((time.perf_counter(), float(busy)))
            except ValueError:
                pass

    def stop(self, between: tuple[float, float] | None = None) -> dict[str, float]:
        """Mean busy percent per GPU index (empty without nvidia-smi): of the samples read `between` two
        perf_counter() times, else of the whole run but its edges."""
        if self.proc is None:
            return {}
        self.proc.terminate()
        self.proc.wait(5)
        means = {}
        for index, samples in self.samples.items():
            if between is not None:
                kept = [busy for at, busy in samples if between[0] <= at <= between[1]]
            else:
                kept = [busy for _, busy in samples[2:-2]]  # drop the edges of the run
            kept = kept or [busy for _, busy in samples]
            means[index] = round(statistics.mean(kept), 1)
        return means


def _py_spy() -> str | None:
    import shutil

    return shutil.which("py-spy") or next((str(p) for p in (Path("/tmp/site/bin/py-spy"),) if p.is_file()), None)


def _profile(pid: int, seconds: float) -> subprocess.Popen | None:
    """py-spy samples of the threads holding the GIL (--gil): where the process's Python time goes."""
    spy = _py_spy()
    if spy is None:
        return None
    out = Path(f"/tmp/py-spy-{pid}-{time.monotonic_ns()}.txt")
    proc = subprocess.Popen([spy, "record", "--gil", "--nonblocking", "-r", "200", "-p", str(pid), "-d",
                             str(max(1, int(seconds))), "-f", "raw", "-o", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    proc.out = out
    return proc


def _profile_summary(proc: subprocess.Popen | None, top: int = 20) -> dict | None:
    """Share of GIL-holding samples per function (own time) and per server function (inclusive)."""
    if proc is None:
        return None
    proc.wait(60)
    own, inclusive, total = {}, {}, 0
    try:
        lines = proc.out.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        stack, _, count = line.rpartition(" ")
        frames, n = stack.split(";"), int(count)
        total += n
        own[frames[-1]] = own.get(frames[-1], 0) + n
        for frame in {f for f in frames if "server/" in f or "cachestore/" in f}:
            inclusive[frame] = inclusive.get(frame, 0) + n
    share = lambda table: {k: round(100 * v / total, 1) for k, v in sorted(table.items(), key=lambda kv: -kv[1])[:top]}  # noqa: E731
    return {"samples": total, "own_percent": share(own), "inclusive_percent": share(inclusive)} if total else None


def measured(server: ServerProcess, model: str, fn, *, profile: bool | str = False) -> dict:
    """Runs fn() (a load run) and adds what the server's processes did meanwhile: CPU seconds per role,
    GPU busy percent, the mean batch the worker formed for `model`, and with `profile` (True: a worker,
    or "frontend") where that process's Python time went (py-spy, where installed)."""
    stats = server.stats()
    worker_pids = {w.pid for w in stats.workers}
    roles = server_roles(server, worker_pids)
    cpu_before = {pid: cpu_seconds(pid) for pid in roles}
    counters_before = _batch_counters(stats, model)
    gpu = GpuSampler()
    profiled = next(pid for pid, role in roles.items() if role == "frontend") if profile == "frontend" \
        else next(iter(worker_pids))
    spy = _profile(profiled, 4) if profile else None
    started = time.perf_counter()
    result = fn()
    wall = time.perf_counter() - started
    busy = gpu.stop()
    counters_after = _batch_counters(server.stats(), model)
    cpu: dict[str, float] = {}
    busiest: dict[str, float] = {}
    for pid, role in roles.items():
        used = cpu_seconds(pid) - cpu_before[pid]
        cpu[role] = cpu.get(role, 0.0) + used
        busiest[role] = max(busiest.get(role, 0.0), used)
    batches = counters_after[0] - counters_before[0]
    messages = counters_after[4] - counters_before[4]
    summary = result.summary()
    summary.update({
        "cpu_cores_busy": {role: round(seconds / wall, 2) for role, seconds in cpu.items()},
        "busiest_process_cores": {role: round(seconds / wall, 2) for role, seconds in busiest.items()},
        "gpu_busy_percent": round(statistics.mean(busy.values()), 1) if busy else None,
        "gpu_busy_percent_per_gpu": busy,
        "mean_batch": round((counters_after[1] - counters_before[1]) / batches, 1) if batches else None,
        "padded_rows_percent": _padding(counters_before, counters_after),
        "items_per_frame": round((counters_after[5] - counters_before[5]) / messages, 1) if messages else None,
    })
    if profile:
        summary["worker_profile" if profile is True else "profile"] = _profile_summary(spy)
    return summary


def writers_caught_up(server: ServerProcess, timeout: float = 120.0) -> float:
    """Seconds until every worker's writer has handled what it was sent (its `backlog` gauge is 0), then
    one more second for the last commit to be seen: the hits measured next are then hits, not answers
    from flights whose entries wait behind the misses' writes."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if all(w.counters.get("writer.backlog", 0) == 0 for w in server.stats().workers):
            break
        time.sleep(0.2)
    waited = time.monotonic() - started
    time.sleep(1.0)
    return round(waited, 1)


def _batch_counters(stats: pb.GetStatsResponse, model: str) -> tuple[int, ...]:
    """(batches, batched requests, engine rows, padded rows, stream messages, stream items) over workers."""
    names = (f"batcher.{model}.1.batches", f"batcher.{model}.1.batched_requests", f"engine.{model}.1.rows",
             f"engine.{model}.1.padded_rows", "worker.frames", "worker.frame_items")
    return tuple(sum(w.counters.get(name, 0) for w in stats.workers) for name in names)


def _padding(before: tuple, after: tuple) -> float | None:
    rows, padded = after[2] - before[2], after[3] - before[3]
    return round(100 * padded / rows, 1) if rows else None
