"""Worker capacity (`--sections worker`): items sent straight to one inference worker's item socket (no
frontend, no gRPC), null engine unless told otherwise, so what is measured is the worker itself.

Frames of 1 and of 32 items, 1,024 items kept in flight by one client that sends prebuilt frames and
only counts answers. Each shape runs twice in the same server: every item stored (each answer written
behind, the normal case), and none stored: the worker with no write at all, the baseline its write path
is measured against. Items/s, the worker's CPU per item, and its writer process's CPU. Where the machine
has the cores, the worker runs alone on CPU 0 (the client and the writer process elsewhere).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import subprocess
import time
from pathlib import Path

import numpy as np

from bench.fixtures import make_gpu_models
from bench.probes import _task_children, cpu_seconds
from bench.sections import Run
from cachestore.keys import entry_key, namespace_id
from harness.servers import ServerProcess
from infercache.v1 import worker_pb2
from server.shared.framing import HEADER, complete_frames

IN_FLIGHT = 1024


def _writer_processes(worker: int) -> list[int]:
    """The worker's writer processes (started from one of its threads)."""
    return _task_children(worker)


def _settle(pids: list[int], timeout: float = 60.0) -> None:
    """Waits until the writer processes are idle (done with the last run's writes)."""
    give_up = time.monotonic() + timeout
    while time.monotonic() < give_up:
        before = sum(cpu_seconds(p) for p in pids)
        time.sleep(0.5)
        if sum(cpu_seconds(p) for p in pids) - before < 0.025:
            return


def _frames(count: int, per_frame: int, store: bool, tag: str) -> list[tuple[bytes, int]]:
    ns = namespace_id("", "minilm", "1")
    ids = np.array([101, *range(2000, 2012), 102], dtype="<i4").tobytes()  # 14 tokens: a Banking77-length text
    frames = []
    for start in range(0, count, per_frame):
        batch = worker_pb2.ComputeBatch()
        for i in range(start, start + per_frame):
            batch.items.add(id=i + 1, model="minilm", version="1", key=entry_key(ns, f"{tag} {i}"), ids=ids,
                            store=store, cached_ok=True, timeout_s=60.0)
        payload = batch.SerializeToString()
        frames.append((len(payload).to_bytes(HEADER, "little") + payload, per_frame))
    return frames


async def _pump(path: str, frames, seconds: float) -> float:
    """Items answered per second, after a 1 s warm-up, keeping IN_FLIGHT items outstanding."""
    loop = asyncio.get_running_loop()
    state = {"answered": 0, "outstanding": 0, "refused": None}
    buffer = bytearray()
    arrived = asyncio.Event()

    class Reader(asyncio.Protocol):
        def data_received(self, data: bytes) -> None:
            nonlocal buffer
            buffer += data
            for frame in complete_frames(buffer):
                results = worker_pb2.ResultBatch.FromString(frame).results
                state["refused"] = state["refused"] or next((r.error for r in results if r.code), None)
                state["answered"] += len(results)
                state["outstanding"] -= len(results)
            arrived.set()

    transport, _ = await loop.create_unix_connection(Reader, path)
    frames = iter(frames)
    began = time.perf_counter()
    mark = None
    while time.perf_counter() < began + 1.0 + seconds:
        if mark is None and time.perf_counter() >= began + 1.0:
            mark = (state["answered"], time.perf_counter())
        while state["outstanding"] < IN_FLIGHT:
            frame, items = next(frames)
            transport.write(frame)
            state["outstanding"] += items
        arrived.clear()
        await arrived.wait()
        if state["refused"]:
            raise RuntimeError(f"worker refused an item: {state['refused']}")
    transport.close()
    return (state["answered"] - mark[0]) / (time.perf_counter() - mark[1])


def bench_worker_capacity(workdir: Path, seconds: float, runtimes: tuple[str, ...] = ("null",)) -> dict:
    """One report per runtime (the null engine; on a GPU host also torch-cuda: the worker with real
    model work)."""
    models = make_gpu_models(workdir / "models", False)
    return {runtime: _capacity(workdir / runtime, models, seconds, runtime) for runtime in runtimes}


def _capacity(workdir: Path, models: Path, seconds: float, runtime: str) -> dict:
    workdir.mkdir(parents=True)
    pinned = (os.cpu_count() or 1) >= 2
    report: dict = {"runtime": runtime, "in_flight": IN_FLIGHT, "worker_pinned_to_cpu0": pinned, "runs": {}}
    with ServerProcess(workdir, models, frontends=1,
                       settings=(f"engines.runtime={runtime}", "server.max_queue=16384")) as server:
        worker = server.worker_pid()
        writers = _writer_processes(worker)
        if pinned:
            subprocess.run(["taskset", "-a", "-p", "-c", "0", str(worker)], capture_output=True, check=True)
            others = ",".join(str(c) for c in range(1, os.cpu_count()))
            for pid in writers:
                subprocess.run(["taskset", "-a", "-p", "-c", others, str(pid)], capture_output=True, check=True)
            os.sched_setaffinity(0, set(range(1, os.cpu_count())))
        path = str(workdir / "run" / "worker-0.items")
        # Enough distinct items for the fastest run seen (about 70k items/s) with room to spare.
        count = int(100_000 * (seconds + 1.5))
        try:
            for per_frame, store in itertools.product((1, 32), (False, True)):
                frames = _frames(count, per_frame, store, f"{per_frame}-{store}-{time.time()}")
                _settle(writers)
                cpu = {pid: cpu_seconds(pid) for pid in (worker, *writers)}
                started = time.perf_counter()
                rate = asyncio.run(_pump(path, frames, seconds))
                elapsed = time.perf_counter() - started
                worker_cores = (cpu_seconds(worker) - cpu[worker]) / elapsed
                name = f"{per_frame}_per_frame_{'stored' if store else 'not_stored'}"
                report["runs"][name] = row = {
                    "items_per_s": round(rate), "worker_cores": round(worker_cores, 2),
                    "worker_us_per_item": round(worker_cores / rate * 1e6, 1),
                    "writer_process_cores": round(sum(cpu_seconds(p) - cpu[p] for p in writers) / elapsed, 2)}
                print(f"  {name}: {row}", flush=True)
        finally:
            if pinned:
                os.sched_setaffinity(0, set(range(os.cpu_count())))
    runs = report["runs"]
    report["stored_vs_not_stored"] = {
        f"{n}_per_frame": round(runs[f"{n}_per_frame_stored"]["items_per_s"] / runs[f"{n}_per_frame_not_stored"]["items_per_s"], 3)
        for n in (1, 32)}
    return report


def print_worker_capacity(reports: dict) -> None:
    for report in reports.values():
        print(f"\nWorker capacity ({report['runtime']} engine, items straight to the worker, {report['in_flight']} in flight)")
        for name, row in report["runs"].items():
            print(f"  {name:<26} {row['items_per_s']:>8} items/s  worker {row['worker_cores']} cores "
                  f"({row['worker_us_per_item']} us/item)  writer process {row['writer_process_cores']} cores")
        print(f"  stored / not stored: {report['stored_vs_not_stored']}")


def section(run: Run) -> None:
    from bench.probes import gpu_available

    print("benchmarking one worker's capacity (items straight to its socket) ...", flush=True)
    seconds = 0.5 if run.dry else 2.0 if run.quick else 5.0
    run.report["worker_capacity"] = bench_worker_capacity(run.workdir / "worker", seconds,
                                                          ("null", "torch-cuda") if gpu_available() else ("null",))
    print_worker_capacity(run.report["worker_capacity"])
