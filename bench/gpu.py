"""GPU section (`make bench ARGS="--sections gpu"`; on the lent H200 through bench/device.sh).

Side by side, in one run:
1. raw ceiling: the torch-cuda engine's own run() in a loop (one thread, and two threads = both slots),
   MiniLM and a BERT-base-size encoder (random weights made on the device), batch x sequence shapes;
2. the server, all misses on distinct texts, 16 frontends, several load processes sending
   pre-serialized requests: BERT-base on 128-token texts (call shapes swept; mean batch formed and the
   raw ceiling at that batch), MiniLM one text per call against a raw-bytes gRPC server (the floor of
   gRPC: same method, fixed bytes, no protobuf work) with the same processes and load, MiniLM 32 texts
   per call, both also with twice the calls in flight (part "callers"); CPU seconds per process and GPU
   busy fraction for each run;
3. exact hits against the protobuf echo server at 1 and 256 callers;
4. cold versus warm start (empty vs filled L3 store), with each count of workers: launch to the first hit,
   the first GPU-served miss, ready, and every worker at full speed (measure_starts);
5. the null engine (no model work): what the frontends and the worker carry by themselves.
Without a GPU the same section runs on ONNX Runtime as a dry run of the plumbing, labelled so.
"""

from __future__ import annotations

import multiprocessing
import statistics
import threading
import time
from pathlib import Path
from typing import TypeVar

import numpy as np

from bench import echo
from bench.fixtures import (INFER_BATCH, batch_payloads, distinct_texts, first_success, long_texts, make_gpu_models,
                            single_payloads)
from bench.load import INFER, run_load_processes
from bench.probes import gpu_available, measured, writers_caught_up
from bench.sections import Run
from harness.servers import REPO, ServerProcess
from infercache.v1 import infercache_pb2 as pb

T = TypeVar("T")
RAW_SHAPES = ((32, 32), (128, 32), (32, 128), (128, 128), (8, 128), (16, 128), (64, 128))


# ---- 1. raw ceiling ----------------------------------------------------------------------------------

def _time_engine(engine, batch: int, seq: int, seconds: float, threads: int) -> float:
    rng = np.random.default_rng(batch * 1000 + seq)
    inputs = [{"input_ids": rng.integers(1000, 30000, (batch, seq), dtype=np.int64),
               "attention_mask": np.ones((batch, seq), dtype=np.int64)} for _ in range(4)]
    for sample in inputs:
        engine.run(sample)
    count = [0] * threads
    stop = time.perf_counter() + seconds

    def loop(slot: int) -> None:
        n = 0
        while time.perf_counter() < stop:
            engine.run(inputs[n % len(inputs)])
            n += 1
        count[slot] = n

    started = time.perf_counter()
    workers = [threading.Thread(target=loop, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return sum(count) * batch / (time.perf_counter() - started)


def raw_ceiling(minilm_dir: Path, seconds: float) -> dict:
    import torch

    from server.engines.base import profiles_for
    from server.engines.torch_bert import BERT_BASE, load_torch_source, random_bert
    from server.engines.torch_cuda import TorchCudaEngine

    profiles = profiles_for((32, 128), 128)
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    for name, make in (("minilm", lambda: load_torch_source(minilm_dir, device="cuda", dtype=torch.float16)),
                       ("bert-base", lambda: random_bert(BERT_BASE, device="cuda", dtype=torch.float16))):
        started = time.perf_counter()
        engine = TorchCudaEngine(make(), profiles)
        engine.wait_warm()  # every graph captured before timing
        rows = {"graphs": len(engine.graphs), "load_and_capture_s": round(time.perf_counter() - started, 2)}
        for batch, seq in RAW_SHAPES:
            rows[f"{batch}x{seq}"] = {
                "seq_per_s_1_thread": round(_time_engine(engine, batch, seq, seconds, 1)),
                "seq_per_s_2_threads": round(_time_engine(engine, batch, seq, seconds, 2)),
            }
        out[name] = rows
        del engine
        torch.cuda.empty_cache()
    return out


def ceiling_at(raw: dict, model: str, batch: float, seq: int = 128) -> float:
    """The raw ceiling (one thread) at a mean batch, interpolated between the measured batch sizes."""
    points = sorted((int(k.split("x")[0]), v["seq_per_s_1_thread"]) for k, v in raw[model].items()
                    if isinstance(v, dict) and k.endswith(f"x{seq}"))
    xs, ys = zip(*points)
    return float(np.interp(batch, xs, ys))


# ---- texts and requests --------------------------------------------------------------------------------


# ---- measuring a server run ------------------------------------------------------------------------------


# ---- the section --------------------------------------------------------------------------------------


def measure_starts(workdir: Path, models: Path, frontends: int, settings: tuple[str, ...], count: int,
                   engines: Path | None) -> dict[str, dict]:
    """A cold start (an empty L3 store: the engine built) and a warm one (the store filled, and the cold
    run's answer in the result store): from launching the server to its first hit (warm), its first
    miss, ready, and every worker at full speed (its CUDA graphs captured behind traffic), with each
    worker's own start phases (GetStats)."""
    engines = engines or workdir / f"gpu-start-engines-{count}"
    cache = workdir / f"gpu-start-cache-{count}"
    asked = f"first question after a cold start of {count} workers"
    out = {}
    for label in ("cold", "warm"):
        run_dir = workdir / f"gpu-start-{label}-{count}"
        run_dir.mkdir()
        with ServerProcess(run_dir, models, frontends=frontends, settings=(*settings, f"server.workers={count}"),
                           engines_dir=engines, cache_dir=cache, wait=False) as server:
            row = {}
            if label == "warm":
                hit = pb.InferRequest(model="minilm", text=asked, cache=pb.CachePolicy(mode=pb.CachePolicy.ONLY_IF_CACHED))
                row["start_to_first_hit_s"] = round(first_success(server.address, hit, server.started, 600, server), 2)
            miss = pb.InferRequest(model="minilm", text=asked if label == "cold" else f"a new question {count}")
            row["start_to_first_miss_s"] = round(first_success(server.address, miss, server.started, 600, server), 2)
            server.wait_ready(600)
            row["start_to_ready_s"] = round(server.ready_after, 2)
            try:
                stats = server.wait_warm(600)
            except Exception:
                print(server.log_text()[-4000:], flush=True)
                raise
            row["start_to_full_speed_s"] = round(time.monotonic() - server.started, 2)  # (polled every 0.1 s)
            row["engines_built_at_start"] = sum(w.counters.get("worker.engines_built_at_start", 0) for w in stats)
            row["workers"] = [{"start_seconds": dict(w.start_seconds),
                               "engines": {e.model: dict(e.warmup_seconds) for e in w.engines}} for w in stats]
            if server.stop() != 0:
                raise RuntimeError(f"the {label} start's server did not stop cleanly:\n{server.log_text()[-3000:]}")
        out[label] = row
    return out


PARTS = ("raw", "start", "bert", "minilm", "callers", "alternating", "hits", "null")
ALTERNATING_ROUNDS = 3


def bench_gpu(workdir: Path, texts: list[str], report: dict, *, quick: bool, frontends: int = 16,
              load_processes: int = 8, checkpoint=lambda: None, parts: tuple[str, ...] = PARTS,
              workers: tuple[int, ...] = (1,), callers: tuple[int, ...] = (2,), rounds: int = ALTERNATING_ROUNDS,
              seconds: float | None = None) -> dict:
    """Fills `report` step by step, calling checkpoint() after each step (a run cut short keeps the rest).
    `parts` picks steps (a short device lease measures fewer); "hits" needs "minilm". `workers`: worker
    processes sharing the GPU; the first serves every step, each further count repeats the MiniLM runs
    (and the null engine runs with the largest), to show what several Python processes per GPU carry.
    `callers`: with part "callers", the MiniLM runs again at these multiples of the calls in flight (and
    the raw-bytes server with them); part "alternating" runs at the largest, `rounds` pairs. `seconds`: each
    load run's (default 5, 2 when quick)."""
    on_gpu = gpu_available()
    runtime = "torch-cuda" if on_gpu else "onnxruntime"
    seconds = seconds or (2.0 if quick else 5.0)
    frontends = min(frontends, multiprocessing.cpu_count())
    load_processes = min(load_processes, multiprocessing.cpu_count())
    report.update({"runtime": runtime, "dry_run_on_cpu": not on_gpu, "frontends": frontends,
                   "load_processes": load_processes, "seconds_per_run": seconds})
    models = make_gpu_models(workdir / "gpu-models", on_gpu and "bert" in parts)
    if on_gpu and "raw" in parts:
        print("  raw ceiling ...", flush=True)
        report["raw_ceiling"] = raw_ceiling(REPO / "models" / "minilm" / "1", 1.0 if quick else 2.0)
        checkpoint()
    # A store that holds every miss of the run (the default budget, 1.5 GB, holds about 700k MiniLM
    # answers; four workers' miss runs write more), so that no hit run measures eviction.
    base = (f"engines.runtime={runtime}", "server.max_queue=16384", "cache.map_size_mb=16384", "cache.budget_mb=12288")
    settings = (*base, f"server.workers={workers[0]}")
    engines = workdir / "gpu-engines"
    report["workers_per_gpu"] = list(workers)
    if "start" in parts:
        print("  cold and warm start ...", flush=True)
        report["start"] = {f"{label}_{count}_workers": row for count in workers
                           for label, row in measure_starts(workdir, models, frontends, base, count,
                                                            engines if count == workers[0] else None).items()}
    checkpoint()

    run_dir = workdir / "gpu-server"
    run_dir.mkdir()
    total = 400_000 if not quick else 60_000
    with ServerProcess(run_dir, models, frontends=frontends, settings=settings, engines_dir=engines) as server:
        report["engines"] = [
            {"model": e.model, "runtime": e.runtime, "precision": e.precision, "device": e.device}
            for m in _models(server) for e in m.engines]
        load = lambda address, method, payloads, concurrency, per_call=1: run_load_processes(  # noqa: E731
            address, method, payloads, processes=load_processes, concurrency=concurrency, seconds=seconds,
            items_per_call=per_call)
        if on_gpu and "bert" in parts:
            print("  BERT-base, 128-token texts ...", flush=True)
            # NO_STORE: every call is a miss even where a load process comes round to a text again.
            long = long_texts(texts, 120_000 if not quick else 20_000, seed=1)
            sweep = {}
            for per_call, in_flight in ((32, 1), (32, 2), (16, 2), (8, 4)):
                payloads = batch_payloads("bert-base", long, per_call, pb.CachePolicy.NO_STORE)
                report["bert_base_misses"] = sweep
                sweep[f"{per_call}_texts_x_{in_flight * load_processes}_calls"] = measured(
                    server, "bert-base", lambda: load(server.address, INFER_BATCH, payloads, in_flight, per_call),
                    profile=(per_call, in_flight) == (32, 2))
            for row in sweep.values():
                if row["mean_batch"] and "raw_ceiling" in report:
                    row["raw_ceiling_at_mean_batch"] = round(ceiling_at(report["raw_ceiling"], "bert-base", row["mean_batch"]))
                    row["of_raw_ceiling"] = round(row["items_per_s"] / row["raw_ceiling_at_mean_batch"], 3)
                checkpoint()

        print("  MiniLM, one text per call ...", flush=True)
        single = single_payloads("minilm", distinct_texts(texts, total, seed=2))
        report["minilm_single"] = measured(server, "minilm", lambda: load(server.address, INFER, single, 32),
                                           profile=True)
        checkpoint()
        print("  MiniLM, 32 texts per call ...", flush=True)
        batched = batch_payloads("minilm", distinct_texts(texts, total * 2, seed=3), 32)
        report["minilm_batch32"] = measured(server, "minilm", lambda: load(server.address, INFER_BATCH, batched, 4, 32),
                                            profile=True)
        checkpoint()
        more_callers = callers if "callers" in parts else ()

        def with_more_callers(server: ServerProcess, out: dict, prefix: str, seed: int) -> None:
            """The MiniLM runs with `m` times the calls in flight (fresh texts: misses): does a deeper
            queue carry more? (One frontend's Python profiled in the one-text runs: where its time goes.)"""
            for m in more_callers:
                print(f"  MiniLM with {m}x the callers ...", flush=True)
                more = single_payloads("minilm", distinct_texts(texts, total, seed=seed + m))
                out[f"{prefix}single_x{m}_callers"] = measured(
                    server, "minilm", lambda: load(server.address, INFER, more, 32 * m), profile="frontend")
                more = batch_payloads("minilm", distinct_texts(texts, total * 2, seed=seed + 100 + m), 32)
                out[f"{prefix}batch32_x{m}_callers"] = measured(
                    server, "minilm", lambda: load(server.address, INFER_BATCH, more, 4 * m, 32))
                checkpoint()

        with_more_callers(server, report, "minilm_", seed=4)
        if "alternating" in parts:
            report["alternating"] = alternating(server, texts, total, 32 * max(callers), load, frontends, rounds)
            checkpoint()

        hot = single_payloads("minilm", texts[:200])
        caught_up = writers_caught_up(server)  # first the misses' writes: a writer far behind drops new ones
        for payload in hot:  # warm, then wait for the write-behind
            load_one(server.address, payload)
        report["writers_caught_up_s"] = round(caught_up + writers_caught_up(server), 1)
        report["writes_dropped"] = sum(w.counters.get("writer.dropped_backlog", 0) for w in server.stats().workers)
        print("  exact hits ...", flush=True)
        report["hits"] = {} if "hits" not in parts else {f"callers_{c * load_processes if c > 1 else 1}": measured(
            server, "minilm", lambda c=c: run_load_processes(server.address, INFER, hot, processes=load_processes if c > 1 else 1,
                                                            concurrency=c, seconds=seconds))
            for c in (1, 32)}
        recorded = _recorded_miss(server.address, texts[0])
        checkpoint()
        assert server.stop() == 0

    for count in workers[1:]:
        print(f"  MiniLM with {count} workers on the GPU ...", flush=True)
        run_dir = workdir / f"gpu-server-{count}-workers"
        run_dir.mkdir()
        sweep = report.setdefault("minilm_by_workers", {})
        with ServerProcess(run_dir, models, frontends=frontends, settings=(*base, f"server.workers={count}"),
                           engines_dir=engines) as server:
            sweep[str(count)] = runs = {
                "single": measured(server, "minilm", lambda: load(server.address, INFER, single, 32)),
                "batch32": measured(server, "minilm", lambda: load(server.address, INFER_BATCH, batched, 4, 32)),
            }
            with_more_callers(server, runs, "", seed=1000 * count)  # more processes may need more in flight
            checkpoint()
            assert server.stop() == 0

    print("  baselines: raw-bytes server and echo server ...", flush=True)
    address, procs = echo.start(frontends, echo.raw_main, INFER, recorded)
    try:
        report["raw_bytes_single"] = load(address, INFER, single, 32).summary()
        for m in more_callers:
            report[f"raw_bytes_single_x{m}_callers"] = load(address, INFER, single, 32 * m).summary()
        if "hits" in parts:  # the floor of gRPC for the hits above (the target: hits >= 0.8x it at 256 callers)
            report["raw_bytes_hits"] = {f"callers_{32 * load_processes}": run_load_processes(
                address, INFER, hot, processes=load_processes, concurrency=32, seconds=seconds).summary()}
    finally:
        echo.stop(procs)
    address, procs = echo.start(frontends) if "hits" in parts else (None, [])
    try:
        report["echo_hits"] = {} if "hits" not in parts else {
            "callers_1": run_load_processes(address, INFER, hot, processes=1, concurrency=1, seconds=seconds).summary(),
            f"callers_{32 * load_processes}": run_load_processes(address, INFER, hot, processes=load_processes,
                                                                 concurrency=32, seconds=seconds).summary()}
    finally:
        echo.stop(procs)

    if "null" not in parts:
        report["ratios"] = _ratios(report)
        checkpoint()
        return report
    print("  null engine (server capacity without model work) ...", flush=True)
    null_models = make_gpu_models(workdir / "null-models", False)  # minilm only: the null runtime reads ONNX
    for count in sorted({workers[0], workers[-1]}):
        run_dir = workdir / f"gpu-null-{count}"
        run_dir.mkdir()
        suffix = "" if count == workers[0] else f"_{count}_workers"
        with ServerProcess(run_dir, null_models, frontends=frontends, engines_dir=engines, settings=(
                "engines.runtime=null", "server.max_queue=16384", f"server.workers={count}")) as server:
            report[f"null_single{suffix}"] = measured(server, "minilm", lambda: load(
                server.address, INFER, single_payloads("minilm", distinct_texts(texts, total, seed=4)), 32))
            report[f"null_batch32{suffix}"] = measured(server, "minilm", lambda: load(
                server.address, INFER_BATCH, batch_payloads("minilm", distinct_texts(texts, total * 2, seed=5), 32),
                4, 32), profile=True)
            assert server.stop() == 0
        checkpoint()
    report["ratios"] = _ratios(report)
    checkpoint()
    return report


def alternating(server: ServerProcess, texts: list[str], total: int, in_flight: int, load, frontends: int,
                rounds: int) -> dict:
    """MiniLM one text per call against the raw-bytes server, in adjacent pairs at the same calls in
    flight per load process, `rounds` times: the raw-bytes server's own figure moved by 20% between runs
    (43-63k calls/s on an H200 host), as much as the ratio's distance from its target, so a ratio is
    taken of each pair and the median reported. Each raw-bytes run waits until the server's writers have
    caught up with the misses before it (the server's idle processes are left running), and so does each
    server run: every pair starts from the same state."""
    recorded = _recorded_miss(server.address, f"{texts[0]} alternating")  # (not the later baselines' text)
    writers_caught_up(server)  # (later rounds start where the last raw-bytes run left them: caught up)
    pairs = []
    for n in range(rounds):
        print(f"  alternating round {n + 1} of {rounds} ...", flush=True)
        single = single_payloads("minilm", distinct_texts(texts, total, seed=5000 + n))
        ours = measured(server, "minilm", lambda: load(server.address, INFER, single, in_flight))
        caught_up = writers_caught_up(server)
        address, procs = echo.start(frontends, echo.raw_main, INFER, recorded)
        try:
            raw = load(address, INFER, single, in_flight).summary()
        finally:
            echo.stop(procs)
        pairs.append({"server": ours, "raw_bytes": raw, "writers_caught_up_s": caught_up,
                      "ratio": round(ours["calls_per_s"] / raw["calls_per_s"], 3)})
    return {"calls_in_flight_per_load_process": in_flight, "pairs": pairs,
            "median_ratio": statistics.median(p["ratio"] for p in pairs)}


def _models(server: ServerProcess) -> list:
    with server.client() as client:
        return client.models()


def load_one(address: str, payload: bytes) -> bytes:
    import grpc

    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary(INFER, request_serializer=None, response_deserializer=None)
        return call(payload, timeout=60)


def _recorded_miss(address: str, text: str) -> bytes:
    """A real answer's bytes (the raw-bytes server sends these): one embedding, CacheInfo filled."""
    return load_one(address, pb.InferRequest(model="minilm", text=f"{text} recorded").SerializeToString())


def _ratios(report: dict) -> dict:
    out = {"minilm_single_vs_raw_bytes": round(report["minilm_single"]["calls_per_s"]
                                               / report["raw_bytes_single"]["calls_per_s"], 3)}
    hits, echo = report["hits"], report["echo_hits"]
    if hits:
        many = next(k for k in hits if k != "callers_1")
        out["hit_p50_vs_echo_1_caller"] = round(hits["callers_1"]["p50_ms"] / echo["callers_1"]["p50_ms"], 3)
        out[f"hit_throughput_vs_echo_{many}"] = round(hits[many]["calls_per_s"] / echo[many]["calls_per_s"], 3)
        if many in report.get("raw_bytes_hits", {}):
            out[f"hit_throughput_vs_raw_bytes_{many}"] = round(
                hits[many]["calls_per_s"] / report["raw_bytes_hits"][many]["calls_per_s"], 3)
    runs = {"": {k[len("minilm_"):]: v for k, v in report.items() if k.startswith("minilm_") and "by_workers" not in k},
            **{f"_{count}_workers": rows for count, rows in report.get("minilm_by_workers", {}).items()}}
    for suffix, rows in runs.items():  # each against the raw-bytes server at the same calls in flight
        for name, row in rows.items():
            if name.startswith("single") and f"raw_bytes_{name}" in report:
                callers = name[len("single"):]
                out[f"minilm_single_vs_raw_bytes{suffix}{callers}"] = round(
                    row["calls_per_s"] / report[f"raw_bytes_{name}"]["calls_per_s"], 3)
            elif name.startswith("batch32"):
                out[f"minilm_batch32_texts_per_s{suffix}{name[len('batch32'):]}"] = row["items_per_s"]
    if "alternating" in report:
        out["minilm_single_vs_raw_bytes_alternating_median"] = report["alternating"]["median_ratio"]
    return out


def print_gpu(report: dict) -> None:
    print(f"\nGPU section ({report['runtime']}{', DRY RUN ON CPU' if report['dry_run_on_cpu'] else ''}; "
          f"{report['frontends']} frontends, {report['load_processes']} load processes)")
    raw = report.get("raw_ceiling")
    if raw:
        print("  raw ceiling, engine run() in a loop (seq/s, 1 thread / 2 threads)")
        for model in ("minilm", "bert-base"):
            cells = "  ".join(f"{k} {v['seq_per_s_1_thread']}/{v['seq_per_s_2_threads']}"
                              for k, v in raw[model].items() if isinstance(v, dict))
            print(f"    {model:<10} {cells}")
    for name in ("bert_base_misses",):
        for shape, row in report.get(name, {}).items():
            print(f"  BERT-base misses {shape:<26} {row['items_per_s']:>9} texts/s  p99 {row['p99_ms']} ms  "
                  f"mean batch {row['mean_batch']}  {row.get('of_raw_ceiling')} of raw ceiling  GPU {row['gpu_busy_percent']}%  "
                  f"cpu {row['cpu_cores_busy']}")
    rows = {name: report[name] for name in report if name.startswith(("minilm_single", "raw_bytes_single",
                                                                       "minilm_batch", "null_"))}
    for count, runs in report.get("minilm_by_workers", {}).items():
        rows.update({f"minilm_{shape}_{count}_workers": row for shape, row in runs.items()})
    for name, row in rows.items():
        print(f"  {name:<20} {row['calls_per_s']:>9} calls/s {row['items_per_s']:>9} texts/s  p50 {row['p50_ms']} ms  "
              f"p99 {row['p99_ms']} ms  errors {row['errors']}  cpu {row.get('cpu_cores_busy')} "
              f"busiest {row.get('busiest_process_cores')}  load {row.get('load_generator_cores')}  "
              f"host {row.get('host_cores_busy')} ({row.get('host_cpu_us_per_call')} us/call)  "
              f"GPU {row.get('gpu_busy_percent')}%")
    for name, row in {**{f"hits {k}": v for k, v in report["hits"].items()},
                      **{f"echo {k}": v for k, v in report["echo_hits"].items()},
                      **{f"raw bytes {k}": v for k, v in report.get("raw_bytes_hits", {}).items()}}.items():
        print(f"  {name:<20} {row['calls_per_s']:>9} calls/s  p50 {row['p50_ms']} ms  p99 {row['p99_ms']} ms")
    if "alternating" in report:
        alt = report["alternating"]
        for n, pair in enumerate(alt["pairs"]):
            print(f"  alternating {n + 1}: server {pair['server']['calls_per_s']} vs raw bytes {pair['raw_bytes']['calls_per_s']} "
                  f"calls/s = {pair['ratio']}x ({alt['calls_in_flight_per_load_process']} in flight per load process)")
        print(f"  alternating: median {alt['median_ratio']}x")
    if "writers_caught_up_s" in report:
        print(f"  the writers caught up {report['writers_caught_up_s']} s after the miss runs (before the hits); "
              f"writes dropped behind them: {report['writes_dropped']}")
    for label, row in report.get("start", {}).items():
        hit = f"first hit {row['start_to_first_hit_s']} s, " if "start_to_first_hit_s" in row else ""
        print(f"  {label.replace('_', ' ')}: {hit}first miss {row['start_to_first_miss_s']} s, ready "
              f"{row['start_to_ready_s']} s, full speed {row['start_to_full_speed_s']} s, engines built "
              f"{row['engines_built_at_start']}; worker phases {[w['start_seconds'] for w in row['workers']]}")
    print(f"  ratios {report['ratios']}")


def section(run: Run) -> None:
    print("benchmarking the GPU path ...", flush=True)
    run.report["gpu"] = {}
    args = run.args
    bench_gpu(run.workdir, run.texts, run.report["gpu"], quick=run.quick, parts=tuple(args.gpu_parts.split(",")),
              workers=tuple(int(n) for n in args.gpu_workers.split(",")),
              callers=tuple(int(n) for n in args.gpu_callers.split(",")),
              rounds=args.rounds or (1 if run.dry else ALTERNATING_ROUNDS), checkpoint=run.save,
              seconds=0.5 if run.dry else None)
    print_gpu(run.report["gpu"])
