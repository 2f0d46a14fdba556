"""Doors section (`make bench ARGS="--sections doors"`): exact hits of minilm through each door of one
server (2 frontends per 2 cores, as `serving`), at 1 and 32 callers, rounds alternating, against baselines
measured in the same rounds:

- the OpenAI-compatible HTTP door (POST /v1/embeddings as the openai package sends it: base64) against a
  bare server of its own stack answering a recorded hit's bytes and headers (server/frontend/http1.py with
  a fixed answer: bench/echo.py http_main). Targets: p50 at most 1.2x, throughput at least 0.85x.
- the KServe v2 door (ModelInfer, one BYTES text) against the native door (Infer) of the same server.
  Target: p50 at most 1.15x. Both also against bare grpc.aio servers answering their recorded hits' bytes.
- the HTTP stacks the door could have been built on, bare, with the same fixed answer: the door's own,
  aiohttp's low-level server, granian (a Rust server, RSGI) (bench/http_stacks.py); a stack whose package
  is missing is skipped with a line saying so.

Every generator sends pre-built requests and reads raw answers (bench/http_load.py, bench/load.py
run_raw_load), on uvloop, in this process."""

from __future__ import annotations

import http.client
import importlib.util
import json
import os
import statistics
from pathlib import Path

import grpc
import uvloop

from bench import echo
from bench.gpu import load_one
from bench.http_load import post, run_http_load
from bench.load import INFER, run_raw_load, warm
from bench.sections import Run
from infercache.kserve import grpc_service_pb2 as kpb
from infercache.v1 import infercache_pb2 as pb
from harness.servers import REPO, ServerProcess, free_port, link_model

MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"
HITS = 200  # distinct texts, each a cached entry
TARGETS = {"http_p50_ratio_max": 1.2, "http_throughput_ratio_min": 0.85, "kserve_p50_ratio_max": 1.15}


def kserve_request(text: str, batched: bool = False) -> bytes:
    """ModelInfer of minilm with one BYTES text, serialized: shape [1], or [1, 1] for a server whose
    model batches (Triton's dynamic batcher)."""
    element = text.encode()
    request = kpb.ModelInferRequest(model_name="minilm", inputs=[kpb.ModelInferRequest.InferInputTensor(
        name="text", datatype="BYTES", shape=[1, 1] if batched else [1])],
        raw_input_contents=[len(element).to_bytes(4, "little") + element])
    return request.SerializeToString()


def _recorded_http(port: int, body: bytes) -> tuple[bytes, list[tuple[bytes, bytes]]]:
    """A hit's body and x-infercache headers from the door (the bare server sends the same)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    connection.request("POST", "/v1/embeddings", body, {"content-type": "application/json"})
    response = connection.getresponse()
    answer = response.read()
    assert response.status == 200 and response.getheader("x-infercache-source") == "RESULT_EXACT", response.status
    headers = [(name.encode(), value.encode()) for name, value in response.getheaders() if name.startswith("x-infercache")]
    connection.close()
    return answer, headers


def _stacks_missing() -> dict[str, str]:
    """The other stacks' packages that are missing: {stack: why it is skipped}."""
    return {name: f"{name} is not installed (the bench extra)" for name in ("aiohttp", "granian")
            if importlib.util.find_spec(name) is None}


def bench_doors(workdir: Path, texts: list[str], rounds: int, quick: bool) -> dict:
    models = workdir / "models"
    link_model(models, "minilm", (REPO / "models" / "minilm" / "config.yaml").read_text(),
               {"1": REPO / "models" / "minilm" / "1"})
    (workdir / "server").mkdir()
    processes = os.cpu_count() or 1
    http_port = free_port()
    server = ServerProcess(workdir / "server", models, frontends=processes, engines_dir=workdir / "engines",
                           settings=(f"server.http_port={http_port}",))
    chosen = texts[:HITS]
    warm(server.address, [pb.InferRequest(model="minilm", text=t) for t in chosen])
    http_requests = [post("/v1/embeddings", b'{"model":"minilm","input":%s,"encoding_format":"base64"}'
                          % _json_string(t)) for t in chosen]
    native = [pb.InferRequest(model="minilm", text=t).SerializeToString() for t in chosen]
    kserve = [kserve_request(t) for t in chosen]
    hit_body, hit_headers = _recorded_http(http_port, http_requests[0].split(b"\r\n\r\n", 1)[1])
    started: list = []
    skipped = _stacks_missing()
    try:
        bare_http, procs = echo.start(processes, echo.http_main, hit_body, hit_headers)
        started += procs
        raw_native, procs = echo.start(processes, echo.raw_main, INFER, load_one(server.address, native[0]))
        started += procs
        with grpc.insecure_channel(server.address) as channel:
            kserve_hit = channel.unary_unary(MODEL_INFER, request_serializer=None, response_deserializer=None)(
                kserve[0], timeout=30)
        raw_kserve, procs = echo.start(processes, echo.raw_main, MODEL_INFER, kserve_hit)
        started += procs
        http_targets = {"http_door": ("127.0.0.1", http_port), "http_bare": _host_port(bare_http)}
        if "aiohttp" not in skipped:
            from bench.http_stacks import aiohttp_main

            address, procs = echo.start(processes, aiohttp_main, hit_body, hit_headers)
            started += procs
            http_targets["aiohttp_bare"] = _host_port(address)
        granian = None
        if "granian" not in skipped:
            from bench.http_stacks import start_granian

            port = free_port()
            granian = start_granian(port, processes, hit_body, hit_headers)
            http_targets["granian_bare"] = ("127.0.0.1", port)
        grpc_targets = {"native_door": (server.address, INFER, native), "kserve_door": (server.address, MODEL_INFER, kserve),
                        "native_bare": (raw_native, INFER, native), "kserve_bare": (raw_kserve, MODEL_INFER, kserve)}
        plan = {1: 600 if quick else 3000, 32: 4000 if quick else 20000}
        runs: dict[str, dict[int, list[dict]]] = {name: {1: [], 32: []} for name in (*http_targets, *grpc_targets)}
        for _ in range(rounds):
            for concurrency, total in plan.items():
                for name, (host, port) in http_targets.items():
                    uvloop.run(run_http_load(host, port, http_requests, concurrency=concurrency, total=total // 10))
                    result = uvloop.run(run_http_load(host, port, http_requests, concurrency=concurrency, total=total))
                    assert result.errors == 0, f"{name}: {result.errors} errors"
                    assert result.sources == {"RESULT_EXACT": result.requests}, (name, result.sources)
                    runs[name][concurrency].append(result.summary())
                for name, (address, method, payloads) in grpc_targets.items():
                    uvloop.run(run_raw_load(address, method, payloads, concurrency=concurrency, total=total // 10))
                    result = uvloop.run(run_raw_load(address, method, payloads, concurrency=concurrency, total=total))
                    assert result.errors == 0, f"{name}: {result.errors} errors"
                    runs[name][concurrency].append(result.summary())
        check_hits(server.address, kserve)
    finally:
        echo.stop(started)
        if granian is not None:
            granian.terminate()
            granian.wait(10)
        assert server.stop() == 0
    return _report(runs, plan, skipped)


def _json_string(text: str) -> bytes:
    return json.dumps(text).encode()


def _host_port(address: str) -> tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host, int(port)


def check_hits(address: str, kserve: list[bytes]) -> None:
    """Every KServe request was a hit (the generator does not read sources): asked once more."""
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary(MODEL_INFER, request_serializer=None, response_deserializer=None)
        for payload in kserve[:20]:
            answer = kpb.ModelInferResponse.FromString(call(payload, timeout=30))
            assert answer.parameters["cache_source"].string_param == "RESULT_EXACT", answer.parameters


def _report(runs: dict, plan: dict, skipped: dict) -> dict:
    out: dict = {"hits": HITS, "processes_per_server": os.cpu_count() or 1, "targets": TARGETS}
    for concurrency in plan:
        row = {}
        for name, by in runs.items():
            samples = by[concurrency]
            row[name] = {k: statistics.median(s[k] for s in samples) for k in ("p50_ms", "p99_ms", "throughput_rps")}
            row[name]["rounds"] = [{k: s[k] for k in ("p50_ms", "p99_ms", "throughput_rps", "requests")} for s in samples]
        ratio = lambda a, b, k: round(row[a][k] / row[b][k], 3)  # noqa: E731
        row["http_door_vs_bare"] = {"p50": ratio("http_door", "http_bare", "p50_ms"),
                                    "throughput": ratio("http_door", "http_bare", "throughput_rps")}
        row["kserve_vs_native_door"] = {"p50": ratio("kserve_door", "native_door", "p50_ms"),
                                        "throughput": ratio("kserve_door", "native_door", "throughput_rps")}
        row["native_door_vs_bare"] = {"p50": ratio("native_door", "native_bare", "p50_ms"),
                                      "throughput": ratio("native_door", "native_bare", "throughput_rps")}
        row["kserve_door_vs_bare"] = {"p50": ratio("kserve_door", "kserve_bare", "p50_ms"),
                                      "throughput": ratio("kserve_door", "kserve_bare", "throughput_rps")}
        row["http_door_vs_native_door"] = {"p50": ratio("http_door", "native_door", "p50_ms"),
                                           "throughput": ratio("http_door", "native_door", "throughput_rps")}
        out[f"concurrency_{concurrency}"] = row
    one, many = out["concurrency_1"], out["concurrency_32"]
    out["met"] = {
        "http_p50": one["http_door_vs_bare"]["p50"] <= TARGETS["http_p50_ratio_max"],
        "http_throughput": many["http_door_vs_bare"]["throughput"] >= TARGETS["http_throughput_ratio_min"],
        "kserve_p50": one["kserve_vs_native_door"]["p50"] <= TARGETS["kserve_p50_ratio_max"],
    }
    if skipped:
        out["stacks_skipped"] = skipped
    return out


def print_doors(report: dict) -> None:
    print("\ndoors: exact hits (median of rounds)   p50 ms    p99 ms    req/s")
    for key in ("concurrency_1", "concurrency_32"):
        row = report[key]
        for name, figures in row.items():
            if "p50_ms" in figures:
                print(f"  {key:<16} {name:<14} {figures['p50_ms']:8.3f}  {figures['p99_ms']:8.3f}  "
                      f"{figures['throughput_rps']:7.0f}")
        for name in ("http_door_vs_bare", "kserve_vs_native_door", "native_door_vs_bare", "kserve_door_vs_bare"):
            print(f"  {key:<16} {name:<24} {row[name]['p50']:.3f}x p50  {row[name]['throughput']:.3f}x throughput")
    targets, met = report["targets"], report["met"]
    print(f"  targets: HTTP p50 <= {targets['http_p50_ratio_max']}x bare ({'met' if met['http_p50'] else 'not met'}), "
          f"HTTP throughput >= {targets['http_throughput_ratio_min']}x bare "
          f"({'met' if met['http_throughput'] else 'not met'}), KServe p50 <= {targets['kserve_p50_ratio_max']}x "
          f"native ({'met' if met['kserve_p50'] else 'not met'})")
    for name, why in report.get("stacks_skipped", {}).items():
        print(f"  stack {name} skipped: {why}")


def section(run: Run) -> None:
    print("benchmarking the doors (OpenAI-compatible HTTP, KServe v2) on exact hits ...", flush=True)
    (run.workdir / "doors").mkdir()
    run.report["doors"] = bench_doors(run.workdir / "doors", run.texts, run.rounds, run.quick)
    print_doors(run.report["doors"])
