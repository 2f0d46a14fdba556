"""Fleet section (`make bench ARGS="--sections fleet"`): what an answer from another pod costs.

One redis-server and two servers on it ("pods" A and B, each its own LMDB directory, one frontend each,
the tier's default 5 ms budget). A computes sets of Banking77 texts, which reach Redis behind its
replies; B answers a small set of them once, so they sit in its L1. Then on B, at 1 and 32 callers:

- L1 hits: the small set, cycled (B's frontend answers from LMDB);
- fleet hits: texts B has never seen, each once (B's frontend finds them in Redis, answers, and sends
  the record to its worker for L1);

alternating, three rounds of each (a fleet hit can be had once per text and pod, so each round has
texts of its own), so that the machine's changing load hits both alike; medians over rounds. Then
misses: texts nobody computed (looked up in Redis, leased, computed, written back). Last, the Redis
round trip alone: GETs of a stored record from one asyncio client (redis-py, as the tier uses it).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path

from bench.load import minilm_only, run_load, warm
from tests import redis_servers
from tests.servers import ServerProcess
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
        return out
    finally:
        for pod in pods:
            pod.stop()
        redis_server.stop()


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
