"""The host's store write capacity: `python -m bench.write_capacity [--dir DIR]`.

Several processes, as several workers' writers do, each commit puts of MiniLM-sized records (1.6 KB)
through its own WriteBehind on one LMDB store (one write lock), at each write-batch size; and the
latency of one fsync on the store's file system, which every commit pays while it holds the lock.
What it answers: how many misses per second the host can cache before the writers fall behind and drop.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

RECORD_BYTES = 1600


def _writer(path: str, puts: int, batch: int, sync: bool, start, out) -> None:
    from cachestore.env import Store, StoreSettings
    from cachestore.keys import Namespace
    from cachestore.records import Record
    from cachestore.results import now_us
    from cachestore.writer import WriteBehind

    store = Store(StoreSettings(Path(path), 16 << 30, 12 << 30, sync), readonly=False)
    writer = WriteBehind(store, batch_max=batch, threaded=False)
    ns, payload, tag = Namespace("bench", "minilm", "1"), os.urandom(RECORD_BYTES), os.getpid().to_bytes(4, "big")
    start.wait(120)
    began = time.perf_counter()
    for i in range(puts):
        writer.put(ns.ns_id + tag + i.to_bytes(12, "big"), ns, Record(now_us(), 0, payload))
        if i % batch == batch - 1:
            writer.drain()
    writer.drain()
    out.put((time.perf_counter() - began, writer.counters["write_txns"]))
    store.close()


def capacity(directory: Path, processes: int, puts: int, batch: int, sync: bool = True) -> dict:
    ctx = multiprocessing.get_context("spawn")
    start, out = ctx.Barrier(processes + 1), ctx.Queue()  # the writers, each with its store open, and this
    path = Path(tempfile.mkdtemp(prefix="write-capacity-", dir=directory))
    procs = [ctx.Process(target=_writer, args=(str(path), puts, batch, sync, start, out)) for _ in range(processes)]
    try:
        for proc in procs:
            proc.start()
        start.wait(120)
        began = time.perf_counter()
        parts = [out.get(timeout=600) for _ in procs]
        wall = time.perf_counter() - began
        for proc in procs:
            proc.join(30)
    finally:
        shutil.rmtree(path, ignore_errors=True)
    return {"processes": processes, "puts": processes * puts, "batch": batch, "sync": sync,
            "puts_per_s": round(processes * puts / wall), "txns": sum(p[1] for p in parts)}


def fsync_latency(directory: Path, samples: int = 50) -> dict:
    """ms for one 4 KB write + fsync on `directory`'s file system."""
    times = []
    with tempfile.NamedTemporaryFile(dir=directory) as f:
        for _ in range(samples):
            f.write(os.urandom(4096))
            began = time.perf_counter()
            os.fsync(f.fileno())
            times.append((time.perf_counter() - began) * 1000)
    return {"p50_ms": round(statistics.median(times), 3), "max_ms": round(max(times), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.write_capacity")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="the file system to measure (default: the temp dir)")
    parser.add_argument("--processes", default="1,4")
    parser.add_argument("--puts", type=int, default=20_000, help="per process")
    parser.add_argument("--batch", default="512,4096")
    args = parser.parse_args()
    directory = Path(args.dir)
    report = {"dir": str(directory), "fsync": fsync_latency(directory), "runs": []}
    print(f"fsync on {directory}: {report['fsync']}", flush=True)
    for processes in (int(p) for p in args.processes.split(",")):
        for batch in (int(b) for b in args.batch.split(",")):
            row = capacity(directory, processes, args.puts, batch)
            report["runs"].append(row)
            print(json.dumps(row), flush=True)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
