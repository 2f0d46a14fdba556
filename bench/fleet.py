"""Fleet section (`make bench ARGS="--sections fleet"`): what an answer from another pod costs.

One redis-server and two servers on it ("pods" A and B, each its own LMDB directory, one frontend each,
the tier's default 5 ms budget). A computes sets of Banking77 texts, which reach Redis behind its
replies; B answers a small set of them once, so they sit in its L1. Then on B, at 1 and 32 callers:

- L1 hits: the small set, cycled (B's frontend answers from LMDB);
- fleet hits: texts B has never seen, each once (B's frontend finds them in Redis, answers, and sends
  the record to its worker for L1);

alternating, three rounds of each (a fleet hit can be had once per text and pod, so each round has
texts of its own), so that the machine's changing load hits both alike; medians over rounds. Then
misses: texts nobody computed (looked up in Redis, leased, computed, written back). Then the Redis
round trip alone: GETs of a stored record from one asyncio client (redis-py, as the tier uses it).

Last, the key filter (server/fleet/key_filter.py): misses at 1 caller on two more pods of the same Redis,
one with the filter (the default) and one without (`fleet.key_filter_keys=0`), rounds alternating, each
round texts nobody computed; with the null engine (the model costs nothing, so what remains is the
server's own path and its Redis round trips) and with minilm on ONNX Runtime. And the filter itself:
its size per million keys, its false-positive rate measured at that many keys, and a lookup's cost.
"""

from __future__ import annotations

import asyncio
import itertools
import statistics
import time
from pathlib import Path

from bench.load import minilm_only, run_load, warm
from bench.sections import Run
from harness import redis_servers
from harness.servers import ServerProcess
from infercache.v1 import infercache_pb2 as pb
from server.shared.normalize import DEFAULT_STEPS, Normalizer

ROUNDS = 3
SIZES = {"l1": 200, "fleet_1": 300 * ROUNDS, "fleet_32": 1000 * ROUNDS, "miss_1": 300, "miss_32": 1500}


def _distinct(texts: list[str]) -> list[str]:
    normalize, seen, out = Normalizer(DEFAULT_STEPS), set(), []
    for text in texts:
        if (key := normalize(text)) and key not in seen:
            seen.add(key)
            out.append(text)
    return out


def _requests(texts: list[str]) -> list[pb.InferRequest]:
    return [pb.InferRequest(model="minilm", text=t) for t in texts]


async def _redis_round_trip(port: int, key: str, calls: int) -> dict:
    import numpy as np
    import redis.asyncio as redis

    client = redis.Redis(port=port)
    value = await client.get(key)
    latencies = []
    for _ in range(calls):
        started = time.perf_counter()
        await client.get(key)
        latencies.append((time.perf_counter() - started) * 1000)
    await client.aclose()
    return {"calls": calls, "value_bytes": len(value or b""), "p50_ms": round(float(np.percentile(latencies, 50)), 3),
            "p99_ms": round(float(np.percentile(latencies, 99)), 3)}


def bench_fleet(workdir: Path, texts: list[str], scale: float) -> dict:
    why = redis_servers.available()
    if why is not None:
        return {"skipped": why}
    workdir.mkdir(parents=True)
    sizes = {name: max(50, int(n * scale)) for name, n in SIZES.items()}
    pool = iter(_distinct(texts))
    sets = {name: [next(pool) for _ in range(n)] for name, n in sizes.items()}
    models = minilm_only(workdir / "models")
    redis_server = redis_servers.RedisProcess(workdir / "redis")
    pods = []
    try:
        for name in ("a", "b"):
            (workdir / name).mkdir()
            pods.append(ServerProcess(workdir / name, models, frontends=1, engines_dir=workdir / "engines",
                                      settings=("engines.runtime=onnxruntime", f"fleet.redis={redis_server.url}")))
        a, b = pods
        time.sleep(0.5)  # subscribed
        print(f"  A computes {sizes['l1'] + sizes['fleet_1'] + sizes['fleet_32']} texts ...", flush=True)
        warm(a.address, _requests(sets["l1"] + sets["fleet_1"] + sets["fleet_32"]))
        time.sleep(0.5)  # the last fleet writes leave A
        l1 = _requests(sets["l1"])
        warm(b.address, l1)  # fleet hits once, then in B's L1
        out: dict = {"texts": sizes, "pods": 2, "frontends_per_pod": 1, "rounds": ROUNDS}
        for callers in (1, 32):
            fleet = _requests(sets[f"fleet_{callers}"])
            chunk = len(fleet) // ROUNDS
            runs: dict[str, list[dict]] = {"l1_hit": [], "fleet_hit": []}
            for round_ in range(ROUNDS):
                for name, requests, expected in (("l1_hit", l1, "RESULT_EXACT"),
                                                 ("fleet_hit", fleet[round_ * chunk:(round_ + 1) * chunk], "RESULT_FLEET")):
                    result = asyncio.run(run_load(b.address, requests, concurrency=callers, total=chunk))
                    summary = result.summary()
                    summary["share_as_expected"] = round(result.sources.get(expected, 0) / max(1, result.requests), 4)
                    runs[name].append(summary)
            row: dict = {name: {k: statistics.median(r[k] for r in rounds)
                                for k in ("p50_ms", "p99_ms", "throughput_rps", "share_as_expected")}
                         for name, rounds in runs.items()}
            row["rounds"] = runs
            misses = _requests(sets[f"miss_{callers}"])
            row["miss"] = asyncio.run(run_load(b.address, misses, concurrency=callers, total=len(misses))).summary()
            row["fleet_hit_p50_vs_l1_hit"] = round(row["fleet_hit"]["p50_ms"] / row["l1_hit"]["p50_ms"], 3)
            out[f"concurrency_{callers}"] = row
        out["fleet_counters_b"] = {k: int(v) for k, v in b.stats().worker.counters.items() if k.startswith("fleet.")}
        from cachestore.keys import entry_key, namespace_id

        key = entry_key(namespace_id("", "minilm", "1"), Normalizer(DEFAULT_STEPS)(sets["fleet_1"][0]))
        out["redis_round_trip"] = asyncio.run(_redis_round_trip(redis_server.port, f"icache:r:{{{key.hex()}:0}}", 2000))
        for pod in pods:
            pod.stop()
        fresh = (f"{text} ({n})" for n, text in enumerate(itertools.cycle(_distinct(texts))))  # never computed
        out["key_filter"] = {engine: _filter_misses(workdir / engine, models, redis_server.url, fresh, engine, scale)
                             for engine in ("null", "onnxruntime")}
        out["key_filter"]["filter"] = _filter_itself()
        return out
    finally:
        for pod in pods:
            pod.stop()
        redis_server.stop()


def _filter_misses(workdir: Path, models: Path, redis_url: str, pool, engine: str, scale: float) -> dict:
    """Misses at 1 caller on a pod with the key filter and one without, rounds alternating."""
    per_round = max(50, int(300 * scale))
    workdir.mkdir()
    settings = (f"engines.runtime={engine}", f"fleet.redis={redis_url}")
    pods = {}
    try:
        for name, extra in (("with_filter", ()), ("without_filter", ("fleet.key_filter_keys=0",))):
            (workdir / name).mkdir()
            pods[name] = ServerProcess(workdir / name, models, frontends=1, engines_dir=workdir.parent / "engines",
                                       settings=(*settings, *extra))
        time.sleep(2.0)  # subscribed; the filter built and stamped
        warm(pods["with_filter"].address, _requests([next(pool) for _ in range(20)]))  # (the filter's first look)
        runs: dict[str, list[dict]] = {name: [] for name in pods}
        for _ in range(ROUNDS):
            for name, pod in pods.items():
                misses = _requests([next(pool) for _ in range(per_round)])
                result = asyncio.run(run_load(pod.address, misses, concurrency=1, total=len(misses)))
                summary = result.summary()
                summary["share_miss"] = round(result.sources.get("MISS", 0) / max(1, result.requests), 4)
                runs[name].append(summary)
        counters = pods["with_filter"].stats().frontend.counters
        row: dict = {name: {k: statistics.median(r[k] for r in rounds) for k in ("p50_ms", "p99_ms", "share_miss")}
                     for name, rounds in runs.items()}
        row["rounds"] = runs
        row["p50_ratio"] = round(row["with_filter"]["p50_ms"] / row["without_filter"]["p50_ms"], 3)
        row["lookups_skipped"] = int(counters.get("fleet.key_filter_skipped", 0))
        row["misses_with_filter"] = per_round * ROUNDS + 20
        return row
    finally:
        for pod in pods.values():
            pod.stop()


def _filter_itself(keys: int = 1_000_000, fp_rate: float = 0.01, probes: int = 100_000) -> dict:
    """A filter sized for a million keys, filled with a million fleet key names: its size, its measured
    false-positive rate over names never added, and what a frontend's lookup costs."""
    import os
    import tempfile
    from collections import Counter

    from server.fleet import key_filter

    m, k = key_filter.sized(keys, fp_rate)
    bits = key_filter.Bits(m, k)
    for _ in range(keys // 100_000):
        bits.add(b"".join(key_filter.digest(f"icache:r:{{{os.urandom(24).hex()}:0}}") for _ in range(100_000)))
    false = sum(bits.may_hold(key_filter.digest(f"icache:r:{{{os.urandom(24).hex()}:1}}")) for _ in range(probes))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / key_filter.FILE_NAME
        path.write_bytes(key_filter.HEADER.pack(key_filter.MAGIC, m, k, 0, time.time_ns() // 1000) + bits.array.tobytes())
        reader = key_filter.Reader(path, Counter())
        names = [f"icache:r:{{{os.urandom(24).hex()}:0}}" for _ in range(20_000)]
        reader.absent(names[0])
        started = time.perf_counter()
        for name in names:
            reader.absent(name)
        lookup_us = (time.perf_counter() - started) / len(names) * 1e6
        reader.close()
    return {"keys": keys, "bits": m, "hashes": k, "mib_per_million_keys": round(m / 8 / (1 << 20) * 1e6 / keys, 3),
            "fp_rate_configured": fp_rate, "fp_rate_measured": round(false / probes, 4), "probes": probes,
            "lookup_us": round(lookup_us, 2)}


def print_fleet(report: dict) -> None:
    if "skipped" in report:
        print(f"\nfleet tier: skipped ({report['skipped']})")
        return
    print(f"\nfleet tier on B, for texts A computed (one Redis; 1 frontend per pod; medians of {report['rounds']} "
          "alternating rounds)")
    print("                          p50 ms    p99 ms    req/s   as expected")
    for callers in (1, 32):
        row = report[f"concurrency_{callers}"]
        for name in ("l1_hit", "fleet_hit", "miss"):
            r = row[name]
            share = f"{100 * r['share_as_expected']:.1f}%" if "share_as_expected" in r else ""
            print(f"  {callers:>2} callers  {name:<10} {r['p50_ms']:8.3f}  {r['p99_ms']:8.3f}  {r['throughput_rps']:7.0f}   {share}")
        print(f"  {callers:>2} callers  fleet hit p50 / L1 hit p50 = {row['fleet_hit_p50_vs_l1_hit']:.2f}x (target <= 3)")
    rtt = report["redis_round_trip"]
    print(f"  Redis round trip alone (redis-py asyncio GET, {rtt['value_bytes']} B): p50 {rtt['p50_ms']} ms, "
          f"p99 {rtt['p99_ms']} ms")
    key_filter = report.get("key_filter")
    if key_filter:
        print("  misses at 1 caller, key filter on / off (medians of alternating rounds):")
        for engine in ("null", "onnxruntime"):
            row = key_filter[engine]
            print(f"    {engine:<12} p50 {row['with_filter']['p50_ms']:.3f} / {row['without_filter']['p50_ms']:.3f} ms "
                  f"= {row['p50_ratio']}x; lookups skipped {row['lookups_skipped']} of {row['misses_with_filter']}")
        f = key_filter["filter"]
        print(f"  the filter: {f['mib_per_million_keys']} MiB per million keys at {f['fp_rate_configured']} "
              f"configured; measured false positives {f['fp_rate_measured']}; a lookup {f['lookup_us']} us")


def section(run: Run) -> None:
    print("benchmarking the fleet tier (two pods on one Redis) ...", flush=True)
    run.report["fleet"] = bench_fleet(run.workdir / "fleet", run.texts, run.scale)
    print_fleet(run.report["fleet"])
