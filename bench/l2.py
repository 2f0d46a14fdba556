"""Feature tier (L2) benchmark (`make bench ARGS="--sections l2"`).

A Banking77 classifier trained by train-head (a head on minilm), served beside the same weights as one
ONNX graph of encoder + head (`--whole-graph`: the format before L2), by one server.
1. Miss throughput at 32 callers, head against whole graph, rounds alternating. Every call is a real
   miss: distinct texts, a fresh tenant per round (nothing in L1, L2 or the semantic index for it), and
   semantic lookup off for the call (the result is still embedded and indexed, as train-head configures
   the model). The whole graph runs the encoder twice per miss (once as the semantic embedder, once
   inside its graph), the head once.
2. Head version bump: every distinct Banking77 text through version 1 (misses), then through version 2
   (the same encoder; here the same head weights, a new version as a retrained head would be), both at 32
   callers: the second pass's time over the first's.
3. One caller: FEATURE answers' p50 against exact hits and misses of the same texts. FEATURE answers are
   made in the frontends; a second server of the run with heads run by the workers only
   (l2.frontend_head_mb=0) gives the same figures, and a bump of 2,000 texts, for comparison.
4. On a GPU host (the worker on torch-cuda): the device LRU's cost per batch of 32 lookups with and
   without the head, measured in this process on the same GPU, and FEATURE throughput at 32 and 256 callers.

The callers are the C++ load generator (bench/native/loadgen.cc) where gRPC's C++ library is installed:
on 2 cores the Python one's own CPU per call (about 0.8 ms) came from the cores the server runs on, the
same in both paths, which pulls the ratio of step 1 towards 1 (`--load-generator python` runs it).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import statistics
import time
from pathlib import Path

import numpy as np

from bench import BANKING77
from bench.load import run_each_once
from bench.native_load import loadgen, run_each_once_native
from bench.sections import Run
from harness.servers import REPO, ServerProcess
from infercache.v1 import infercache_pb2 as pb
from server.shared.normalize import Normalizer

CALLERS = 32
LOAD_PROCESSES = max(1, (os.cpu_count() or 1) // 4)  # one on a small machine; enough not to set the pace on 16 cores
_native: Path | None = None  # the C++ load generator where bench_l2 chose it and it built (bench/native_load.py)


def make_models(root: Path, progress=print, rows: int | None = None) -> tuple[str, str]:
    """minilm, banking77 (a head, versions 1 and 2, trained on every row or the first `rows`) and
    banking77-graph (the same weights in one graph)."""
    from server.shared.models import HEAD_WEIGHTS_FILE, LABELS_FILE, MODEL_FILE, TOKENIZER_FILE
    from server.tools.train_head import compose, torch_source_with_head, train

    (root / "minilm").mkdir(parents=True)
    shutil.copy(REPO / "models" / "minilm" / "config.yaml", root / "minilm" / "config.yaml")
    encoder = REPO / "models" / "minilm" / "1"
    (root / "minilm" / "1").symlink_to(encoder)
    head = train(BANKING77, text_column="text", label_column="category", models_dir=root, encoder="minilm",
                 name="banking77", limit=rows, progress=progress)
    (root / "banking77" / "2").symlink_to(head)
    graph = root / "banking77-graph" / "1"
    graph.mkdir(parents=True)
    with np.load(head / HEAD_WEIGHTS_FILE) as weights:
        w, b = weights["weight"], weights["bias"]
    compose(encoder / MODEL_FILE, w, b, graph / MODEL_FILE)
    torch_source_with_head(encoder, graph, w, b, progress)  # the GPU runtime's form, where torch is here
    for name in (TOKENIZER_FILE, LABELS_FILE):
        shutil.copy(head / name, graph / name)
    shutil.copy(root / "banking77" / "config.yaml", root / "banking77-graph" / "config.yaml")
    return "banking77", "banking77-graph"


def distinct_texts() -> list[str]:
    import csv

    normalize, seen, out = Normalizer(), set(), []
    with open(BANKING77, newline="") as f:
        for row in csv.DictReader(f):
            key = normalize(row["text"])
            if key not in seen:
                seen.add(key)
                out.append(row["text"])
    return out


def _requests(model: str, texts: list[str], tenant: str, version: str = "") -> list[pb.InferRequest]:
    return [pb.InferRequest(model=model, version=version, text=t, tenant=tenant,
                            semantic=pb.SemanticPolicy(enabled=False)) for t in texts]


def _run(server: ServerProcess, requests: list[pb.InferRequest], concurrency: int = CALLERS) -> dict:
    if _native is not None:
        result = run_each_once_native(_native, server.address, requests, concurrency=concurrency, timeout=120)
    else:
        result = run_each_once(server.address, requests, concurrency=concurrency, processes=LOAD_PROCESSES,
                               timeout=120)
    assert result.errors == 0, f"{result.errors} errors"
    return result.summary()


def _encoder_runs(server: ServerProcess, whole_graph: str | None = None) -> int:
    """Texts the encoder ran on: minilm's batcher, and a whole-graph model's own (its graph contains it)."""
    names = ["batcher.minilm.1.batched_requests"] + ([f"batcher.{whole_graph}.1.batched_requests"] if whole_graph else [])
    return sum(w.counters[name] for w in server.stats().workers for name in names)


def _copies(server: ServerProcess) -> int:
    """FEATURE answers the workers copied into L1 (a frontend's second answer for a text)."""
    return sum(w.counters.get("worker.copies", 0) for w in server.stats().workers)


def _settle(server: ServerProcess, timeout: float = 30.0) -> None:
    """Waits until the worker's writers and semantic index stop moving: what one run left behind (writes,
    fsyncs, index inserts) must not be measured in the next."""
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        now = tuple(sorted((k, v) for w in server.stats().workers for k, v in w.counters.items()
                           if k.endswith(("writer.writes", "writer.write_txns", "semantic.indexed"))))
        if now == last:
            return
        last = now
        time.sleep(0.3)


def bench_miss_throughput(server: ServerProcess, texts: list[str], rounds: int, per_round: int) -> dict:
    head, graph = "banking77", "banking77-graph"
    runs: dict[str, list[dict]] = {head: [], graph: []}
    for model in (head, graph):  # warm-up: the engines' first batches of each shape, the server's allocations
        _run(server, _requests(model, texts[-300:], "warm-up"))
    for n in range(rounds):
        chosen = texts[n * per_round:(n + 1) * per_round]  # both models, each in a tenant of its own
        for model in (head, graph) if n % 2 == 0 else (graph, head):
            _settle(server)
            before = _encoder_runs(server, graph)
            summary = _run(server, _requests(model, chosen, f"miss-{n}-{model}"))
            assert summary["sources"] == {"MISS": len(chosen)}, summary["sources"]
            summary["encoder_runs_per_miss"] = round((_encoder_runs(server, graph) - before) / len(chosen), 2)
            runs[model].append(summary)
    out = {}
    for model, samples in runs.items():
        out[model] = {k: statistics.median(s[k] for s in samples) for k in ("throughput_rps", "p50_ms", "p99_ms")}
        out[model]["rounds"] = samples
    out["texts_per_round"] = per_round
    out["ratio_by_round"] = [round(h["throughput_rps"] / g["throughput_rps"], 3)
                             for h, g in zip(runs[head], runs[graph])]
    out["throughput_ratio"] = round(out[head]["throughput_rps"] / out[graph]["throughput_rps"], 3)
    out["median_ratio_by_round"] = round(statistics.median(out["ratio_by_round"]), 3)  # each round's runs are adjacent
    return out


async def _batches(address: str, model: str, version: str, tenant: str, texts: list[str], per_call: int,
                   callers: int) -> dict:
    """InferBatch calls of `per_call` texts from `callers` concurrent callers: seconds, sources."""
    import grpc

    from infercache.v1 import infercache_pb2_grpc

    calls = [pb.InferBatchRequest(model=model, version=version, tenant=tenant, texts=texts[i:i + per_call],
                                  semantic=pb.SemanticPolicy(enabled=False))
             for i in range(0, len(texts), per_call)]
    pending = iter(calls)
    sources: dict[str, int] = {}
    async with grpc.aio.insecure_channel(address) as channel:
        stub = infercache_pb2_grpc.InferenceCacheStub(channel)

        async def caller() -> None:
            for request in pending:
                for result in (await stub.InferBatch(request, timeout=300)).results:
                    name = pb.CacheInfo.Source.Name(result.cache.source)
                    sources[name] = sources.get(name, 0) + 1

        started = time.perf_counter()
        await asyncio.gather(*(caller() for _ in range(callers)))
        seconds = time.perf_counter() - started
    return {"seconds": round(seconds, 3), "texts_per_s": round(len(texts) / seconds, 1), "sources": sources}


def bench_bump(server: ServerProcess, texts: list[str]) -> dict:
    """Every text through version 1, then version 2: one text per call (32 callers), and again in a fresh
    tenant with InferBatch calls of 32 texts (8 callers). A bump comes long after the texts were first
    answered: the second pass starts once the first's writes are done (_settle), not while they drain."""
    out: dict = {"texts": len(texts)}
    first = _run(server, _requests("banking77", texts, "bump", version="1"))
    assert first["sources"] == {"MISS": len(texts)}, first["sources"]
    _settle(server)
    second = _run(server, _requests("banking77", texts, "bump", version="2"))
    assert second["sources"] == {"FEATURE": len(texts)}, second["sources"]
    out["infer"] = {"first_pass": first, "second_pass": second,
                    "time_ratio": round(second["seconds"] / first["seconds"], 4)}
    passes = []
    for version in ("1", "2"):
        _settle(server)
        passes.append(asyncio.run(_batches(server.address, "banking77", version, "bump-batch", texts, 32, 8)))
    assert passes[0]["sources"] == {"MISS": len(texts)} and passes[1]["sources"] == {"FEATURE": len(texts)}, passes
    out["infer_batch"] = {"first_pass": passes[0], "second_pass": passes[1],
                          "time_ratio": round(passes[1]["seconds"] / passes[0]["seconds"], 4)}
    return out


# (label, version, the source every text must get): misses, then FEATURE answers (a frontend copies a
# text's second one into L1), then exact hits
FRONTEND_PASSES = (("miss", "1", "MISS"), ("feature", "2", "FEATURE"), ("feature_again", "2", "FEATURE"),
                   ("exact_hit", "2", "RESULT_EXACT"))
WORKER_PASSES = (("miss", "1", "MISS"), ("feature", "2", "FEATURE"), ("exact_hit", "2", "RESULT_EXACT"))  # stores each


def bench_latency(server: ServerProcess, texts: list[str], passes=FRONTEND_PASSES) -> dict:
    """One caller, the same texts in each of `passes`: each pass's summary, and FEATURE's p50 against an
    exact hit's and a miss's."""
    out = {}
    copies = _copies(server)
    for label, version, source in passes:
        _settle(server)  # (before the exact hits: the copies of FEATURE answers into L1 are written)
        requests = _requests("banking77", texts, "latency", version=version)
        summary = _run(server, requests, concurrency=1)
        assert summary["sources"] == {source: len(texts)}, summary["sources"]
        out[label] = summary
        # Each pass's one connection lands on any frontend (SO_REUSEPORT), and a frontend copies a text
        # into L1 at its own second FEATURE answer: again until one has (each frontend has seen them).
        for _ in range(server.frontends if label == "feature_again" else 0):
            if _copies(server) - copies >= len(texts):
                break
            _settle(server)
            _run(server, requests, concurrency=1)
    out["feature_p50_over_exact_hit"] = round(out["feature"]["p50_ms"] / out["exact_hit"]["p50_ms"], 3)
    out["feature_p50_over_miss"] = round(out["feature"]["p50_ms"] / out["miss"]["p50_ms"], 3)
    return out


def bench_worker_path(server: ServerProcess, texts: list[str], latency_texts: list[str]) -> dict:
    """The same FEATURE measurements with heads run by the workers only (l2.frontend_head_mb=0, every
    FEATURE answer a round trip to the worker, as before frontends answered them): the one-text bump
    over `texts` and the one-caller p50s, beside the frontends' figures of the same run."""
    first = _run(server, _requests("banking77", texts, "bump", version="1"))
    _settle(server)
    second = _run(server, _requests("banking77", texts, "bump", version="2"))
    assert second["sources"] == {"FEATURE": len(texts)}, second["sources"]
    latency = bench_latency(server, latency_texts, WORKER_PASSES)
    return {"texts": len(texts), "bump_infer_time_ratio": round(second["seconds"] / first["seconds"], 4),
            **{f"{label}_p50_ms": latency[label]["p50_ms"] for label, _, _ in WORKER_PASSES},
            "feature_p50_over_exact_hit": latency["feature_p50_over_exact_hit"]}


def bench_device_lru(dim: int = 384, classes: int = 77, entries: int = 100_000, batch: int = 32,
                     repeats: int = 2000) -> dict:
    """The GPU LRU per batch of `batch` features, with the device synchronized after each: the event
    loop's part (lookups that pin rows, and their release), the head thread's gather, the gather plus the
    head, inserts (copied in together), and for comparison the head on host features copied in."""
    return asyncio.run(_device_lru(dim, classes, entries, batch, repeats))


async def _device_lru(dim: int, classes: int, entries: int, batch: int, repeats: int) -> dict:
    import torch

    from cachestore.keys import Namespace
    from server.worker.store.feature_lru import FeatureLRU
    from server.worker.semantic.heads import _TorchHead

    lru = FeatureLRU(dim, "float16", 2 * entries * dim * 2, "cuda")  # room for all (slabs round down)
    rng = np.random.default_rng(0)
    ns = Namespace("t:bench", "minilm", "1")
    keys = [ns.ns_id + i.to_bytes(16, "big") for i in range(entries)]
    vectors = rng.standard_normal((entries, dim)).astype(np.float16)
    for start in range(0, entries, 1000):
        for i in range(start, min(entries, start + 1000)):
            lru.put(keys[i], vectors[i], ns)
        lru.flush()
    head = _TorchHead(rng.standard_normal((dim, classes)).astype(np.float32), np.zeros(classes, np.float32), "cuda")
    picks = rng.integers(0, entries, size=(repeats, batch))

    def timed(fn) -> float:
        for row in picks[:50]:
            fn(row)
        torch.cuda.synchronize()
        samples = []
        for row in picks:
            started = time.perf_counter()
            fn(row)
            torch.cuda.synchronize()
            samples.append(time.perf_counter() - started)
        return round(statistics.median(samples) * 1e6, 1)

    def looked_up(row):
        return [lru.get(keys[i], 1) for i in row]

    def released(handles) -> None:
        for handle in handles:
            lru.release(handle)

    fresh = iter(range(entries, entries + 60 * repeats))

    def insert(row) -> None:
        for _ in row:
            lru.put(ns.ns_id + next(fresh).to_bytes(16, "big"), vectors[0], ns)
        lru.flush()

    def gathered(row) -> None:
        handles = looked_up(row)
        lru.gather(handles)
        released(handles)

    def headed(row) -> None:
        handles = looked_up(row)
        head.run(handles)
        released(handles)

    host = [vectors[i] for i in range(batch)]
    return {
        "entries": entries, "batch": batch, "device": torch.cuda.get_device_name(),
        "loop_lookups_and_releases_us": timed(lambda row: released(looked_up(row))),
        "gather_us": timed(gathered),
        "gather_and_head_us": timed(headed),
        "head_on_host_features_us": timed(lambda row: head.run(host)),
        "inserts_us": timed(insert),
    }


def bench_l2(workdir: Path, rounds: int, quick: bool, out: dict, gpu: bool = False, settings: tuple[str, ...] = (),
             checkpoint=lambda: None, generator: str = "native", dry: bool = False) -> None:
    """Fills `out` step by step, calling checkpoint() after each (a run cut short keeps what it measured).
    `settings`: the servers' (both); `gpu`: the device-LRU and FEATURE-throughput parts too; `generator`:
    the load generator, native (C++, where it builds; else Python) or python; `quick` trains the head on
    the first 2,000 rows, `dry` on 300, and sends fewer texts."""
    global _native
    _native = loadgen() if generator == "native" else None
    out["load_generator"] = "C++ (bench/native/loadgen.cc)" if _native is not None else "Python (grpc.aio, uvloop)"
    workdir.mkdir(parents=True)
    print("  training the Banking77 head (train-head) ...", flush=True)
    make_models(workdir / "models", progress=lambda line: None, rows=300 if dry else 2000 if quick else None)
    texts = distinct_texts()
    texts_each = len(texts) - 300  # the last 300 warm the server up
    per_round = min(40 if dry else 300 if quick else 2000, texts_each // rounds)  # every round's texts distinct
    bump = texts[:200] if dry else texts[:2000] if quick else texts
    out["distinct_texts"] = len(texts)
    (workdir / "server").mkdir()
    frontends = os.cpu_count() or 1  # the server's default, one per CPU
    server = ServerProcess(workdir / "server", workdir / "models", frontends=frontends, engines_dir=workdir / "engines",
                           settings=settings)
    try:
        print("  miss throughput: head vs whole graph ...", flush=True)
        out["miss_throughput"] = bench_miss_throughput(server, texts, rounds, per_round)
        checkpoint()
        print(f"  head version bump over {len(bump)} texts ...", flush=True)
        out["version_bump"] = bench_bump(server, bump)
        checkpoint()
        print("  latency at one caller ...", flush=True)
        out["latency"] = bench_latency(server, texts[:300])
        checkpoint()
        if gpu:
            print("  FEATURE throughput ...", flush=True)
            out["feature_throughput"] = {}
            for callers in (32, 256):
                chosen = texts[(callers // 32) * 1000:(callers // 32) * 1000 + 2000]
                _run(server, _requests("banking77", chosen, f"ft-{callers}", version="1"), callers)
                summary = _run(server, _requests("banking77", chosen, f"ft-{callers}", version="2"), callers)
                assert summary["sources"] == {"FEATURE": len(chosen)}, summary["sources"]
                out["feature_throughput"][f"callers_{callers}"] = summary
                checkpoint()
        workers = server.stats().workers
        out["worker_counters"] = {k: v for w in workers for k, v in w.counters.items()
                                  if k.startswith(("worker.", "features."))}
        out["engines"] = [f"{e.model}/{e.version}: {e.runtime} {e.precision} {e.device}" for w in workers
                          for e in w.engines]
    finally:
        assert server.stop() == 0
    print("  the same with heads run by the workers only (l2.frontend_head_mb=0) ...", flush=True)
    (workdir / "server-workers-only").mkdir()
    with ServerProcess(workdir / "server-workers-only", workdir / "models", frontends=frontends, engines_dir=workdir / "engines",
                       settings=(*settings, "l2.frontend_head_mb=0")) as server:
        out["workers_only"] = bench_worker_path(server, bump[:2000], texts[:300])
        checkpoint()
        assert server.stop() == 0
    if gpu:
        print("  device LRU lookups ...", flush=True)
        out["device_lru"] = bench_device_lru()


def print_l2(result: dict) -> None:
    miss, bump, lat = result["miss_throughput"], result["version_bump"], result["latency"]
    head, graph = miss["banking77"], miss["banking77-graph"]
    print(f"\n## Feature tier (L2), load generator: {result['load_generator']}\n")
    print("| what | figure | baseline in the same run |\n| --- | --- | --- |")
    print(f"| classification misses at {CALLERS} callers, head on L2 vs whole graph | {head['throughput_rps']:.0f} vs "
          f"{graph['throughput_rps']:.0f} req/s (medians) = {miss['throughput_ratio']:.2f}x; by round "
          f"{', '.join(f'{r:.2f}' for r in miss['ratio_by_round'])}: median {miss['median_ratio_by_round']:.2f}x "
          f"| encoder runs per miss "
          f"{head['rounds'][0]['encoder_runs_per_miss']} vs {graph['rounds'][0]['encoder_runs_per_miss']} |")
    one, many = bump["infer"], bump["infer_batch"]
    print(f"| head version bump, {bump['texts']} texts again: Infer (32 callers) | {one['second_pass']['seconds']:.1f} s "
          f"({one['second_pass']['throughput_rps']:.0f} texts/s) | first pass {one['first_pass']['seconds']:.1f} s: "
          f"{one['time_ratio']:.3f}x |")
    print(f"| the same, InferBatch of 32 texts (8 callers) | {many['second_pass']['seconds']:.1f} s "
          f"({many['second_pass']['texts_per_s']:.0f} texts/s) | first pass {many['first_pass']['seconds']:.1f} s: "
          f"{many['time_ratio']:.3f}x |")
    print(f"| p50 at 1 caller: FEATURE / exact hit / miss | {lat['feature']['p50_ms']:.2f} / "
          f"{lat['exact_hit']['p50_ms']:.2f} / {lat['miss']['p50_ms']:.2f} ms | FEATURE {lat['feature_p50_over_exact_hit']:.2f}x "
          f"an exact hit, {lat['feature_p50_over_miss']:.2f}x a miss |")
    if "workers_only" in result:
        w = result["workers_only"]
        print(f"| the same with heads run by the workers only (`l2.frontend_head_mb=0`, another server of the run) | "
              f"bump of {w['texts']} texts, Infer: {w['bump_infer_time_ratio']:.3f}x; p50 FEATURE / exact hit "
              f"{w['feature_p50_ms']:.2f} / {w['exact_hit_p50_ms']:.2f} ms | FEATURE {w['feature_p50_over_exact_hit']:.2f}x "
              "an exact hit |")
    for name, row in result.get("feature_throughput", {}).items():
        print(f"| FEATURE answers, {name.replace('_', ' ')} | {row['throughput_rps']:.0f} req/s, p50 {row['p50_ms']:.2f} ms | |")
    if "device_lru" in result:
        d = result["device_lru"]
        print(f"| device LRU, batches of {d['batch']} among {d['entries']:,} ({d['device']}) | event loop: lookups + "
              f"releases {d['loop_lookups_and_releases_us']} us, inserts {d['inserts_us']} us; head thread: gather "
              f"{d['gather_us']} us, gather + head {d['gather_and_head_us']} us | the head on {d['batch']} host "
              f"features (copied in): {d['head_on_host_features_us']} us |")
    print(json.dumps(result.get("engines", [])))


def section(run: Run) -> None:
    from server.shared.devices import GPU_RUNTIMES, visible_gpus

    print("benchmarking the feature tier (L2) ...", flush=True)
    settings = tuple(filter(None, run.args.l2_settings.split(",")))
    runtime = next((s.split("=", 1)[1] for s in settings if s.startswith("engines.runtime=")), "auto")
    run.report["l2"] = {}
    bench_l2(run.workdir / "l2", run.rounds, run.quick, run.report["l2"], settings=settings,
             gpu=bool(visible_gpus()) and runtime in ("auto", *GPU_RUNTIMES), checkpoint=run.save,
             generator=run.args.load_generator, dry=run.dry)
    print_l2(run.report["l2"])
