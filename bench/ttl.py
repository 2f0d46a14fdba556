"""TTL section (`python -m bench --sections ttl`): what TTL classes cost where they add work, and how far
expiry jitter spreads entries written together. The model is minilm with the design's classes (static
3600 s, the default; dynamic 30 s; realtime 0).

1. Exact hits (one server, minilm on its CPU runtime, a frontend per core) at 1 and 32 callers: requests
   that pick a class (`CachePolicy.ttl_class: dynamic`) against requests that name none (the model's
   default class), alternating at each number of callers, the order turning each round; each round
   hits texts stored at its start (a dynamic entry answers for 30 s at most; a run that meets a miss
   is measured again after its texts were computed afresh, and noted). A class is resolved once per
   plan (plans are kept by model, tenant, mode and class), so this is the request path's whole share.
2. The store writer: puts that carry a class (the store counts entries by class in the same
   transaction: one more read and write per put) against puts that carry none, in a real writer
   process (server/worker/store/writer.py, fsync on, the server's batch and group-commit defaults) on a store
   of PREFILL entries; the writer's CPU per put, rounds alternating. Then the store's own transactions
   in this process (no process, no fsync): CPU per put and per expired entry swept (a swept entry's
   class is counted down), with and without classes, rounds alternating.
3. Expiry jitter: two servers (null engine: answers cost nothing, so JITTER_TEXTS entries are written
   within about a second), `cache.ttl_jitter` at its default against 0, each on a Redis of its own
   (the fleet tier's copies; FLEET_BUDGETS). Each server stores JITTER_TEXTS texts for the static class,
   then as many for the dynamic one, through InferBatch; then every L1 record's lifetime and expiry
   instant (from the store), every Redis copy's expiry (its PTTL when read), and, for the dynamic class,
   the sweeps (every second here) that removed them, from the server's log. Reported: the window in
   which the entries expire, lifetimes as a share of the TTL, and the most that expire within one second.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import re
import shutil
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

from bench.load import run_load, warm
from bench.probes import cpu_seconds
from bench.sections import Run
from cachestore import records, results
from cachestore.env import DB_RESULTS, Store, StoreSettings
from cachestore.keys import Namespace, entry_key
from cachestore.space import EVICT_PER_OP
from cachestore.writer import WriteBehind
from infercache.v1 import infercache_pb2 as pb
from infercache.v1 import infercache_pb2_grpc
from server.config import CacheSection
from server.shared.normalize import DEFAULT_STEPS, Normalizer
from harness import redis_servers
from harness.servers import REPO, ServerProcess

CLASSES = {"static": 3600, "dynamic": 30, "realtime": 0}
HIT_TEXTS = 200          # texts a round hits, per kind of request
RECORD_BYTES = 1600      # a minilm answer (384 float32) as stored
PREFILL = 20_000         # entries in the writer's store before a run
WRITER_PUTS = 30_000     # puts a writer run measures
SWEEP_ENTRIES = 30_000   # entries put and swept by the in-process store rounds
JITTER_TEXTS = 2_000     # entries written together, per class and server (about a second on 2 cores)
# The fleet tier's budgets for this part: at the defaults (5 ms a lookup or lease) a 2-core host writing
# as fast as it can trips the breaker, and the copies this part reads are dropped.
FLEET_BUDGETS = ("fleet.timeout_ms=200", "fleet.write_timeout_ms=1000")
NS = Namespace("bench", "minilm", "1")


def classes_models(root: Path) -> Path:
    """minilm as shipped, its cache section replaced by CLASSES (default static)."""
    (root / "minilm").mkdir(parents=True)
    shipped = (REPO / "models" / "minilm" / "config.yaml").read_text()
    classes = ", ".join(f"{name}: {seconds}" for name, seconds in CLASSES.items())
    (root / "minilm" / "config.yaml").write_text(
        shipped.split("\ncache:")[0] + f"\ncache:\n  classes: {{{classes}}}\n  default_class: static\n")
    (root / "minilm" / "1").symlink_to(REPO / "models" / "minilm" / "1")
    return root


# ---- 1. exact hits -------------------------------------------------------------------------------------

def _request(text: str, ttl_class: str) -> pb.InferRequest:
    return pb.InferRequest(model="minilm", text=text, cache=pb.CachePolicy(ttl_class=ttl_class))


def bench_class_hits(workdir: Path, models: Path, texts: list[str], rounds: int, scale: float) -> dict:
    plan = {1: int(1000 * scale), 32: int(5000 * scale)}
    kinds = {"default_class": "", "picked_class": "dynamic"}
    normalize, seen = Normalizer(DEFAULT_STEPS), set()
    pool = (t for t in texts if (key := normalize(t)) and not (key in seen or seen.add(key)))  # one entry each
    runs: dict[str, dict[int, list[dict]]] = {kind: {c: [] for c in plan} for kind in kinds}
    refreshed: list[dict] = []
    (workdir / "hits").mkdir(parents=True)
    with ServerProcess(workdir / "hits", models, frontends=multiprocessing.cpu_count(),
                       engines_dir=workdir / "engines") as server:
        for r in range(rounds):
            fresh = {kind: [_request(next(pool), ttl_class) for _ in range(HIT_TEXTS)]
                     for kind, ttl_class in kinds.items()}
            for requests in fresh.values():
                asyncio.run(run_load(server.address, requests, concurrency=32, total=len(requests)))  # computed
                warm(server.address, requests)  # (each checked stored)
            for callers, total in plan.items():
                for kind in (list(kinds) if r % 2 == 0 else list(reversed(kinds))):
                    runs[kind][callers].append(_hits(server.address, fresh[kind], callers, total, refreshed))
        counted = dict(server.stats().store.entries_by_class)
        assert server.stop() == 0
    out: dict = {"classes": CLASSES, "picked_class": kinds["picked_class"], "texts_per_round": HIT_TEXTS,
                 "requests_per_run": {f"concurrency_{c}": n for c, n in plan.items()},
                 "frontends": multiprocessing.cpu_count(), "entries_by_class": counted,
                 "runs_measured_again": refreshed}
    for callers in plan:
        row: dict = {}
        for kind in kinds:
            samples = runs[kind][callers]
            row[kind] = {k: statistics.median(s[k] for s in samples) for k in ("p50_ms", "p99_ms", "throughput_rps")}
            row[kind]["rounds"] = samples
        ratios = [(p["p50_ms"] / d["p50_ms"], p["throughput_rps"] / d["throughput_rps"])
                  for p, d in zip(runs["picked_class"][callers], runs["default_class"][callers])]
        row["p50_ratio"] = round(statistics.median(p for p, _ in ratios), 3)
        row["throughput_ratio"] = round(statistics.median(t for _, t in ratios), 3)
        out[f"concurrency_{callers}"] = row
    return out


def _hits(address: str, requests: list[pb.InferRequest], callers: int, total: int, refreshed: list[dict]) -> dict:
    """A warm-up and a measured run of exact hits. A run that met a miss (a dynamic entry outlived: the
    machine stalled for long enough) is measured again once its entries were all computed afresh
    (BYPASS), and noted in `refreshed`."""
    for _ in range(3):
        asyncio.run(run_load(address, requests, concurrency=callers, total=total // 10))
        result = asyncio.run(run_load(address, requests, concurrency=callers, total=total))
        assert result.errors == 0, f"{result.errors} errors"
        if result.sources == {"RESULT_EXACT": result.requests}:
            return result.summary()
        refreshed.append({"ttl_class": requests[0].cache.ttl_class, "callers": callers, "sources": result.sources})
        again = [pb.InferRequest(model=q.model, text=q.text, cache=pb.CachePolicy(
            ttl_class=q.cache.ttl_class, mode=pb.CachePolicy.BYPASS)) for q in requests]
        asyncio.run(run_load(address, again, concurrency=32, total=len(again)))
        warm(address, requests)
    raise AssertionError(f"exact hits missed three times running: {refreshed[-3:]}")


# ---- 2. the store writer ----------------------------------------------------------------------------------

async def _writer_run(path: Path, ttl_class: str) -> dict:
    from server.worker.store.writer import WriterProcess

    defaults = CacheSection()
    writer = await WriterProcess.start(StoreSettings(path, 2 << 30, 3 << 29, sync=True),
                                       batch_max=defaults.write_batch, sweep_interval_s=3600.0, max_ttl_s=0,
                                       what="result store", log_level="WARNING", role="bench",
                                       group_commit_s=defaults.group_commit_ms / 1000)
    payload = os.urandom(RECORD_BYTES)
    count = iter(range(10**9))

    def put() -> None:
        now = results.now_us()
        writer.put(entry_key(NS.ns_id, f"{next(count)} {now}"), NS, records.Record(now, now + 3_600_000_000, payload),
                   ttl_class=ttl_class)

    try:
        for _ in range(PREFILL):
            put()
        await asyncio.wrap_future(writer.flush())
        cpu, before = cpu_seconds(writer.process.pid), writer.counters["writes"]
        began = time.perf_counter()
        for n in range(WRITER_PUTS):
            put()
            if n % 32 == 31:  # a frame of puts per loop turn, as a worker sends them
                await asyncio.sleep(0)
        await asyncio.wrap_future(writer.flush())
        wall = time.perf_counter() - began
        used = cpu_seconds(writer.process.pid) - cpu
        await asyncio.sleep(0.3)  # the counters come with the process's next frame
        done = writer.counters["writes"] - before
        assert done == WRITER_PUTS, (done, dict(writer.counters))
        return {"puts": done, "writer_cpu_us_per_put": round(used / done * 1e6, 2), "puts_per_s": round(done / wall)}
    finally:
        await writer.close()


def _store_run(path: Path, ttl_class: str) -> dict:
    """SWEEP_ENTRIES puts, then a sweep of them all, in this process: CPU per entry of each."""
    store = Store(StoreSettings(path, 2 << 30, 3 << 29, sync=False), readonly=False)
    try:
        writer = WriteBehind(store, threaded=False, sweep_interval_s=3600, batch_max=CacheSection().write_batch)
        payload, now = os.urandom(RECORD_BYTES), results.now_us()
        made = [(entry_key(NS.ns_id, f"{n} {now}"), records.Record(now, now + 1_000_000 + n, payload))
                for n in range(SWEEP_ENTRIES)]
        started = time.process_time()
        for key, record in made:
            writer.put(key, NS, record, ttl_class=ttl_class)
        writer.drain()
        put_s = time.process_time() - started
        chunk, swept = EVICT_PER_OP * CacheSection().write_batch, 0
        started = time.process_time()
        while True:
            with store.begin(write=True) as txn:
                n = results.sweep_expired(store, txn, now + 10_000_000, chunk)
            swept += n
            if n < chunk:
                break
        sweep_s = time.process_time() - started
        assert swept == SWEEP_ENTRIES and not store.stats()["entries_by_class"]
        return {"put_cpu_us": round(put_s / SWEEP_ENTRIES * 1e6, 2), "sweep_cpu_us": round(sweep_s / swept * 1e6, 2)}
    finally:
        store.close()


def bench_writer(workdir: Path, rounds: int) -> dict:
    kinds = {"with_class": "static", "without_class": ""}
    writer_runs: dict[str, list[dict]] = {k: [] for k in kinds}
    store_runs: dict[str, list[dict]] = {k: [] for k in kinds}
    workdir.mkdir(parents=True, exist_ok=True)
    for r in range(rounds):
        for kind in (list(kinds) if r % 2 == 0 else list(reversed(kinds))):
            for runs, measure in ((writer_runs, lambda p: asyncio.run(_writer_run(p, kinds[kind]))),
                                  (store_runs, lambda p: _store_run(p, kinds[kind]))):
                path = Path(tempfile.mkdtemp(prefix=f"ttl-{kind}-", dir=workdir))
                try:
                    runs[kind].append(measure(path))
                finally:
                    shutil.rmtree(path, ignore_errors=True)
            print(f"  {kind}: writer {writer_runs[kind][-1]}, store {store_runs[kind][-1]}", flush=True)

    def medians(runs: dict[str, list[dict]], fields: tuple[str, ...]) -> dict:
        out: dict = {k: {f: statistics.median(row[f] for row in rows) for f in fields} | {"rounds": rows}
                     for k, rows in runs.items()}
        for f in fields:
            out[f"{f}_ratio"] = round(statistics.median(
                w[f] / o[f] for w, o in zip(runs["with_class"], runs["without_class"])), 3)
        return out

    return {"prefill": PREFILL, "record_bytes": RECORD_BYTES,
            "writer_process": {"puts_per_round": WRITER_PUTS, **medians(writer_runs, ("writer_cpu_us_per_put", "puts_per_s"))},
            "store_alone": {"entries_per_round": SWEEP_ENTRIES, **medians(store_runs, ("put_cpu_us", "sweep_cpu_us"))}}


# ---- 3. expiry jitter -------------------------------------------------------------------------------------

async def _write(address: str, texts: list[str], ttl_class: str, callers: int = 4, per_call: int = 250) -> float:
    """Every text once through InferBatch (`callers` calls at a time); seconds it took."""
    import grpc

    batches = [texts[i:i + per_call] for i in range(0, len(texts), per_call)]
    async with grpc.aio.insecure_channel(address) as channel:
        stub = infercache_pb2_grpc.InferenceCacheStub(channel)
        queue = iter(batches)

        async def caller() -> None:
            for batch in queue:
                response = await stub.InferBatch(pb.InferBatchRequest(
                    model="minilm", texts=batch, cache=pb.CachePolicy(ttl_class=ttl_class)), timeout=60)
                assert len(response.results) == len(batch)

        started = time.perf_counter()
        await asyncio.gather(*(caller() for _ in range(callers)))
        return time.perf_counter() - started


def _until(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("not reached in time")
        time.sleep(0.1)


def _spread(created_us: list[int], expires_us: list[int], ttl_s: int) -> dict:
    """Where a set of entries expires: the window from the first expiry to the last, percentiles of
    the expiry instants (seconds after the first entry was made) and of lifetimes (share of the TTL),
    and the most that expire within one second (aligned on the first expiry)."""
    made, ends = np.asarray(created_us, dtype=np.int64), np.asarray(expires_us, dtype=np.int64)
    t0 = int(made.min())
    at_s = (ends - t0) / 1e6
    share = (ends - made) / (ttl_s * 1e6)
    per_second = np.bincount(((ends - ends.min()) // 1_000_000).astype(np.int64))
    pct = (0, 1, 50, 99, 100)
    return {"entries": int(len(ends)), "written_within_s": round((int(made.max()) - t0) / 1e6, 3),
            "expiry_window_s": round((int(ends.max()) - int(ends.min())) / 1e6, 3),
            "expires_at_s": {f"p{p}": round(float(np.percentile(at_s, p)), 3) for p in pct},
            "lifetime_share_of_ttl": {f"p{p}": round(float(np.percentile(share, p)), 4) for p in pct},
            "most_in_one_second": int(per_second.max()),
            "most_in_one_second_share": round(float(per_second.max()) / len(ends), 4),
            "seconds_with_expiries": int(np.count_nonzero(per_second))}


def _l1_records(server: ServerProcess) -> dict[bytes, tuple[int, int]]:
    store = Store(StoreSettings(server.cache_dir, CacheSection().map_size_mb << 20, CacheSection().budget_mb << 20),
                  readonly=True)
    try:
        with store.begin() as txn:
            return {bytes(key): records.decode_times(raw) for key, raw in txn.cursor(db=store.dbs[DB_RESULTS])}
    finally:
        store.close()


def _redis_records(port: int) -> list[tuple[int, int]]:
    """(created_us, when Redis will drop it in us) of every value key, from its record and PTTL."""
    import redis

    client = redis.Redis(port=port)
    out = []
    try:
        names = list(client.scan_iter(match="icache:r:*", count=1000))
        for i in range(0, len(names), 1000):
            pipe = client.pipeline(transaction=False)
            for name in names[i:i + 1000]:
                pipe.get(name)
                pipe.pttl(name)
            read_us = results.now_us()
            answers = pipe.execute()
            for raw, pttl in zip(answers[0::2], answers[1::2]):
                if raw is not None and pttl > 0:
                    out.append((records.decode_times(raw)[0], read_us + pttl * 1000))
    finally:
        client.close()
    return out


def bench_jitter(workdir: Path, models: Path, count: int = JITTER_TEXTS) -> dict:
    why = redis_servers.available()
    variants = {"jitter_default": (), "jitter_0": ("cache.ttl_jitter=0",)}
    workdir.mkdir(parents=True)
    redis_procs: dict[str, redis_servers.RedisProcess] = {}
    servers: dict[str, ServerProcess] = {}
    out: dict = {"ttl_jitter": {"jitter_default": CacheSection().ttl_jitter, "jitter_0": 0.0},
                 "entries_per_class": count, "engine": "null", "frontends": multiprocessing.cpu_count(),
                 "fleet": why or f"one Redis per server; {', '.join(FLEET_BUDGETS)}"}
    try:
        for name, extra in variants.items():
            settings = ["engines.runtime=null", *extra]
            if why is None:
                redis_procs[name] = redis_servers.RedisProcess(workdir / f"redis-{name}")
                settings += [f"fleet.redis={redis_procs[name].url}", *FLEET_BUDGETS]
            (workdir / name).mkdir()
            servers[name] = ServerProcess(workdir / name, models, frontends=multiprocessing.cpu_count(),
                                          engines_dir=workdir / "engines", settings=tuple(settings))
        time.sleep(1.0)  # subscribed (the fleet tier is used once it is)
        written: dict[str, dict[str, float]] = {name: {} for name in variants}
        began: dict[str, float] = {}
        for ttl_class in ("static", "dynamic"):
            for name, server in servers.items():
                texts = [f"jitter {ttl_class} {n} {uuid.uuid4().hex[:12]}" for n in range(count)]
                if ttl_class == "dynamic":
                    began[name] = time.monotonic()
                written[name][ttl_class] = round(asyncio.run(_write(server.address, texts, ttl_class)), 3)
                _until(lambda: server.stats().store.entries_by_class.get(ttl_class, 0) >= count)
                print(f"  {name}: {count} {ttl_class} entries written in {written[name][ttl_class]} s", flush=True)
        l1 = {name: _l1_records(server) for name, server in servers.items()}
        fleet = {name: _redis_records(proc.port) for name, proc in redis_procs.items()}
        # The dynamic entries expire 27-30 s after they were made; the writers' sweeps (every second) say
        # in their log lines how many each removed.
        _until(lambda: all(not s.stats().store.entries_by_class.get("dynamic", 0) for s in servers.values()),
               timeout=max(began.values()) + CLASSES["dynamic"] + 20 - time.monotonic())
        for name, server in servers.items():
            counters = server.stats().worker.counters
            out.setdefault("fleet_writes", {})[name] = {k: int(counters.get(f"fleet.{k}", 0))
                                                        for k in ("writes", "writes_dropped")}
            assert server.stop() == 0
        for name in variants:
            row: dict = {"written_in_s": written[name]}
            times = list(l1[name].values())
            for ttl_class, ttl_s in (("static", CLASSES["static"]), ("dynamic", CLASSES["dynamic"])):
                # a record's class from its lifetime (the dynamic ones live 30 s at most)
                chosen = [(c, e) for c, e in times if (e - c > 60e6) == (ttl_class == "static")]
                row[f"l1_{ttl_class}"] = _spread([c for c, _ in chosen], [e for _, e in chosen], ttl_s)
            for ttl_class, ttl_s in CLASSES.items() if name in fleet else ():
                chosen = [(c, e) for c, e in fleet[name] if (e - c > 60e6) == (ttl_class == "static")]
                if ttl_s and chosen:
                    row[f"fleet_{ttl_class}"] = _spread([c for c, _ in chosen], [e for _, e in chosen], ttl_s)
            dynamic_made = min(c for c, e in times if e - c <= 60e6)
            row["dynamic_sweeps"] = _sweeps(servers[name].log_path, dynamic_made, count)
            out[name] = row
        return out
    finally:
        for server in servers.values():
            server.stop()
        for proc in redis_procs.values():
            proc.stop()


SWEPT = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) .*swept (\d+) expired entries")


def _sweeps(log: Path, since_us: int, count: int) -> dict:
    """The sweeps that removed the dynamic entries, from the server's log (the writer logs each sweep's
    count): seconds after the first dynamic entry was made, and how many it removed."""
    found = []
    for line in log.read_text().splitlines():
        if m := SWEPT.match(line):
            at_us = int(time.mktime(time.strptime(m[1], "%Y-%m-%d %H:%M:%S"))) * 1_000_000 + int(m[2]) * 1000
            found.append((round((at_us - since_us) / 1e6, 1), int(m[3])))
    removed = sum(n for _, n in found)
    assert removed == count, (removed, found)
    return {"sweeps": found, "sweeps_that_removed": len(found), "first_at_s": found[0][0], "last_at_s": found[-1][0],
            "most_in_one_sweep": max(n for _, n in found),
            "most_in_one_sweep_share": round(max(n for _, n in found) / count, 4)}


def bench_ttl(workdir: Path, texts: list[str], rounds: int, scale: float, report: dict, checkpoint) -> None:
    models = classes_models(workdir / "models")
    print("  exact hits: a picked TTL class against the model's default ...", flush=True)
    report["class_hits"] = bench_class_hits(workdir, models, texts, rounds, scale)
    checkpoint()
    print("  the store writer: puts with a TTL class against without ...", flush=True)
    report["writer"] = bench_writer(workdir / "writer", rounds)
    checkpoint()
    count = max(1000, int(JITTER_TEXTS * scale))
    print(f"  expiry jitter: {count} entries per class written together, jitter at its default against 0 ...", flush=True)
    report["jitter"] = bench_jitter(workdir / "jitter", models, count)
    checkpoint()


def print_ttl(report: dict) -> None:
    hits = report.get("class_hits")
    if hits:
        print("\nTTL classes on exact hits (medians of alternating rounds; ratio = picked / default, per round)")
        for callers in (1, 32):
            row = hits[f"concurrency_{callers}"]
            d, p = row["default_class"], row["picked_class"]
            print(f"  {callers:>2} callers  default p50 {d['p50_ms']:.3f} ms {d['throughput_rps']:7.0f} req/s | "
                  f"picked p50 {p['p50_ms']:.3f} ms {p['throughput_rps']:7.0f} req/s | "
                  f"{row['p50_ratio']}x p50, {row['throughput_ratio']}x throughput")
    writer = report.get("writer")
    if writer:
        w, s = writer["writer_process"], writer["store_alone"]
        print(f"  writer process CPU per put: {w['with_class']['writer_cpu_us_per_put']} us with a class, "
              f"{w['without_class']['writer_cpu_us_per_put']} us without ({w['writer_cpu_us_per_put_ratio']}x)")
        print(f"  store alone: put {s['with_class']['put_cpu_us']} / {s['without_class']['put_cpu_us']} us "
              f"({s['put_cpu_us_ratio']}x), sweep {s['with_class']['sweep_cpu_us']} / "
              f"{s['without_class']['sweep_cpu_us']} us ({s['sweep_cpu_us_ratio']}x)")
    jitter = report.get("jitter")
    if jitter:
        print(f"\nexpiry jitter: {jitter['entries_per_class']} entries per class written together")
        for name in ("jitter_default", "jitter_0"):
            row = jitter[name]
            for part in ("l1_static", "fleet_static", "l1_dynamic", "fleet_dynamic"):
                if part in row:
                    s = row[part]
                    print(f"  {name:<15} {part:<13} written within {s['written_within_s']} s, expire within "
                          f"{s['expiry_window_s']} s; lifetime p0-p100 {s['lifetime_share_of_ttl']['p0']}-"
                          f"{s['lifetime_share_of_ttl']['p100']} of the TTL; most in one second "
                          f"{s['most_in_one_second']} ({100 * s['most_in_one_second_share']:.1f}%)")
            sw = row["dynamic_sweeps"]
            print(f"  {name:<15} dynamic entries swept by {sw['sweeps_that_removed']} sweeps, {sw['first_at_s']} s to "
                  f"{sw['last_at_s']} s after the first was made; most in one sweep {sw['most_in_one_sweep']}")


def section(run: Run) -> None:
    print("benchmarking TTL classes and expiry jitter ...", flush=True)
    run.report["ttl"] = {}
    bench_ttl(run.workdir / "ttl", run.texts, run.rounds, run.scale, run.report["ttl"], checkpoint=run.save)
    print_ttl(run.report["ttl"])
