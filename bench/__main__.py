"""Foundation benchmark (`make bench`; `make bench ARGS=--quick` for a short run).

1. Exact hits: p50/p99 latency and throughput at concurrency 1 and 32, against two bare grpc.aio
   servers with the same client and process count: echo (parses the request, serializes a message of
   the same size) and raw bytes (a recorded hit's bytes, no protobuf work: the floor of gRPC). Rounds
   alternate; the reported figure is the median over rounds. Then the frontends' CPU per hit.
2. Misses: throughput at 32 concurrent callers with the batcher vs max_batch_size 1 (same server,
   same weights, two model names).
3. Start-up: process start to the first served hit (warm store) and to the first served miss.
   Also in the serving section: /metrics on (scraped by a real Prometheus) vs off on exact hits
   (bench/metrics_cost.py).
4. L3 engine store: cold (build) vs warm (find, verify, load) for ONNX Runtime, TensorRT(-RTX) and the
   whole server's start to ready.
5. Security (`--sections security`, bench/security.py): exact hits with auth + encryption + redaction
   on vs all off, and redaction's cost per Banking77 text.
6. Fleet (`--sections fleet`, bench/fleet.py): L1 hit, fleet hit and miss on a second pod sharing one
   Redis, and the Redis round trip alone.
7. Overload (`--sections overload`, bench/overload.py): 3,000 misses at once against one worker: status
   codes, how fast refusals come, and whether admitted calls finish.
8. Feature tier (`--sections l2`, bench/l2.py): a Banking77 head's misses against the same weights as one
   graph, a head version bump, FEATURE latency; on a GPU host the device LRU's cost per batch.
9. Worker capacity (`--sections worker`, bench/worker_capacity.py): items straight to one worker's socket,
   null engine, with every answer written behind against none.
10. Length groups (`--sections groups`, bench/length_groups.py): minilm misses on ONNX Runtime with batches
   cut by length group against by bucket (`server.length_groups=false`), two servers, rounds alternating.
11. Synonyms (`--sections synonyms`, bench/synonyms.py): exact hit rate on Banking77 with and without a
   synonym dictionary mined from it, and the normalizer's cost per text.
12. Doors (`--sections doors`, bench/doors.py): exact hits through the OpenAI-compatible HTTP door against a
   bare server of its stack, through the KServe v2 door against the native door, and the bare HTTP stacks.
13. TTL classes and expiry jitter (`--sections ttl`, bench/ttl.py): exact hits for requests that pick a TTL
   class against the model's default, the store writer's cost per put with the per-class counts against
   without, and how far expiry jitter spreads entries written together (L1 and the fleet) against none.
14. Write path (`--sections write`, bench/write_path.py): the writer process's sustained commit rate with a
   flush per commit against the flush interval, beside py-lmdb's own ceiling and L1 hits while it writes.
15. Upstream (`--sections upstream`, bench/upstream.py): infercache in front of an upstream OpenAI-compatible
   server against LiteLLM's proxy with its exact cache on Redis: hits, identical misses at once, a miss's
   overhead, the upstream down.
Writes one file per section to bench/results/, named for the section and the machine (`serving-2core.json`,
`gpu-h200.json`; `--out FILE` puts the whole run in one file instead), each recording its command, machine,
commit and date, and prints a table. `--quick` (fewer requests and rounds) and `--dry-run` (every step of
each section at its smallest: tests/test_bench_tools.py runs each section so) write to var/bench/ instead
(`serving-quick-2core.json`, `serving-dry-2core.json`), which git ignores: they replace no current figure.
Sections that read Banking77 (semantic, l2, groups) are skipped, with one line saying so, where
bench/data/banking77/train.csv is missing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import statistics
import tempfile
import time
from pathlib import Path

from bench import banking77_missing, echo, machine, recorded
from bench.sections import FILES, NEEDS_BANKING77, SECTIONS, result_path
from bench.l3 import bench_l3, print_l3
from bench.fixtures import first_success, load_texts
from bench.fleet import bench_fleet, print_fleet
from bench.l2 import bench_l2, print_l2
from bench.length_groups import bench_length_groups, print_length_groups
from bench.metrics_cost import bench_metrics_cost, print_metrics_cost
from bench.overload import bench_overload, print_overload
from bench.gpu import ALTERNATING_ROUNDS, PARTS, bench_gpu, load_one, print_gpu
from bench.group_commit import bench_group_commit, print_group_commit
from bench.workers import bench_workers, print_workers
from bench.worker_capacity import bench_worker_capacity, print_worker_capacity
from bench.security import bench_hit_path, bench_redaction, print_security
from bench.semantic import bench_eval, bench_hit_latency, bench_rebuild, print_semantic, train_banking77
from bench.shadow import bench_shadow, print_shadow
from bench.load import INFER, run_load, warm
from tests.servers import REPO, ServerProcess
from infercache.v1 import infercache_pb2 as pb


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


def print_table(report: dict) -> None:
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


def run_serving(report: dict, workdir: Path, models: Path, texts: list[str], rounds: int, scale: float) -> None:
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


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench")
    parser.add_argument("--quick", action="store_true",
                        help="fewer requests and rounds (a smoke run); files to var/bench/, not bench/results/")
    parser.add_argument("--dry-run", action="store_true",
                        help="each section's every step at its smallest (the tests run it); files to var/bench/")
    parser.add_argument("--write-baseline", default="", metavar="REF",
                        help="the write section also runs the store writer of this commit, in the same rounds")
    parser.add_argument("--out", default="",
                        help="one file for the whole run (default: bench/results/<section>-<machine>.json per section)")
    parser.add_argument("--sections", default="serving,l3,semantic",
                        help="comma-separated: serving (hits, misses, /metrics cost, start-up; metrics: that part "
                             "alone), l3, semantic, security, fleet, overload, l2, groups (batches by length group vs "
                             "by bucket), worker (one worker's capacity), "
                             "commit (the writer's CPU per put by group-commit window), write (the writer's "
                             "sustained rate against LMDB's ceiling, by flush setting), synonyms (exact hits with a "
                             "synonym dictionary), generate (SmolLM2 misses "
                             "and hits; on a GPU host the torch decoder against its raw loop), prefix (the prefix cache "
                             "against computing the prompt), doors (hits through the OpenAI and KServe doors), ttl (TTL "
                             "classes' cost, expiry jitter's spread), generate-semantic (semantic answers of "
                             "SmolLM2 on Banking77 against GPTCache), peers (exact hits against Triton's response "
                             "cache, semantic hits against GPTCache), upstream (in front of an upstream server "
                             "against LiteLLM's proxy cache), gpu and "
                             "workers (the lent GPU host: bench/device.sh; elsewhere dry runs on ONNX Runtime)")
    parser.add_argument("--rounds", type=int, default=0,
                        help="rounds of the repeated measurements (default 3, 1 with --quick; security runs 2n-1)")
    parser.add_argument("--gpu-parts", default=",".join(PARTS),
                        help=f"gpu section steps, comma-separated (default all: {','.join(PARTS)})")
    parser.add_argument("--prefix-parts", default="tiers,reuse",
                        help="prefix section on a GPU host, parts comma-separated: tiers (TTFT by tier), reuse (no "
                             "reuse and conversations, two 8B models: an H200's memory)")
    parser.add_argument("--peers-parts", default="hits,semantic",
                        help="peers section parts, comma-separated: hits (exact hits against Triton's response "
                             "cache), semantic (semantic hits against GPTCache), infinity (misses against infinity: "
                             "the lent GPU, bench/device.sh; elsewhere a dry run on the CPU)")
    parser.add_argument("--gpu-workers", default="1",
                        help="gpu section: worker processes sharing the GPU, comma-separated; the first serves every "
                             "step, the others repeat the MiniLM runs (e.g. 1,2,4)")
    parser.add_argument("--gpu-callers", default="2",
                        help="gpu section, part callers: multiples of the calls in flight to run again, comma-separated")
    parser.add_argument("--overload-deadline", type=float, default=10.0,
                        help="overload section: each call's deadline in seconds (0.5 on a GPU host: an overload there)")
    parser.add_argument("--overload-settings", default="",
                        help="overload section: the server's settings, comma-separated key=value (e.g. "
                             "engines.runtime=onnxruntime,server.engine_threads=4: a CPU-bound model on a GPU host)")
    parser.add_argument("--l2-settings", default="",
                        help="l2 section: the servers' settings, comma-separated key=value (e.g. "
                             "engines.runtime=onnxruntime,server.engine_threads=8: the CPU path on a GPU host)")
    parser.add_argument("--load-generator", choices=("native", "python"), default="native",
                        help="l2 section: its callers, C++ (bench/native/loadgen.cc, where gRPC's C++ library is "
                             "installed; else Python) or Python (grpc.aio)")
    parser.add_argument("--generate-models", default="llama3-8b,smollm2-135m",
                        help="generate section on a GPU host: the random-weight model shapes, comma-separated")
    args = parser.parse_args()
    for option, value, known in (("--peers-parts", args.peers_parts, {"hits", "semantic", "infinity"}),
                                 ("--prefix-parts", args.prefix_parts, {"tiers", "reuse"})):
        if set(value.split(",")) - known:
            parser.error(f"{option}: {sorted(set(value.split(',')) - known)} unknown; the parts are {sorted(known)}")
    sections = set(args.sections.split(","))
    if sections - set(SECTIONS):
        parser.error(f"--sections: {sorted(sections - set(SECTIONS))} unknown; the sections are {', '.join(SECTIONS)}")
    missing = banking77_missing()
    for name in sorted(sections & NEEDS_BANKING77) if missing else ():
        print(f"skipping section {name}: {missing}", flush=True)
    if missing:
        sections -= NEEDS_BANKING77
    args.quick = args.quick or args.dry_run
    scale, rounds = (0.02, 1) if args.dry_run else (0.2, 1) if args.quick else (1.0, 3)
    rounds = args.rounds or rounds
    texts = load_texts()
    report: dict = {"recorded": recorded("bench"), "machine": machine(),
                    "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    written: set[Path] = set()

    def save() -> None:  # after each section and step: a run cut short (a device lease) keeps what it measured
        files: dict[Path, dict] = {Path(args.out): report} if args.out else {}
        if not args.out:
            for key, stem in FILES.items():
                if key in report:
                    if key == "metrics_cost" and "serving" not in sections:
                        stem = "metrics-cost"
                    trial = "dry" if args.dry_run else "quick" if args.quick else ""
                    path = result_path(stem, report["machine"]["tag"], trial)
                    part = files.setdefault(path, {k: report[k] for k in ("recorded", "machine", "started")})
                    part[key] = report[key]
        for path, content in files.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(content, indent=2))
            written.add(path)

    with tempfile.TemporaryDirectory(prefix="infercache-bench-") as tmp:
        workdir = Path(tmp)
        models = make_models(workdir / "models")
        if "serving" in sections:
            run_serving(report, workdir, models, texts, rounds, scale)
        if "metrics" in sections and "serving" not in sections:  # the serving section's /metrics part alone
            print("benchmarking /metrics on vs off on exact hits ...", flush=True)
            report["metrics_cost"] = bench_metrics_cost(workdir / "metrics", texts, rounds, scale)
            print_metrics_cost(report["metrics_cost"])
        if "l3" in sections:
            print("benchmarking the L3 engine store ...", flush=True)
            report["l3_engines"] = bench_l3(workdir, models, rounds)
        if "semantic" in sections:
            print("benchmarking the semantic tier (Banking77 held-out and novel-label replays, index rebuild) ...", flush=True)
            # --quick and --dry-run train the head on the rows they replay (not on all 10,003) and start
            # fewer servers (one round of each pair)
            rows, entries = (300, 500) if args.dry_run else (2000, 10_000) if args.quick else (None, 100_000)
            if rows:
                train_banking77(models, limit=rows)
            paired = rounds if args.quick else max(2, rounds)
            report["semantic"] = {
                "eval": bench_eval(models, workdir, limit=rows),
                "rebuild": bench_rebuild(models, workdir, entries),
                "hit_latency": bench_hit_latency(models, workdir, paired, limit=rows or 5000),
                "shadow": bench_shadow(models, workdir, paired, limit=rows or 5000,
                                       misses=30 if args.dry_run else 150),
            }
        if "security" in sections:
            print("benchmarking auth + encryption + redaction on the hit path ...", flush=True)
            report["security"] = {
                "hit_path": bench_hit_path(workdir / "security", texts, 2 * rounds - 1, scale),
                "redaction": bench_redaction(texts),
            }
        if "fleet" in sections:
            print("benchmarking the fleet tier (two pods on one Redis) ...", flush=True)
            report["fleet"] = bench_fleet(workdir / "fleet", texts, scale)
        if "overload" in sections:
            print("benchmarking overload (misses at once against one worker) ...", flush=True)
            report["overload"] = bench_overload(workdir / "overload", texts, scale, args.overload_deadline,
                                                tuple(filter(None, args.overload_settings.split(","))))
            save()
        if "l2" in sections:
            from server.shared.devices import GPU_RUNTIMES, visible_gpus

            print("benchmarking the feature tier (L2) ...", flush=True)
            l2_settings = tuple(filter(None, args.l2_settings.split(",")))
            runtime = next((s.split("=", 1)[1] for s in l2_settings if s.startswith("engines.runtime=")), "auto")
            report["l2"] = {}
            bench_l2(workdir / "l2", rounds, args.quick, report["l2"], settings=l2_settings,
                     gpu=bool(visible_gpus()) and runtime in ("auto", *GPU_RUNTIMES), checkpoint=save,
                     generator=args.load_generator, dry=args.dry_run)
            save()
        if "groups" in sections:
            print("benchmarking batches by length group against by bucket (ONNX Runtime misses) ...", flush=True)
            report["length_groups"] = {}
            bench_length_groups(workdir / "groups", rounds, args.quick, report["length_groups"], checkpoint=save)
            save()
        if "worker" in sections:
            print("benchmarking one worker's capacity (items straight to its socket) ...", flush=True)
            from bench.probes import gpu_available

            seconds = 0.5 if args.dry_run else 2.0 if args.quick else 5.0
            report["worker_capacity"] = bench_worker_capacity(workdir / "worker", seconds,
                                                              ("null", "torch-cuda") if gpu_available() else ("null",))
        if "generate" in sections:
            from bench.probes import gpu_available

            if gpu_available():
                from bench.generate_gpu import bench_generate_gpu, print_generate_gpu

                print("benchmarking generation on the GPU (the server against the engine's raw decode loop) ...",
                      flush=True)
                report["generate"] = {}
                bench_generate_gpu(workdir / "generate", rounds, args.quick, tuple(args.generate_models.split(",")),
                                   report=report["generate"], checkpoint=save)
                print_generate_gpu(report["generate"])
            else:
                from bench.generate import bench_generate, print_generate

                print("benchmarking generation (SmolLM2: misses against transformers' generate, hits) ...", flush=True)
                report["generate"] = bench_generate(workdir / "generate", texts, rounds, args.quick,
                                                    **({"new_tokens": 8} if args.dry_run else {}))
                print_generate(report["generate"])
            save()
        if "prefix" in sections:
            from bench.prefix import bench_prefix_cpu, bench_prefix_gpu, print_prefix
            from bench.probes import gpu_available

            print("benchmarking the prefix cache ...", flush=True)
            if gpu_available():
                report["prefix"] = {}
                bench_prefix_gpu(workdir / "prefix", rounds, args.quick, report["prefix"], checkpoint=save,
                                 parts=tuple(args.prefix_parts.split(",")))
            else:
                report["prefix"] = bench_prefix_cpu(workdir / "prefix", rounds, args.quick)
            print_prefix(report["prefix"])
            save()
        if "synonyms" in sections:
            from bench.synonyms import bench_synonyms, print_synonyms

            print("benchmarking synonym dictionaries (Banking77 exact hits, the normalizer's cost) ...", flush=True)
            report["synonyms"] = bench_synonyms(rounds)
            print_synonyms(report["synonyms"])
            save()
        if "doors" in sections:
            from bench.doors import bench_doors, print_doors

            print("benchmarking the doors (OpenAI-compatible HTTP, KServe v2) on exact hits ...", flush=True)
            (workdir / "doors").mkdir()
            report["doors"] = bench_doors(workdir / "doors", texts, rounds, args.quick)
            print_doors(report["doors"])
            save()
        if "ttl" in sections:
            from bench.ttl import bench_ttl, print_ttl

            print("benchmarking TTL classes and expiry jitter ...", flush=True)
            report["ttl"] = {}
            bench_ttl(workdir / "ttl", texts, rounds, scale, report["ttl"], checkpoint=save)
            print_ttl(report["ttl"])
            save()
        if "generate-semantic" in sections:
            from bench.generate_semantic import bench_generate_semantic, print_generate_semantic

            print("benchmarking semantic answers for generated text against GPTCache (Banking77, SmolLM2) ...",
                  flush=True)
            (workdir / "generate-semantic").mkdir()
            dry = {"rows": 100, "latency_calls": 2, "judge_limit": 500} if args.dry_run else {}
            report["generate_semantic"] = bench_generate_semantic(workdir / "generate-semantic",
                                                                  args.quick and not args.dry_run, **dry)
            print_generate_semantic(report["generate_semantic"])
            save()
        if "peers" in sections:
            peer_parts = set(args.peers_parts.split(","))
            report["peers"] = {}
            if "hits" in peer_parts:
                from bench.peers_hits import bench_peers_hits, print_peers_hits

                print("benchmarking exact hits against Triton's response cache ...", flush=True)
                report["peers"]["hits"] = bench_peers_hits(workdir / "peers-hits", texts, rounds, args.quick,
                                                           dry=args.dry_run)
                print_peers_hits(report["peers"]["hits"])
                save()
            if "infinity" in peer_parts:
                from bench.peers_infinity import bench_peers_infinity, minilm_source, print_peers_infinity

                print("benchmarking misses against infinity ...", flush=True)
                report["peers"]["infinity"] = bench_peers_infinity(workdir / "peers-infinity", texts, minilm_source(),
                                                                   max(2, rounds), args.quick)
                print_peers_infinity(report["peers"]["infinity"])
                save()
            if "semantic" in peer_parts:
                from bench.peers import bench_peers_semantic, print_peers

                print("benchmarking semantic hits against GPTCache (Banking77) ...", flush=True)
                report["peers"]["semantic"] = bench_peers_semantic(models, workdir / "peers", args.quick,
                                                                   dry=args.dry_run)
                print_peers(report["peers"])
                save()
        if "upstream" in sections:
            from bench.upstream import bench_upstream, print_upstream

            print("benchmarking infercache in front of an upstream server against LiteLLM's proxy cache ...", flush=True)
            (workdir / "upstream").mkdir()
            report["upstream"] = bench_upstream(workdir / "upstream", rounds,
                                                "dry" if args.dry_run else "quick" if args.quick else "full")
            print_upstream(report["upstream"])
            save()
        if "commit" in sections:
            print("benchmarking group commit (the writer process at paced put rates) ...", flush=True)
            (workdir / "commit").mkdir()
            report["group_commit"] = bench_group_commit(workdir / "commit", rounds,
                                                        0.5 if args.dry_run else 2.0 if args.quick else 5.0)
            print_group_commit(report["group_commit"])
            save()
        if "write" in sections:
            from bench.write_path import bench_write_path, print_write_path

            print("benchmarking the write path (the writer process flat out, against py-lmdb's ceiling) ...", flush=True)
            (workdir / "write").mkdir()
            report["write_path"] = bench_write_path(workdir / "write", rounds, args.quick, baseline=args.write_baseline)
            print_write_path(report["write_path"])
            save()
        if "workers" in sections:
            print("benchmarking one worker against two, and a kill -9 of one ...", flush=True)
            report["workers"] = {}
            bench_workers(workdir, texts, report["workers"], quick=args.quick, checkpoint=save,
                          seconds=0.5 if args.dry_run else None)
        if "gpu" in sections:
            print("benchmarking the GPU path ...", flush=True)
            report["gpu"] = {}
            bench_gpu(workdir, texts, report["gpu"], quick=args.quick, parts=tuple(args.gpu_parts.split(",")),
                      workers=tuple(int(n) for n in args.gpu_workers.split(",")),
                      callers=tuple(int(n) for n in args.gpu_callers.split(",")),
                      rounds=args.rounds or (1 if args.dry_run else ALTERNATING_ROUNDS), checkpoint=save,
                      seconds=0.5 if args.dry_run else None)
    save()
    if "exact_hits" in report:
        print_table(report)
    if "l3_engines" in report:
        print_l3(report["l3_engines"])
    if "semantic" in report:
        print_semantic(report["semantic"])
        print_shadow(report["semantic"]["shadow"])
    if "security" in report:
        print_security(report["security"])
    if "fleet" in report:
        print_fleet(report["fleet"])
    if "overload" in report:
        print_overload(report["overload"])
    if "l2" in report:
        print_l2(report["l2"])
    if "length_groups" in report:
        print_length_groups(report["length_groups"])
    if "gpu" in report:
        print_gpu(report["gpu"])
    if "workers" in report:
        print_workers(report["workers"])
    if "worker_capacity" in report:
        print_worker_capacity(report["worker_capacity"])
    print("\nwrote " + (", ".join(str(p) for p in sorted(written)) or "nothing"))


if __name__ == "__main__":
    main()
