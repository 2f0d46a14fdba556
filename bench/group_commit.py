"""Group commit (`make bench ARGS="--sections commit"`: bench/results/group-commit-<machine>.json, or
`python -m bench.group_commit`): what the writer process (server/worker/store/writer.py) spends per put at the
miss rates of a CPU host, by how long a put may wait for others to share its transaction
(`cache.group_commit_ms`).

A real writer process on a real LMDB store (fsync on), fed from an event loop as a worker feeds it: a
frame of `per_frame` puts (one engine batch's answers, 1.6 KB each, random keys, with a semantic row)
every per_frame / rate seconds. Each window is run in alternating rounds, each on a fresh store filled
with the same number of entries beforehand, and reports the writer process's CPU per put (user and
system time: its own syscalls, fsync's included; not the file system's journal thread), its transactions
per second, and how long a put waited to be handled: until then a fresh answer is not in L1 (the worker
answers its repeats from memory) and its semantic row is not searchable.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.probes import cpu_seconds
from bench.sections import Run
from cachestore import records
from cachestore.env import StoreSettings
from cachestore.keys import NS_ID_BYTES, Namespace, entry_key
from cachestore.results import now_us
from cachestore.semantic_log import SemanticEntry
from server.worker.store.writer import WriterProcess

RECORD_BYTES = 1600
PREFILL = 20_000  # entries in the store before a run (a store in use, not an empty one)
NS = Namespace("bench", "minilm", "1")


async def _run(path: Path, window_s: float, rate: float, per_frame: int, seconds: float) -> dict:
    writer = await WriterProcess.start(StoreSettings(path, 4 << 30, 3 << 30, sync=True), batch_max=512,
                                       sweep_interval_s=30.0, max_ttl_s=0, what="result store",
                                       log_level="WARNING", role="bench", group_commit_s=window_s)
    payload, embedding = os.urandom(RECORD_BYTES), np.random.default_rng(0).random(384, dtype=np.float32)
    count = iter(range(10**9))

    def put(on_done=None) -> None:
        key = entry_key(NS.ns_id, f"{next(count)} {time.perf_counter_ns()}")
        writer.put(key, NS, records.Record(now_us(), 0, payload), on_done=on_done,
                   semantic=SemanticEntry(key[:NS_ID_BYTES], b"", embedding))

    try:
        for _ in range(PREFILL):
            put()
        await asyncio.wrap_future(writer.flush())
        cpu, txns, puts = cpu_seconds(writer.process.pid), writer.counters["write_txns"], writer.counters["writes"]
        waits: list[float] = []
        began = time.perf_counter()
        frames = int(seconds * rate / per_frame)
        for n in range(frames):
            sent = time.perf_counter()
            for _ in range(per_frame):
                put(lambda sent=sent: waits.append(time.perf_counter() - sent))
            await asyncio.sleep(max(0.0, began + (n + 1) * per_frame / rate - time.perf_counter()))
        await asyncio.wrap_future(writer.flush())
        wall = time.perf_counter() - began
        await asyncio.sleep(0.1)  # the counters come with the process's next frame
        done = writer.counters["writes"] - puts
        row = {"window_ms": round(window_s * 1000), "puts_per_s": round(done / wall),
               "writer_cpu_us_per_put": round((cpu_seconds(writer.process.pid) - cpu) / done * 1e6, 1),
               "txns_per_s": round((writer.counters["write_txns"] - txns) / wall, 1),
               "handled_after_ms_p50": round(1000 * statistics.median(waits), 1),
               "handled_after_ms_p99": round(1000 * float(np.percentile(waits, 99)), 1)}
    finally:
        await writer.close()
    return row


def bench_group_commit(workdir: Path, rounds: int, seconds: float, windows_ms=(10, 50),
                       rates=((500, 8), (500, 32), (4000, 16))) -> dict:
    """Per (rate, puts per frame): each window's rows (alternating order by round) and the medians. A
    worker sends one frame per event-loop iteration, about one per engine batch: 8 puts a frame is a
    CPU worker at a few callers, 32 one under a full queue (frames every 64 ms at 500 puts/s)."""
    out = {}
    for rate, per_frame in rates:
        rows: dict[int, list[dict]] = {w: [] for w in windows_ms}
        for r in range(rounds):
            for window in windows_ms if r % 2 == 0 else tuple(reversed(windows_ms)):
                path = Path(tempfile.mkdtemp(prefix=f"commit-{window}-", dir=workdir))
                try:
                    rows[window].append(asyncio.run(_run(path, window / 1000, rate, per_frame, seconds)))
                finally:
                    shutil.rmtree(path, ignore_errors=True)
                print(f"  {rate} puts/s, frames of {per_frame}: {rows[window][-1]}", flush=True)
        out[f"{rate}_per_s_frames_of_{per_frame}"] = {
            "per_frame": per_frame,
            "rounds": rows,
            "median": {w: {k: statistics.median(row[k] for row in rs) for k in rs[0] if k != "window_ms"}
                       for w, rs in rows.items()},
        }
    return out


def print_group_commit(result: dict) -> None:
    print("\n## Group commit (writer process, fsync on)\n")
    print("| arrival rate | window | writer CPU per put | transactions/s | put handled after (p50 / p99) |")
    print("| --- | --- | --- | --- | --- |")
    for name, run in result.items():
        for window, m in run["median"].items():
            print(f"| {name.split('_')[0]} puts/s in frames of {run['per_frame']} | {window} ms | "
                  f"{m['writer_cpu_us_per_put']} us | {m['txns_per_s']} | "
                  f"{m['handled_after_ms_p50']} / {m['handled_after_ms_p99']} ms |")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.group_commit")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="the file system to measure (default: the temp dir)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()
    result = bench_group_commit(Path(args.dir), args.rounds, args.seconds)
    print_group_commit(result)
    print(json.dumps(result))


if __name__ == "__main__":
    main()


def section(run: Run) -> None:
    print("benchmarking group commit (the writer process at paced put rates) ...", flush=True)
    (run.workdir / "commit").mkdir()
    run.report["group_commit"] = bench_group_commit(run.workdir / "commit", run.rounds,
                                                    0.5 if run.dry else 2.0 if run.quick else 5.0)
    print_group_commit(run.report["group_commit"])
