"""Exact hits against NVIDIA Triton's response cache (`--sections peers`, part hits), on this machine.

The same MiniLM graph served by both: infercache (as many frontends as cores, as the doors section)
and Triton through PyTriton (bench/triton_model.py, its own virtualenv: bench/peer_envs.py), Triton's
local response cache on and its dynamic batcher up to 32 rows. Both are called over KServe v2's
ModelInfer with one BYTES text, pre-serialized, by the same generator (bench/load.py run_raw_load, on
uvloop, in this process); infercache also over its native door (Infer). The floor is a bare grpc.aio
server of as many processes answering infercache's recorded KServe hit (bench/echo.py raw_main): what
gRPC in Python costs before any cache work; and gRPC's C++ server answering the same bytes
(bench/native/floor.cc, where it builds): what a hit path in C++ could reach before its cache work.

Rounds alternate the servers. Each run: p50 and p99 at 1 and 32 callers, throughput, and the server
processes' CPU per call (every process of each server: Triton's are the PyTriton process, tritonserver
and its Python backend stubs). Every call counted as a hit: infercache's KServe answers say so, and
Triton's hit counter (its /metrics) grows by the calls sent. Then misses at 32 callers: distinct
texts, each once, for each server.
"""

from __future__ import annotations

import contextlib
import os
import statistics
from pathlib import Path

import grpc
import numpy as np
import uvloop

from bench import echo
from bench import ratio as ratio_of
from bench.doors import MODEL_INFER, check_hits, kserve_request
from bench.fixtures import distinct_texts
from bench.load import INFER, run_raw_load, warm
from bench.native_load import native as native_binary, start_floor
from bench.peer_envs import TRITON, triton_env
from bench.probes import cpu_during, server_roles
from bench.triton_peer import CACHE_BYTES, TritonPeer
from infercache.kserve import grpc_service_pb2 as kpb
from infercache.v1 import infercache_pb2 as pb
from server.shared.normalize import Normalizer
from harness.servers import REPO, ServerProcess, link_model

HITS = 200  # distinct texts, each a cached entry in both servers
GOALS = {"p50_ratio_max": 1.2, "throughput_ratio_min": 1.0}  # infercache against Triton, at 1 / 32 callers
COMPARED = 50  # texts whose embeddings are compared between the two servers


def bench_peers_hits(workdir: Path, texts: list[str], rounds: int, quick: bool, dry: bool = False) -> dict:
    env = triton_env()
    if isinstance(env, str):
        print(f"  Triton skipped: {env}", flush=True)
        return {"skipped": env}
    models = workdir / "models"
    link_model(models, "minilm", (REPO / "models" / "minilm" / "config.yaml").read_text(),
               {"1": REPO / "models" / "minilm" / "1"})
    (workdir / "server").mkdir(parents=True)
    processes = os.cpu_count() or 1
    chosen = texts[:HITS]
    native = [pb.InferRequest(model="minilm", text=t).SerializeToString() for t in chosen]
    kserve = [kserve_request(t) for t in chosen]
    batched = [kserve_request(t, batched=True) for t in chosen]  # Triton's batching model takes [1, 1]
    server = ServerProcess(workdir / "server", models, frontends=processes, engines_dir=workdir / "engines")
    with contextlib.ExitStack() as cleanup:  # each stopped whatever else fails (the server last)
        cleanup.callback(_stopped, server)
        triton = TritonPeer(env, workdir / "triton")
        cleanup.callback(triton.stop)
        warm(server.address, [pb.InferRequest(model="minilm", text=t) for t in chosen])
        agreement = _warm_and_compare(triton.address, server.address, batched, chosen)
        with grpc.insecure_channel(server.address) as channel:
            hit = channel.unary_unary(MODEL_INFER, request_serializer=None, response_deserializer=None)(kserve[0], timeout=30)
        floor, procs = echo.start(processes, echo.raw_main, MODEL_INFER, hit)
        cleanup.callback(echo.stop, procs)
        ours = list(server_roles(server))
        targets = {"triton": (triton.address, MODEL_INFER, batched, triton.pids()),
                   "kserve_door": (server.address, MODEL_INFER, kserve, ours),
                   "native_door": (server.address, INFER, native, ours),
                   "floor": (floor, MODEL_INFER, kserve, [p.pid for p in procs])}
        binary = native_binary("floor")
        if binary is not None:
            floor_cpp, cpp = start_floor(binary, hit, workdir / "floor")
            cleanup.callback(lambda: (cpp.kill(), cpp.wait(10)))
            targets["floor_cpp"] = (floor_cpp, MODEL_INFER, kserve, [cpp.pid])
        plan = {1: 60, 32: 400} if dry else {1: 600 if quick else 3000, 32: 4000 if quick else 20000}
        runs: dict[str, dict[int, list[dict]]] = {name: {1: [], 32: []} for name in targets}
        hits_before, sent = triton.cache_hits(), 0
        for _ in range(rounds):
            for concurrency, total in plan.items():
                for name, (address, method, payloads, pids) in targets.items():
                    uvloop.run(run_raw_load(address, method, payloads, concurrency=concurrency, total=total // 10))
                    result, cpu_s = cpu_during(pids, lambda: uvloop.run(
                        run_raw_load(address, method, payloads, concurrency=concurrency, total=total)))
                    assert result.errors == 0, f"{name}: {result.errors} errors"
                    sent += (total + total // 10) if name == "triton" else 0
                    runs[name][concurrency].append({**result.summary(), "cpu_ms_per_call": round(
                        cpu_s * 1000 / result.requests, 4)})
        triton_hits = triton.cache_hits() - hits_before
        assert triton_hits == sent, f"Triton answered {triton_hits} of {sent} calls from its cache"
        check_hits(server.address, kserve)
        misses = _misses(triton, server, texts, rounds, 40 if dry else 300 if quick else 2000)
    return _report(runs, plan, misses, agreement)


def _stopped(server: ServerProcess) -> None:
    code = server.stop()
    if code != 0:
        raise RuntimeError(f"infercache exited with {code}: {server.log_text()[-2000:]}")


def _warm_and_compare(triton: str, ours: str, batched: list[bytes], texts: list[str]) -> dict:
    """Each text once into Triton's cache; then the two servers' embeddings compared (the same model):
    infercache embeds the normalized text (server/shared/normalize.py), so Triton is sent that."""
    normalize = Normalizer()
    cosines = []
    with grpc.insecure_channel(triton) as a, grpc.insecure_channel(ours) as b:
        call_a = a.unary_unary(MODEL_INFER, request_serializer=None, response_deserializer=kpb.ModelInferResponse.FromString)
        call_b = b.unary_unary(MODEL_INFER, request_serializer=None, response_deserializer=kpb.ModelInferResponse.FromString)
        for payload in batched:
            call_a(payload, timeout=60)
        for text in texts[:COMPARED]:
            x = np.frombuffer(call_a(kserve_request(normalize(text), batched=True), timeout=60).raw_output_contents[0],
                              dtype=np.float32)
            y = np.frombuffer(call_b(kserve_request(text), timeout=60).raw_output_contents[0], dtype=np.float32)
            cosines.append(float(x @ y / (np.linalg.norm(x) * np.linalg.norm(y))))
    assert min(cosines) > 0.999, f"Triton's and infercache's embeddings differ: cosine {min(cosines):.4f}"
    return {"texts": len(cosines), "min_cosine": round(min(cosines), 6)}


def _misses(triton: TritonPeer, server: ServerProcess, texts: list[str], rounds: int, count: int) -> dict:
    """Distinct texts, each once, at 32 callers: every call a miss (the texts are new to both)."""
    out: dict[str, list[dict]] = {"triton": [], "kserve_door": []}
    for round_ in range(rounds):
        fresh = distinct_texts(texts, count, seed=1000 + round_)
        for name, address, payloads in (("triton", triton.address, [kserve_request(t, batched=True) for t in fresh]),
                                        ("kserve_door", server.address, [kserve_request(t) for t in fresh])):
            result = uvloop.run(run_raw_load(address, MODEL_INFER, payloads, concurrency=32, total=len(payloads)))
            assert result.errors == 0, f"{name} misses: {result.errors} errors"
            out[name].append(result.summary())
    return {"texts_per_round": count, **{name: _medians(samples) for name, samples in out.items()},
            "kserve_door_vs_triton_throughput": round(
                statistics.median(s["throughput_rps"] for s in out["kserve_door"])
                / statistics.median(s["throughput_rps"] for s in out["triton"]), 3)}


def _medians(samples: list[dict]) -> dict:
    keys = [k for k in ("p50_ms", "p99_ms", "throughput_rps", "cpu_ms_per_call") if k in samples[0]]
    return {**{k: statistics.median(s[k] for s in samples) for k in keys},
            "rounds": [{k: s[k] for k in (*keys, "requests")} for s in samples]}


def _report(runs: dict, plan: dict, misses: dict, agreement: dict) -> dict:
    out: dict = {"peer": f"Triton through {TRITON[0]} (Python backend, ONNX Runtime, local response cache "
                         f"{CACHE_BYTES >> 20} MiB, dynamic batcher)",
                 "hits": HITS, "processes": os.cpu_count() or 1, "goals": GOALS, "embeddings_agree": agreement}
    for concurrency in plan:
        row = {name: _medians(by[concurrency]) for name, by in runs.items()}
        ratio = lambda a, b, k: ratio_of(row[a][k], row[b][k])  # noqa: E731
        for name in ("kserve_door", "native_door", "floor", "floor_cpp"):
            if name not in row:
                continue
            row[f"{name}_vs_triton"] = {"p50": ratio(name, "triton", "p50_ms"),
                                        "throughput": ratio(name, "triton", "throughput_rps"),
                                        "cpu_per_call": ratio(name, "triton", "cpu_ms_per_call")}
        row["kserve_door_vs_floor"] = {"p50": ratio("kserve_door", "floor", "p50_ms"),
                                       "throughput": ratio("kserve_door", "floor", "throughput_rps")}
        out[f"concurrency_{concurrency}"] = row
    best = lambda key, c: min(out[f"concurrency_{c}"][f"{n}_vs_triton"][key] for n in ("kserve_door", "native_door"))  # noqa: E731
    out["met"] = {"p50": best("p50", 1) <= GOALS["p50_ratio_max"],
                  "throughput": max(out["concurrency_32"][f"{n}_vs_triton"]["throughput"]
                                    for n in ("kserve_door", "native_door")) >= GOALS["throughput_ratio_min"]}
    out["misses_32_callers"] = misses
    return out


def print_peers_hits(report: dict) -> None:
    if "skipped" in report:
        print(f"\nexact hits against Triton: skipped ({report['skipped']})")
        return
    print(f"\nexact hits against {report['peer']}   p50 ms    p99 ms    req/s   CPU ms/call")
    for key in ("concurrency_1", "concurrency_32"):
        row = report[key]
        for name, figures in row.items():
            if "p50_ms" in figures:
                print(f"  {key:<16} {name:<12} {figures['p50_ms']:8.3f}  {figures['p99_ms']:8.3f}  "
                      f"{figures['throughput_rps']:7.0f}  {figures['cpu_ms_per_call']:8.4f}")
        for name in ("kserve_door", "native_door", "floor", "floor_cpp"):
            if f"{name}_vs_triton" not in row:
                continue
            ratios = row[f"{name}_vs_triton"]
            print(f"  {key:<16} {name} vs Triton: {ratios['p50']:.3f}x p50, {ratios['throughput']:.3f}x throughput, "
                  f"{ratios['cpu_per_call']}x CPU per call")
    misses = report["misses_32_callers"]
    print(f"  misses at 32 callers ({misses['texts_per_round']} texts): Triton {misses['triton']['throughput_rps']:.0f}/s "
          f"p50 {misses['triton']['p50_ms']:.1f} ms; infercache {misses['kserve_door']['throughput_rps']:.0f}/s "
          f"p50 {misses['kserve_door']['p50_ms']:.1f} ms ({misses['kserve_door_vs_triton_throughput']}x)")
    goals, met = report["goals"], report["met"]
    print(f"  goals: p50 <= {goals['p50_ratio_max']}x Triton ({'met' if met['p50'] else 'not met'}), "
          f"throughput >= {goals['throughput_ratio_min']}x ({'met' if met['throughput'] else 'not met'})")
