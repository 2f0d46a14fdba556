"""Write path (`make bench ARGS="--sections write"`: bench/results/write-<machine>.json): how many answers
per second the store's writer process commits when misses come faster than it can take them, against
the ceiling of LMDB itself on the same file system, in the same run.

1. Ceiling: py-lmdb in one process, nothing else, putting the same records (1.6 KB answers in the
   store's record form, random keys) in transactions of 4,096, flushed to disk as the server's setting
   does (every `cache.sync_interval_ms`), and flushed per commit (the setting 0).
2. The writer process (server/worker/writer.py, a real child process on a real LMDB store), fed from an
   event loop as a worker feeds it, faster than it commits: each put a MiniLM answer with its semantic
   row; the rate is puts committed over the time until the last one was. Flushed per commit
   (`cache.sync_interval_ms: 0`) against the default interval, rounds alternating the order.
3. Hits beside it: L1 reads (a reader process, as a frontend reads) of entries stored before, p50 and
   p99 while the writer runs flat out against the same reads with the writer idle.

Power loss: commits since the last flush (at most the interval and one commit) can be lost; a process
killed with -9 loses nothing committed (the pages are in the kernel's page cache), which the writer
tests check.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

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
    from server.worker.writer import WriterProcess

    ns = Namespace("bench", "minilm", "1")
    writer = await WriterProcess.start(StoreSettings(path, 8 << 30, 6 << 30, sync=True, sync_interval_s=interval_s),
                                       batch_max=512, sweep_interval_s=30.0, max_ttl_s=0, what="result store",
                                       log_level="WARNING", role="bench", group_commit_s=0.05,
                                       max_backlog=10 * puts)
    payload, embedding = os.urandom(RECORD_BYTES), np.random.default_rng(0).random(EMBEDDING_DIMS, dtype=np.float32)
    count = iter(range(10**9))

    def put() -> bytes:
        key = entry_key(ns.ns_id, f"{next(count)} {time.perf_counter_ns()}")
        writer.put(key, ns, records.Record(now_us(), 0, payload), semantic=SemanticEntry(key[:NS_ID_BYTES], b"", embedding))
        return key

    try:
        stored = [put() for _ in range(PREFILL)]
        await asyncio.wrap_future(writer.flush())
        read_keys = stored[::7]
        idle = await asyncio.to_thread(_reads, path, read_keys, read_s, None)
        before = writer.counters["writes"]
        ctx = multiprocessing.get_context("spawn")
        start, out = ctx.Barrier(2), ctx.Queue()
        reader = ctx.Process(target=_reader, args=(str(path), read_keys, read_s, start, out))
        reader.start()
        await asyncio.to_thread(start.wait, 120)
        began = time.perf_counter()
        for n in range(puts):
            put()
            if n % 256 == 255:
                await asyncio.sleep(0)  # frames go out as a worker's do, between its batches
        await asyncio.wrap_future(writer.flush())
        wall = time.perf_counter() - began
        busy = await asyncio.to_thread(out.get, True, 600)
        reader.join(30)
        await asyncio.sleep(1.2)  # the counters come with the process's next frame
        done = writer.counters["writes"] - before
        return {"sync_interval_ms": round(interval_s * 1000), "puts": done,
                "puts_per_s": round(done / wall), "write_txns": writer.counters["write_txns"],
                "disk_flushes": writer.counters["disk_flushes"], "dropped": writer.counters["dropped_backlog"],
                "hit_us_idle": {"p50": round(idle[0], 1), "p99": round(idle[1], 1)},
                "hit_us_writing": {"p50": round(busy[0], 1), "p99": round(busy[1], 1)}, "reads_writing": busy[2]}
    finally:
        await writer.close()


def _reads(path: Path, keys: list[bytes], seconds: float, _) -> tuple[float, float, int]:
    ctx = multiprocessing.get_context("spawn")
    start, out = ctx.Barrier(2), ctx.Queue()
    reader = ctx.Process(target=_reader, args=(str(path), keys, seconds, start, out))
    reader.start()
    start.wait(120)
    got = out.get(timeout=600)
    reader.join(30)
    return got


def bench_write_path(workdir: Path, rounds: int, quick: bool, interval_ms: int | None = None,
                     puts: int | None = None, read_s: float | None = None) -> dict:
    """interval_ms: the setting measured against a flush per commit (default: the server's default);
    puts, read_s: a run's puts and reads' seconds (defaults by `quick`; the tests' dry run sets them)."""
    from server.config import CacheSection

    interval = (CacheSection.sync_interval_ms if interval_ms is None else interval_ms) / 1000
    puts = puts or (20_000 if quick else 60_000)
    read_s = read_s or (3.0 if quick else 6.0)
    out: dict = {"record_bytes": RECORD_BYTES, "puts_per_run": puts, "ceiling": {"per_commit": [], "interval": []},
                 "writer": {"per_commit": [], "interval": []}}
    for r in range(max(1, rounds)):
        order = ("per_commit", "interval") if r % 2 == 0 else ("interval", "per_commit")
        for name in order:
            seconds = 0.0 if name == "per_commit" else interval
            path = Path(tempfile.mkdtemp(prefix=f"write-{name}-", dir=workdir))
            try:
                out["ceiling"][name].append(round(_ceiling(path / "lmdb", puts, seconds)))
                row = asyncio.run(_writer_run(path / "store", seconds, puts, read_s))
                out["writer"][name].append(row)
            finally:
                shutil.rmtree(path, ignore_errors=True)
            print(f"  {name}: ceiling {out['ceiling'][name][-1]} puts/s; writer {row['puts_per_s']} puts/s, "
                  f"hits p50 {row['hit_us_idle']['p50']} us idle, {row['hit_us_writing']['p50']} us writing", flush=True)
    median = {}
    for name in ("per_commit", "interval"):
        rows = out["writer"][name]
        median[name] = {"ceiling_puts_per_s": statistics.median(out["ceiling"][name]),
                        "writer_puts_per_s": statistics.median(r["puts_per_s"] for r in rows),
                        "hit_p50_us_idle": statistics.median(r["hit_us_idle"]["p50"] for r in rows),
                        "hit_p50_us_writing": statistics.median(r["hit_us_writing"]["p50"] for r in rows),
                        "hit_p99_us_idle": statistics.median(r["hit_us_idle"]["p99"] for r in rows),
                        "hit_p99_us_writing": statistics.median(r["hit_us_writing"]["p99"] for r in rows)}
    out["median"] = median
    out["sync_interval_ms"] = round(interval * 1000)
    new, old = median["interval"], median["per_commit"]
    out["ratios"] = {
        "writer_interval_over_per_commit": round(new["writer_puts_per_s"] / old["writer_puts_per_s"], 2),
        "writer_over_ceiling": round(new["writer_puts_per_s"] / new["ceiling_puts_per_s"], 3),
        "hit_p50_writing_over_idle": round(new["hit_p50_us_writing"] / new["hit_p50_us_idle"], 3),
    }
    return out


def print_write_path(result: dict) -> None:
    m, r = result["median"], result["ratios"]
    print(f"\n## Write path ({result['puts_per_run']} puts of {result['record_bytes']} B a run)\n")
    print("| flush | py-lmdb ceiling | writer process | hit p50 idle / writing |")
    print("| --- | --- | --- | --- |")
    for name, label in (("per_commit", "each commit"), ("interval", f"every {result['sync_interval_ms']} ms")):
        print(f"| {label} | {m[name]['ceiling_puts_per_s']:,.0f}/s | {m[name]['writer_puts_per_s']:,.0f}/s | "
              f"{m[name]['hit_p50_us_idle']} / {m[name]['hit_p50_us_writing']} us |")
    print(f"\nwriter, interval over per commit: {r['writer_interval_over_per_commit']}x; writer over the ceiling: "
          f"{r['writer_over_ceiling']}; hit p50 writing over idle: {r['hit_p50_writing_over_idle']}x")
