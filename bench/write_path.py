"""Write path (`make bench ARGS="--sections write"`: bench/results/write-<machine>.json): how many answers
per second the store's writer process commits when misses come faster than it can take them, against
the ceiling of LMDB itself on the same file system, in the same run.

1. Ceiling: py-lmdb in one process, nothing else, putting the same records (1.6 KB answers in the
   store's record form, random keys) in transactions of 4,096, flushed to disk as the server's setting
   does (every `cache.sync_interval_ms`), and flushed per commit (the setting 0).
2. The writer process (server/worker/store/writer.py, a real child process on a real LMDB store), fed from an
   event loop as a worker feeds it, faster than it commits: each put a MiniLM answer with its semantic
   row; the rate is puts committed over the time until the last one was, and the process's CPU per put.
   Flushed per commit (`cache.sync_interval_ms: 0`) against the default interval, rounds alternating
   the order; with `--write-baseline REF`, also the writer of that commit (checked out beside this tree,
   its own defaults), in the same rounds.
3. Hits beside it: L1 reads (a reader process, as a frontend reads) of entries stored before, p50 and
   p99 while the writer runs flat out against the same reads with the writer idle.

Power loss: commits since the last flush (at most the interval and one commit) can be lost; a process
killed with -9 loses nothing committed (the pages are in the kernel's page cache), which the writer
tests check.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.sections import Run

RECORD_BYTES = 1600
EMBEDDING_DIMS = 384
CEILING_TXN = 4096
PREFILL = 20_000  # entries stored before a run: the reads' targets, and a store in use, not an empty one


def _ceiling(path: Path, puts: int, interval_s: float) -> float:
    """Puts/s of bare py-lmdb: records in transactions of CEILING_TXN, flushed every interval_s (0: per
    commit, as sync=True does)."""
    import lmdb

    from cachestore import records

    env = lmdb.open(str(path), map_size=8 << 30, sync=interval_s == 0, readahead=False, max_dbs=4)
    db = env.open_db(b"results")
    payload = records.encode(records.Record(int(time.time() * 1e6), 0, os.urandom(RECORD_BYTES)))
    keys = [os.urandom(32) for _ in range(puts)]
    began = flushed = time.perf_counter()
    for start in range(0, puts, CEILING_TXN):
        with env.begin(write=True, db=db) as txn:
            for key in keys[start:start + CEILING_TXN]:
                txn.put(key, payload)
        if interval_s and time.perf_counter() - flushed >= interval_s:
            env.sync(True)
            flushed = time.perf_counter()
    if interval_s:
        env.sync(True)
    rate = puts / (time.perf_counter() - began)
    env.close()
    return rate


def _reader(path: str, keys: list[bytes], seconds: float, start, out) -> None:
    """In a child process: L1 reads of `keys` for `seconds` after `start`; (p50, p99) in microseconds."""
    from cachestore.env import Store, StoreSettings
    from cachestore.results import ResultCache, now_us

    store = Store(StoreSettings(Path(path), 8 << 30, 6 << 30), readonly=True)
    cache = ResultCache(store)
    start.wait(120)
    times, ends, n = [], time.perf_counter() + seconds, 0
    while time.perf_counter() < ends:
        key = keys[n % len(keys)]
        n += 1
        began = time.perf_counter_ns()
        found = cache.get(key, now_us())
        times.append(time.perf_counter_ns() - began)
        assert found is not None
        time.sleep(0.0005)  # a read every half millisecond: a frontend's hits, not a read loop's
    store.close()
    out.put((float(np.percentile(times, 50)) / 1000, float(np.percentile(times, 99)) / 1000, len(times)))


async def _writer_run(path: Path, interval_s: float, puts: int, read_s: float) -> dict:
    from cachestore import records
    from cachestore.env import StoreSettings
    from cachestore.keys import NS_ID_BYTES, Namespace, entry_key
    from cachestore.results import now_us
    from cachestore.semantic_log import SemanticEntry
    from server.worker.store.writer import WriterProcess

    ns = Namespace("bench", "minilm", "1")
    # (a baseline's StoreSettings may predate the flush interval: it is named only where it is set)
    interval = {"sync_interval_s": interval_s} if interval_s else {}
    writer = await WriterProcess.start(StoreSettings(path, 8 << 30, 6 << 30, sync=True, **interval),
                                       batch_max=512, sweep_interval_s=30.0, max_ttl_s=0, what="result store",
                                       log_level="WARNING", role="bench", group_commit_s=0.05,
                                       max_backlog=10 * puts)
    payload, embedding = os.urandom(RECORD_BYTES), np.random.default_rng(0).random(EMBEDDING_DIMS, dtype=np.float32)
    count = iter(range(10**9))

    def put() -> bytes:
        key = entry_key(ns.ns_id, f"{next(count)} {time.perf_counter_ns()}")
        writer.put(key, ns, records.Record(now_us(), 0, payload), semantic=SemanticEntry(key[:NS_ID_BYTES], "", embedding))
        return key

    try:
        stored = [put() for _ in range(PREFILL)]
        await asyncio.wrap_future(writer.flush())
        read_keys = stored[::7]
        idle = await asyncio.to_thread(_Reads(path, read_keys, read_s).result)
        before = writer.counters["writes"]
        reads = await asyncio.to_thread(_Reads, path, read_keys, read_s)  # reading from here on
        began, cpu = time.perf_counter(), _cpu_s(writer.process.pid)
        for n in range(puts):
            put()
            if n % 256 == 255:
                await asyncio.sleep(0)  # frames go out as a worker's do, between its batches
        await asyncio.wrap_future(writer.flush())
        wall, cpu = time.perf_counter() - began, _cpu_s(writer.process.pid) - cpu
        busy = await asyncio.to_thread(reads.result)
        await asyncio.sleep(1.2)  # the counters come with the process's next frame
        done = writer.counters["writes"] - before
        return {"sync_interval_ms": round(interval_s * 1000), "puts": done,
                "puts_per_s": round(done / wall), "writer_cpu_us_per_put": round(cpu / done * 1e6, 1),
                "write_txns": writer.counters["write_txns"],
                "disk_flushes": writer.counters["disk_flushes"], "dropped": writer.counters["dropped_backlog"],
                "hit_us_idle": {"p50": round(idle[0], 1), "p99": round(idle[1], 1)},
                "hit_us_writing": {"p50": round(busy[0], 1), "p99": round(busy[1], 1)}, "reads_writing": busy[2]}
    finally:
        await writer.close()


def _cpu_s(pid: int) -> float:
    """User and system CPU seconds of a process (from /proc: no import a baseline might lack)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _baseline_tree(workdir: Path, ref: str) -> Path:
    """The repository at `ref`, checked out beside this one (detached), with its generated stubs."""
    repo = Path(__file__).resolve().parent.parent
    tree = workdir / f"baseline-{ref}"
    subprocess.run(["git", "-C", str(repo), "worktree", "add", "--detach", "--force", str(tree), ref], check=True,
                   capture_output=True)
    protos = sorted(str(p.relative_to(tree / "protos")) for p in (tree / "protos").rglob("*.proto"))
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-Iprotos", "--python_out=.", "--grpc_python_out=.",
                    *protos], cwd=tree, check=True)
    return tree


def _baseline_run(tree: Path, path: Path, puts: int, read_s: float) -> dict:
    """_writer_run of the baseline's code: this file run in a process whose imports come from `tree`."""
    done = subprocess.run([sys.executable, __file__, str(path), str(puts), str(read_s)], cwd=tree, check=True,
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(tree)})
    return json.loads(done.stdout.strip().splitlines()[-1])


class _Reads:
    """A reader process (_reader) started, and reading once it is built."""

    def __init__(self, path: Path, keys: list[bytes], seconds: float) -> None:
        ctx = multiprocessing.get_context("spawn")
        start, self._out = ctx.Barrier(2), ctx.Queue()
        self._process = ctx.Process(target=_reader, args=(str(path), keys, seconds, start, self._out))
        self._process.start()
        start.wait(120)

    def result(self) -> tuple[float, float, int]:
        """(p50, p99 in microseconds, reads), once its seconds are over."""
        got = self._out.get(timeout=600)
        self._process.join(30)
        return got


def bench_write_path(workdir: Path, rounds: int, quick: bool, interval_ms: int | None = None,
                     puts: int | None = None, read_s: float | None = None, baseline: str = "") -> dict:
    """interval_ms: the setting measured against a flush per commit (default: the server's default);
    puts, read_s: a run's puts and reads' seconds (defaults by `quick`; the tests' dry run sets them);
    baseline: a commit whose writer runs beside these (its own defaults), or ""."""
    from server.config import CacheSection

    interval = (CacheSection.sync_interval_ms if interval_ms is None else interval_ms) / 1000
    puts = puts or (20_000 if quick else 60_000)
    read_s = read_s or (3.0 if quick else 6.0)
    names = ("per_commit", "interval") + (("baseline",) if baseline else ())
    tree = _baseline_tree(workdir, baseline) if baseline else None
    out: dict = {"record_bytes": RECORD_BYTES, "puts_per_run": puts, "sync_interval_ms": round(interval * 1000),
                 "baseline": baseline, "ceiling": {"per_commit": [], "interval": []}, "writer": {n: [] for n in names}}
    try:
        for r in range(max(1, rounds)):
            for name in names if r % 2 == 0 else tuple(reversed(names)):
                path = Path(tempfile.mkdtemp(prefix=f"write-{name}-", dir=workdir))
                try:
                    if name == "baseline":
                        row = _baseline_run(tree, path / "store", puts, read_s)
                    else:
                        seconds = 0.0 if name == "per_commit" else interval
                        out["ceiling"][name].append(round(_ceiling(path / "lmdb", puts, seconds)))
                        row = asyncio.run(_writer_run(path / "store", seconds, puts, read_s))
                    out["writer"][name].append(row)
                finally:
                    shutil.rmtree(path, ignore_errors=True)
                print(f"  {name}: writer {row['puts_per_s']} puts/s ({row['writer_cpu_us_per_put']} us CPU a put), "
                      f"hits p50 {row['hit_us_idle']['p50']} us idle, {row['hit_us_writing']['p50']} us writing",
                      flush=True)
    finally:
        if tree is not None:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=Path(__file__).resolve().parent,
                           capture_output=True)
    median = {}
    for name in names:
        rows = out["writer"][name]
        median[name] = {"writer_puts_per_s": statistics.median(r["puts_per_s"] for r in rows),
                        "writer_cpu_us_per_put": statistics.median(r["writer_cpu_us_per_put"] for r in rows),
                        "hit_p50_us_idle": statistics.median(r["hit_us_idle"]["p50"] for r in rows),
                        "hit_p50_us_writing": statistics.median(r["hit_us_writing"]["p50"] for r in rows),
                        "hit_p99_us_idle": statistics.median(r["hit_us_idle"]["p99"] for r in rows),
                        "hit_p99_us_writing": statistics.median(r["hit_us_writing"]["p99"] for r in rows)}
        if name in out["ceiling"]:
            median[name]["ceiling_puts_per_s"] = statistics.median(out["ceiling"][name])
    out["median"] = median
    new, old = median["interval"], median["per_commit"]
    out["ratios"] = {
        "writer_interval_over_per_commit": round(new["writer_puts_per_s"] / old["writer_puts_per_s"], 2),
        "writer_over_ceiling": round(new["writer_puts_per_s"] / new["ceiling_puts_per_s"], 3),
        "hit_p50_writing_over_idle": round(new["hit_p50_us_writing"] / new["hit_p50_us_idle"], 3),
    }
    if baseline:
        out["ratios"]["writer_over_baseline"] = round(new["writer_puts_per_s"] / median["baseline"]["writer_puts_per_s"], 2)
        out["ratios"]["cpu_per_put_over_baseline"] = round(
            new["writer_cpu_us_per_put"] / median["baseline"]["writer_cpu_us_per_put"], 2)
    return out


def print_write_path(result: dict) -> None:
    m, r = result["median"], result["ratios"]
    print(f"\n## Write path ({result['puts_per_run']} puts of {result['record_bytes']} B a run)\n")
    print("| writer | py-lmdb ceiling | writer process | CPU per put | hit p50 idle / writing |")
    print("| --- | --- | --- | --- | --- |")
    labels = {"per_commit": "flush per commit", "interval": f"flush every {result['sync_interval_ms']} ms",
              "baseline": f"baseline {result['baseline']}"}
    for name, row in m.items():
        ceiling = f"{row['ceiling_puts_per_s']:,.0f}/s" if "ceiling_puts_per_s" in row else ""
        print(f"| {labels[name]} | {ceiling} | {row['writer_puts_per_s']:,.0f}/s | {row['writer_cpu_us_per_put']} us | "
              f"{row['hit_p50_us_idle']} / {row['hit_p50_us_writing']} us |")
    print("\n" + "; ".join(f"{k}: {v}" for k, v in r.items()))


if __name__ == "__main__":  # a baseline's run: python bench/write_path.py STORE PUTS READ_S (imports from its tree)
    print(json.dumps(asyncio.run(_writer_run(Path(sys.argv[1]), 0.0, int(sys.argv[2]), float(sys.argv[3])))))


def section(run: Run) -> None:
    print("benchmarking the write path (the writer process flat out, against py-lmdb's ceiling) ...", flush=True)
    (run.workdir / "write").mkdir()
    run.report["write_path"] = bench_write_path(run.workdir / "write", run.rounds, run.quick,
                                                baseline=run.args.write_baseline)
    print_write_path(run.report["write_path"])
