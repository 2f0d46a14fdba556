"""L3 engine store: cold (build) vs warm (find, verify, load) for each path that runs on this host."""

from __future__ import annotations

import shutil
import statistics
import time
from pathlib import Path

import onnxruntime as ort

from bench.fixtures import make_models
from bench.sections import Run
from cachestore.engine_store import EngineStore
from harness.servers import REPO, ServerProcess
from server.engines.artifacts import get_runtime, prepare
from server.engines.base import RuntimeUnavailable
from server.engines.onnxruntime import OrtEngine
from server.shared.models import load_model


def _timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def _median(samples: list[float]) -> float:
    return round(statistics.median(samples), 3)


def bench_l3(workdir: Path, models: Path, rounds: int) -> dict:
    spec = load_model(REPO / "models" / "minilm")
    source = spec.version_dir(spec.serving_version) / "model.onnx"
    store = EngineStore(workdir / "l3")
    out: dict = {}

    # ONNX Runtime: a session from the source model (optimizing at every start) vs from the stored
    # optimized model, counting the store lookup and checksum verification.
    onnx_rt = get_runtime("onnxruntime")
    prepare(store, onnx_rt, spec, "1", "fp16")[0]
    cold = [_timed(lambda: OrtEngine(source, level=ort.GraphOptimizationLevel.ORT_ENABLE_ALL))
            for _ in range(rounds)]
    warm = [_timed(lambda: prepare(store, onnx_rt, spec, "1", "fp16", load=True)) for _ in range(rounds)]
    out["onnxruntime_session"] = {"cold_s": _median(cold), "warm_s": _median(warm),
                                  "speedup": round(_median(cold) / _median(warm), 2)}

    # TensorRT(-RTX): a build into an empty store vs finding, verifying and reading the stored plan.
    try:
        trt = get_runtime("tensorrt")
    except RuntimeUnavailable as exc:
        out["tensorrt"] = {"skipped": str(exc)}
    else:
        stores = [EngineStore(workdir / f"trt{i}") for i in range(rounds)]
        builds = [_timed(lambda s=s: prepare(s, trt, spec, "1", "fp16")) for s in stores]
        finds = [_timed(lambda s=s: prepare(s, trt, spec, "1", "fp16")[0].path.read_bytes()) for s in stores]
        out["tensorrt"] = {"runtime": f"{trt.name} {trt.version}", "build_s": _median(builds),
                           "find_verify_read_s": _median(finds), "speedup": round(_median(builds) / _median(finds), 1),
                           "note": "loading onto a GPU is not measured here: no GPU runs these engines"}

    # The server: start to ready with an empty engine store vs a warm one (same result cache).
    samples: dict[str, list[float]] = {"empty_store_s": [], "warm_store_s": []}
    for i in range(rounds):
        engines = workdir / f"server-engines{i}"
        for label in ("empty_store_s", "warm_store_s"):
            run_dir = workdir / f"l3-server{i}-{label}"
            run_dir.mkdir()
            with ServerProcess(run_dir, models, engines_dir=engines) as server:
                samples[label].append(server.ready_after)
                assert server.stop() == 0
        shutil.rmtree(engines)
    out["server_start_to_ready"] = {k: _median(v) for k, v in samples.items()}
    out["server_start_to_ready"]["speedup"] = round(
        out["server_start_to_ready"]["empty_store_s"] / out["server_start_to_ready"]["warm_store_s"], 2)
    return out


def print_l3(result: dict) -> None:
    session = result["onnxruntime_session"]
    print("\nL3 engine store                    cold s    warm s   speedup")
    print(f"  onnxruntime session              {session['cold_s']:7.3f}   {session['warm_s']:7.3f}   "
          f"{session['speedup']}x")
    trt = result["tensorrt"]
    if "skipped" in trt:
        print(f"  tensorrt: skipped ({trt['skipped']})")
    else:
        print(f"  {trt['runtime']:<32} {trt['build_s']:7.3f}   {trt['find_verify_read_s']:7.3f}   "
              f"{trt['speedup']}x  (build vs find+verify+read)")
    start = result["server_start_to_ready"]
    print(f"  server start to ready            {start['empty_store_s']:7.3f}   {start['warm_store_s']:7.3f}   "
          f"{start['speedup']}x  (empty vs warm engine store)")


def section(run: Run) -> None:
    print("benchmarking the L3 engine store ...", flush=True)
    # (the two engines of serving's servers, whose start-up this measures against an empty store)
    run.report["l3_engines"] = bench_l3(run.workdir, make_models(run.workdir / "l3-models", unbatched=True),
                                        run.rounds)
    print_l3(run.report["l3_engines"])
