"""The serving section: exact hits against two bare grpc.aio servers with the same client and process
count (echo: parses the request, serializes a message of the same size; raw bytes: a recorded hit's bytes,
no protobuf work, the floor of gRPC), rounds alternating, medians over rounds, then the frontends' CPU per
hit; misses at 32 callers with the batcher against max_batch_size 1 (same server, same weights, two model
names) and the engine alone; /metrics on against off (bench/metrics_cost.py); start-up to the first hit
(warm store) and the first miss."""

from __future__ import annotations

import asyncio
import multiprocessing
import statistics
import time
from pathlib import Path

from bench import echo
from bench.fixtures import first_success, make_models
from bench.gpu import load_one
from bench.load import INFER, run_load, warm
from bench.metrics_cost import bench_metrics_cost, print_metrics_cost
from bench.sections import Run
from infercache.v1 import infercache_pb2 as pb
from harness.servers import REPO, ServerProcess


def bench_hits(server: ServerProcess, baselines: dict[str, str], texts: list[str], rounds: int, scale: float) -> dict:
    """Rounds alternate the baselines (echo: parses and serializes a message; raw_bytes: the floor of gRPC)
    and infercache at 1 and 32 callers; medians over rounds, ratios against each baseline. Then one more
    run at 32 callers for the frontends' CPU per hit and where it goes (py-spy, where installed)."""
    requests = [pb.InferRequest(model="minilm", text=t) for t in texts[:200]]
    warm(server.address, requests)
    plan = {1: int(3000 * scale), 32: int(20000 * scale)}
    addresses = {**baselines, "infercache": server.address}
    runs: dict[str, dict[int, list[dict]]] = {name: {1: [], 32: []} for name in addresses}
    for _ in range(rounds):
        for name, address in addresses.items():
            for concurrency, total in plan.items():
                asyncio.run(run_load(address, requests, concurrency=concurrency, total=total // 10))  # warm-up
                result = asyncio.run(run_load(address, requests, concurrency=concurrency, total=total))
                assert result.errors == 0, f"{name}: {result.errors} errors"
                if name == "infercache":
                    assert result.sources == {"RESULT_EXACT": result.requests}, result.sources
                runs[name][concurrency].append(result.summary())
    out = {}
    for concurrency in plan:
        row = {}
        for name in runs:
            samples = runs[name][concurrency]
            row[name] = {k: statistics.median(s[k] for s in samples) for k in ("p50_ms", "p99_ms", "throughput_rps")}
            row[name]["rounds"] = samples
        for name in baselines:
            row[f"p50_ratio_{name}"] = round(row["infercache"]["p50_ms"] / row[name]["p50_ms"], 3)
            row[f"throughput_ratio_{name}"] = round(row["infercache"]["throughput_rps"] / row[name]["throughput_rps"], 3)
        out[f"concurrency_{concurrency}"] = row
    out["cpu_per_hit"] = _cpu_per_hit(server, requests, plan[32])
    return out


def _cpu_per_hit(server: ServerProcess, requests: list[pb.InferRequest], total: int) -> dict:
    from bench.probes import measured

    row = measured(server, "minilm", lambda: _LoadRun(asyncio.run(run_load(server.address, requests, concurrency=32,
                                                                            total=total))), profile="frontend")
    frontend_s = row["cpu_cores_busy"]["frontend"] * row["seconds"]
    return {"frontend_cpu_us_per_hit": round(1e6 * frontend_s / row["requests"], 1), "hits": row["requests"],
            "throughput_rps": row["throughput_rps"], "frontend_profile": row.get("profile")}


class _LoadRun:
    """A LoadResult as bench.gpu.measured expects it (summary() with calls_per_s)."""

    def __init__(self, result) -> None:
        self.result = result

    def summary(self) -> dict:
        return {**self.result.summary(), "calls_per_s": self.result.summary()["throughput_rps"]}


def bench_misses(server: ServerProcess, texts: list[str], scale: float) -> dict:
    total = max(64, int(2000 * scale))
    out = {}
    for offset, model in enumerate(("minilm", "minilm-b1")):
        # Distinct, never-seen texts: every request is a real miss through the engine.
        chosen = texts[1000 + offset * total: 1000 + (offset + 1) * total]
        requests = [pb.InferRequest(model=model, text=t, cache=pb.CachePolicy(mode=pb.CachePolicy.NO_STORE))
                    for t in chosen]
        result = asyncio.run(run_load(server.address, requests, concurrency=32, total=len(requests)))
        assert result.errors == 0
        out[model] = result.summary()
    counters = server.stats().worker.counters
    batches = counters["batcher.minilm.1.batches"]
    out["mean_batch_size"] = round(counters["batcher.minilm.1.batched_requests"] / max(1, batches), 2)
    out["throughput_ratio"] = round(out["minilm"]["throughput_rps"] / out["minilm-b1"]["throughput_rps"], 2)
    return out


def bench_engine(texts: list[str], scale: float) -> dict:
    """The engine alone, in this process, with the servers stopped: batch 1 vs batches of 32 cut per
    bucket as the batcher cuts them. This is the ceiling of the server-level batching ratio."""
    from server.engines.onnxruntime import OrtEngine
    from server.shared.models import load_model
    from server.shared.tokenization import TextEncoder, pad_batch

    spec = load_model(REPO / "models" / "minilm")
    folder = spec.version_dir(spec.serving_version)
    encoder = TextEncoder(folder / "tokenizer.json", spec.max_tokens)
    engine = OrtEngine(folder / "model.onnx")
    sequences = [encoder.encode(t) for t in texts[: max(64, int(1024 * scale))]]
    by_bucket: dict[int, list] = {}
    for seq in sequences:
        by_bucket.setdefault(next(b for b in spec.buckets if len(seq) <= b), []).append(seq)
    plans = {
        "batch_1": [[s] for s in sequences],
        "batch_32": [group[i:i + 32] for group in by_bucket.values() for i in range(0, len(group), 32)],
    }
    out = {}
    for name, batches in plans.items():
        engine.run(pad_batch(batches[0], max(map(len, batches[0]))))
        started = time.perf_counter()
        for batch in batches:
            engine.run(pad_batch(batch, max(map(len, batch))))
        out[name] = {"sequences_per_s": round(len(sequences) / (time.perf_counter() - started), 1)}
    out["throughput_ratio"] = round(out["batch_32"]["sequences_per_s"] / out["batch_1"]["sequences_per_s"], 2)
    return out


def bench_startup(workdir: Path, models: Path, cache_dir: Path, texts: list[str], rounds: int) -> dict:
    hit = pb.InferRequest(model="minilm", text=texts[0], cache=pb.CachePolicy(mode=pb.CachePolicy.ONLY_IF_CACHED))
    samples = []
    for i in range(rounds):
        run_dir = workdir / f"start{i}"
        run_dir.mkdir()
        with ServerProcess(run_dir, models, cache_dir=cache_dir, engines_dir=workdir / "engines", wait=False) as server:
            to_hit = first_success(server.address, hit, server.started)
            miss = pb.InferRequest(model="minilm", text=f"a question nobody asked before {i} {time.time()}")
            to_miss = first_success(server.address, miss, server.started)
            server.wait_ready()
            assert server.stop() == 0
        samples.append({"first_hit_s": round(to_hit, 3), "first_miss_s": round(to_miss, 3)})
    return {
        "first_hit_s": statistics.median(s["first_hit_s"] for s in samples),
        "first_miss_s": statistics.median(s["first_miss_s"] for s in samples),
        "rounds": samples,
    }


def print_serving(report: dict) -> None:
    hits = report["exact_hits"]
    print("\nexact hits (median of rounds)      p50 ms    p99 ms   req/s")
    for key, row in hits.items():
        if not key.startswith("concurrency_"):
            continue
        for name in ("raw_bytes", "echo", "infercache"):
            r = row[name]
            print(f"  {key:<16} {name:<12} {r['p50_ms']:8.3f}  {r['p99_ms']:8.3f}  {r['throughput_rps']:7.0f}")
        for name in ("raw_bytes", "echo"):
            print(f"  {key:<16} vs {name:<9} {row[f'p50_ratio_{name}']:8.3f}x p50  "
                  f"{row[f'throughput_ratio_{name}']:.3f}x throughput")
    cpu = hits["cpu_per_hit"]
    print(f"  frontend CPU per hit: {cpu['frontend_cpu_us_per_hit']} us ({cpu['hits']} hits at 32 callers)")
    miss = report["misses"]
    print("\nmisses at 32 concurrent callers    req/s     p50 ms")
    for model in ("minilm", "minilm-b1"):
        print(f"  {model:<32} {miss[model]['throughput_rps']:7.1f}  {miss[model]['p50_ms']:8.1f}")
    print(f"  batcher vs max_batch_size 1: {miss['throughput_ratio']}x (target >= 3), "
          f"mean batch {miss['mean_batch_size']}")
    engine = report["engine_alone"]
    print(f"  engine alone (ceiling): batch 1 {engine['batch_1']['sequences_per_s']} seq/s, "
          f"batch 32 {engine['batch_32']['sequences_per_s']} seq/s = {engine['throughput_ratio']}x")
    print_metrics_cost(report["metrics_cost"])
    start = report["startup"]
    print(f"\nstart-up: first hit {start['first_hit_s']} s (target <= 1.5), first miss {start['first_miss_s']} s")


def section(run: Run) -> None:
    report, workdir, texts, rounds, scale = run.report, run.workdir, run.texts, run.rounds, run.scale
    models = make_models(workdir / "serving-models", unbatched=True)  # (minilm-b1: the no-batching baseline)
    (workdir / "main").mkdir()
    server = ServerProcess(workdir / "main", models, frontends=multiprocessing.cpu_count(),
                           engines_dir=workdir / "engines")
    warm(server.address, [pb.InferRequest(model="minilm", text=texts[0])])
    recorded_hit = load_one(server.address, pb.InferRequest(model="minilm", text=texts[0]).SerializeToString())
    echo_address, echo_procs = echo.start(multiprocessing.cpu_count())
    raw_address, raw_procs = echo.start(multiprocessing.cpu_count(), echo.raw_main, INFER, recorded_hit)
    try:
        print("benchmarking exact hits ...", flush=True)
        report["exact_hits"] = bench_hits(server, {"raw_bytes": raw_address, "echo": echo_address}, texts, rounds,
                                          scale)
        print("benchmarking misses ...", flush=True)
        report["misses"] = bench_misses(server, texts, scale)
    finally:
        echo.stop(echo_procs + raw_procs)
        assert server.stop() == 0
    print("benchmarking /metrics on vs off on exact hits ...", flush=True)
    report["metrics_cost"] = bench_metrics_cost(workdir / "metrics", texts, rounds, scale)
    print("benchmarking the engine alone ...", flush=True)
    report["engine_alone"] = bench_engine(texts, scale)
    print("benchmarking start-up ...", flush=True)
    report["startup"] = bench_startup(workdir, models, server.cache_dir, texts, rounds)
    print_serving(report)

