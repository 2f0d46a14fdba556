"""Foundation benchmark (`make bench`; `make bench ARGS=--quick` for a short run).

1. Exact hits: p50/p99 latency and throughput at concurrency 1 and 32, against a bare grpc.aio echo
   server with the same client, the same process count and the same response size. Rounds alternate
   echo / infercache; the reported figure is the median over rounds.
2. Misses: throughput at 32 concurrent callers with the batcher vs max_batch_size 1 (same server,
   same weights, two model names).
3. Start-up: process start to the first served hit (warm store) and to the first served miss.
4. L3 engine store: cold (build) vs warm (find, verify, load) for ONNX Runtime, TensorRT(-RTX) and the
   whole server's start to ready.
Writes bench/results/foundation.json and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import multiprocessing
import platform
import statistics
import tempfile
import time
from pathlib import Path

import grpc

from bench import BANKING77, RESULTS, echo
from bench.engines import bench_l3, print_l3
from bench.gpu import PARTS, bench_gpu, print_gpu
from bench.workers import bench_workers, print_workers
from bench.semantic import bench_eval, bench_rebuild, print_semantic
from bench.load import run_load
from infercache.testing import REPO, ServerProcess
from infercache.v1 import infercache_pb2 as pb
from infercache.v1 import infercache_pb2_grpc



def load_texts() -> list[str]:
    if BANKING77.is_file():
        with open(BANKING77, newline="") as f:
            return [row["text"] for row in csv.DictReader(f)]
    return [f"customer question number {i} about cards, refunds and transfers" for i in range(10_000)]


def make_models(root: Path) -> Path:
    """minilm as shipped, and minilm-b1: the same weights with max_batch_size 1 (the no-batching baseline)."""
    source = REPO / "models" / "minilm"
    for name, batch in (("minilm", None), ("minilm-b1", 1)):
        (root / name).mkdir(parents=True)
        config = (source / "config.yaml").read_text()
        if batch is not None:
            config = config.replace("max_batch_size: 32", f"max_batch_size: {batch}")
        (root / name / "config.yaml").write_text(config)
        (root / name / "1").symlink_to(source / "1")
    return root


def warm(address: str, requests: list[pb.InferRequest]) -> None:
    with grpc.insecure_channel(address) as channel:
        stub = infercache_pb2_grpc.InferenceCacheStub(channel)
        for request in requests:
            stub.Infer(request, timeout=30)
        deadline = time.monotonic() + 30
        for request in requests:  # until the write-behind has committed every entry
            cached = pb.InferRequest()
            cached.CopyFrom(request)
            cached.cache.mode = pb.CachePolicy.ONLY_IF_CACHED
            while True:
                try:
                    stub.Infer(cached, timeout=30)
                    break
                except grpc.RpcError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.01)


def bench_hits(server: ServerProcess, echo_address: str, texts: list[str], rounds: int, scale: float) -> dict:
    requests = [pb.InferRequest(model="minilm", text=t) for t in texts[:200]]
    warm(server.address, requests)
    plan = {1: int(3000 * scale), 32: int(20000 * scale)}
    runs: dict[str, dict[int, list[dict]]] = {"echo": {1: [], 32: []}, "infercache": {1: [], 32: []}}
    for _ in range(rounds):
        for name, address in (("echo", echo_address), ("infercache", server.address)):
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
        row["p50_ratio"] = round(row["infercache"]["p50_ms"] / row["echo"]["p50_ms"], 3)
        row["throughput_ratio"] = round(row["infercache"]["throughput_rps"] / row["echo"]["throughput_rps"], 3)
        out[f"concurrency_{concurrency}"] = row
    return out


def bench_misses(server: ServerProcess, texts: list[str], scale: float) -> dict:
    total = max(200, int(2000 * scale))
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
    from server.models import load_model
    from server.tokenization import TextEncoder, pad_batch

    spec = load_model(REPO / "models" / "minilm")
    folder = spec.version_dir(spec.serving_version)
    encoder = TextEncoder(folder / "tokenizer.json", spec.max_tokens)
    engine = OrtEngine(folder / "model.onnx")
    sequences = [encoder.encode(t) for t in texts[: max(256, int(1024 * scale))]]
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


def first_success(address: str, request: pb.InferRequest, started: float, timeout: float = 120,
                  server: ServerProcess | None = None) -> float:
    """Seconds from `started` until `request` succeeds (polling every 5 ms on fresh connections)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server is not None and server.proc.poll() is not None:
            raise RuntimeError(f"server exited with {server.proc.returncode}:\n{server.log_text()[-3000:]}")
        with grpc.insecure_channel(address) as channel:
            try:
                infercache_pb2_grpc.InferenceCacheStub(channel).Infer(request, timeout=5)
                return time.monotonic() - started
            except grpc.RpcError:
                pass
        time.sleep(0.005)
    raise TimeoutError(f"no answer within {timeout} s")


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


def print_table(report: dict) -> None:
    hits = report["exact_hits"]
    print("\nexact hits (median of rounds)      p50 ms    p99 ms   req/s")
    for key, row in hits.items():
        for name in ("echo", "infercache"):
            r = row[name]
            print(f"  {key:<16} {name:<12} {r['p50_ms']:8.3f}  {r['p99_ms']:8.3f}  {r['throughput_rps']:7.0f}")
        print(f"  {key:<16} ratio        {row['p50_ratio']:8.3f}x p50 (target <= 1.3)  "
              f"{row['throughput_ratio']:.3f}x throughput")
    miss = report["misses"]
    print("\nmisses at 32 concurrent callers    req/s     p50 ms")
    for model in ("minilm", "minilm-b1"):
        print(f"  {model:<32} {miss[model]['throughput_rps']:7.1f}  {miss[model]['p50_ms']:8.1f}")
    print(f"  batcher vs max_batch_size 1: {miss['throughput_ratio']}x (target >= 3), "
          f"mean batch {miss['mean_batch_size']}")
    engine = report["engine_alone"]
    print(f"  engine alone (ceiling): batch 1 {engine['batch_1']['sequences_per_s']} seq/s, "
          f"batch 32 {engine['batch_32']['sequences_per_s']} seq/s = {engine['throughput_ratio']}x")
    start = report["startup"]
    print(f"\nstart-up: first hit {start['first_hit_s']} s (target <= 1.5), first miss {start['first_miss_s']} s")


def run_serving(report: dict, workdir: Path, models: Path, texts: list[str], rounds: int, scale: float) -> None:
    (workdir / "main").mkdir()
    server = ServerProcess(workdir / "main", models, frontends=multiprocessing.cpu_count(),
                           engines_dir=workdir / "engines")
    echo_address, echo_procs = echo.start(multiprocessing.cpu_count())
    try:
        print("benchmarking exact hits ...", flush=True)
        report["exact_hits"] = bench_hits(server, echo_address, texts, rounds, scale)
        print("benchmarking misses ...", flush=True)
        report["misses"] = bench_misses(server, texts, scale)
    finally:
        echo.stop(echo_procs)
        assert server.stop() == 0
    print("benchmarking the engine alone ...", flush=True)
    report["engine_alone"] = bench_engine(texts, scale)
    print("benchmarking start-up ...", flush=True)
    report["startup"] = bench_startup(workdir, models, server.cache_dir, texts, rounds)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench")
    parser.add_argument("--quick", action="store_true", help="fewer requests and rounds (a smoke run)")
    parser.add_argument("--out", default=str(RESULTS / "foundation.json"))
    parser.add_argument("--sections", default="serving,l3,semantic",
                        help="comma-separated: serving (hits, misses, start-up), l3, semantic, gpu and workers (the "
                             "lent GPU host: bench/device.sh; elsewhere dry runs on ONNX Runtime)")
    parser.add_argument("--gpu-parts", default=",".join(PARTS),
                        help=f"gpu section steps, comma-separated (default all: {','.join(PARTS)})")
    args = parser.parse_args()
    sections = set(args.sections.split(","))
    scale, rounds = (0.2, 1) if args.quick else (1.0, 3)
    texts = load_texts()
    report: dict = {"machine": {"cpus": multiprocessing.cpu_count(), "python": platform.python_version()},
                    "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    with tempfile.TemporaryDirectory(prefix="infercache-bench-") as tmp:
        workdir = Path(tmp)
        models = make_models(workdir / "models")
        if "serving" in sections:
            run_serving(report, workdir, models, texts, rounds, scale)
        if "l3" in sections:
            print("benchmarking the L3 engine store ...", flush=True)
            report["l3_engines"] = bench_l3(workdir, models, rounds)
        if "semantic" in sections:
            print("benchmarking the semantic tier (Banking77 cross-validation, index rebuild) ...", flush=True)
            report["semantic"] = {
                "eval": bench_eval(models, workdir, folds=5 if not args.quick else 2,
                                   limit=None if not args.quick else 2000),
                "rebuild": bench_rebuild(models, workdir, 100_000 if not args.quick else 10_000),
            }
        if "workers" in sections:
            print("benchmarking one worker against two, and a kill -9 of one ...", flush=True)
            report["workers"] = {}
            bench_workers(workdir, texts, report["workers"], quick=args.quick,
                          checkpoint=lambda: Path(args.out).write_text(json.dumps(report, indent=2)))
        if "gpu" in sections:
            print("benchmarking the GPU path ...", flush=True)
            # Written after each step too: a run cut short by the device's time limit keeps what it measured.
            report["gpu"] = {}
            bench_gpu(workdir, texts, report["gpu"], quick=args.quick, parts=tuple(args.gpu_parts.split(",")),
                      checkpoint=lambda: Path(args.out).write_text(json.dumps(report, indent=2)))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    if "exact_hits" in report:
        print_table(report)
    if "l3_engines" in report:
        print_l3(report["l3_engines"])
    if "semantic" in report:
        print_semantic(report["semantic"])
    if "gpu" in report:
        print_gpu(report["gpu"])
    if "workers" in report:
        print_workers(report["workers"])
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
