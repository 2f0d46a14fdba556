"""Misses against infinity (`--sections peers`, part infinity): on the lent GPU through bench/device.sh,
elsewhere a dry run on the CPU, labelled so.

Both servers embed with the same MiniLM (`source`: its Hugging Face folder; on the GPU machine random
weights of its shape, bench/device.sh), called through the same OpenAI-compatible route by the same
generator: infercache's door (`POST /v1/embeddings`, torch-cuda FP16 under CUDA graphs, the gpu
section's MiniLM settings and frontends) and infinity 0.0.78 (`POST /embeddings`, its torch engine in
fp16, batches of 128 as infercache's, in its own virtualenv: bench/peer_envs.py). As the gpu section's
miss runs: 8 load processes (bench/http_load.py run_http_processes), one text per call at 32 calls in
flight each, and 32 texts per call at 4 each; every text distinct (misses), the servers alternating.
Figures: texts/s, p50/p99 per call, and host CPU per text (every process of each server).
"""

from __future__ import annotations

import json
import os
import urllib.request
from pathlib import Path


from bench.fixtures import distinct_texts, make_gpu_models
from bench.http_load import post, run_http_processes
from bench.peer_envs import INFINITY, PeerEnv, PeerServer, infinity_env
from bench.probes import cpu_during, gpu_available, server_roles
from harness.servers import REPO, ServerProcess, free_port

GOALS = {"single_ratio_min": 1.5, "batch32_ratio_min": 1.0}  # infercache's texts/s over infinity's
SHAPES = {"single": (1, 32), "batch32": (32, 4)}  # texts per call, calls in flight per load process


class InfinityPeer(PeerServer):
    """infinity's server (`infinity_emb v2`) on `source`."""

    def __init__(self, env: PeerEnv, source: Path, workdir: Path, on_gpu: bool) -> None:
        self.port = free_port()
        args = [str(env.python), "-c", "import sys; from infinity_emb.cli import cli; sys.argv[0] = 'infinity_emb'; cli()",
                "v2", "--model-id", str(source), "--served-model-name",
                "minilm", "--engine", "torch", "--device", "cuda" if on_gpu else "cpu", "--batch-size", "128",
                "--port", str(self.port), "--host", "127.0.0.1", *(["--dtype", "float16"] if on_gpu else [])]
        super().__init__(args, {**env.env, "DO_NOT_TRACK": "1", "INFINITY_ANONYMOUS_USAGE_STATS": "0",
                                "HF_HUB_OFFLINE": "1"}, workdir)
        self.wait_until(self._healthy, "infinity")

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False


def minilm_source() -> Path:
    """MiniLM's Hugging Face folder: the GPU machine's (bench/device.sh makes .devcarry/minilm-fp16, from
    which models/minilm/1 is exported), else the weights' package here."""
    carried = REPO / ".devcarry" / "minilm-fp16"
    if (carried / "config.json").is_file() and (carried / "model.safetensors").is_file():
        return carried
    from server.tools.export_model import default_encoder_dir

    return default_encoder_dir()


def _bodies(path: str, texts: list[str], per_call: int) -> list[bytes]:
    return [post(path, json.dumps({"model": "minilm", "input": texts[i:i + per_call]}).encode())
            for i in range(0, len(texts) - per_call + 1, per_call)]


def bench_peers_infinity(workdir: Path, texts: list[str], source: Path, rounds: int, quick: bool) -> dict:
    on_gpu = gpu_available()
    env = infinity_env()
    if isinstance(env, str):
        print(f"  infinity skipped: {env}", flush=True)
        return {"skipped": env}
    processes = min(8, os.cpu_count() or 1)
    frontends = min(16, os.cpu_count() or 1)
    runtime = "torch-cuda" if on_gpu else "onnxruntime"
    models = make_gpu_models(workdir / "models", False)
    http_port = free_port()
    (workdir / "server").mkdir(parents=True)
    calls = {"single": 40_000, "batch32": 4_000} if on_gpu else {"single": 600, "batch32": 40}
    if quick:
        calls = {name: n // 4 for name, n in calls.items()}
    runs: dict[str, dict[str, list[dict]]] = {name: {"infercache": [], "infinity": []} for name in SHAPES}
    infinity = None
    with ServerProcess(workdir / "server", models, frontends=frontends, engines_dir=workdir / "engines",
                       settings=(f"engines.runtime={runtime}", f"server.http_port={http_port}",
                                 "server.max_queue=16384")) as server:
        try:
            infinity = InfinityPeer(env, source, workdir / "infinity", on_gpu)
            targets = {"infercache": (http_port, "/v1/embeddings", list(server_roles(server))),
                       "infinity": (infinity.port, "/embeddings", infinity.pids())}
            seed = 100
            for name, (per_call, in_flight) in SHAPES.items():
                for _ in range(rounds):
                    for peer, (port, path, pids) in targets.items():
                        seed += 1
                        bodies = _bodies(path, distinct_texts(texts, calls[name] * per_call, seed), per_call)
                        result, cpu_s = cpu_during(pids, lambda: run_http_processes(
                            "127.0.0.1", port, bodies, processes=processes, concurrency=in_flight))
                        assert result.errors == 0, f"{peer}: {result.errors} errors"
                        row = result.summary()
                        row.pop("sources")
                        row.update({"texts_per_s": round(result.requests * per_call / result.seconds, 1),
                                    "cpu_ms_per_text": round(1000 * cpu_s / (result.requests * per_call), 4)})
                        runs[name][peer].append(row)
                        print(f"    {name} {peer}: {row['texts_per_s']:.0f} texts/s, p50 {row['p50_ms']} ms", flush=True)
        finally:
            if infinity is not None:
                infinity.stop()
    return _report(runs, on_gpu, processes, frontends)


def _report(runs: dict, on_gpu: bool, processes: int, frontends: int) -> dict:
    import statistics

    out: dict = {"peer": f"infinity ({INFINITY[0]}, torch engine{', fp16' if on_gpu else ''}, batch size 128)",
                 "dry_run_on_cpu": not on_gpu, "load_processes": processes, "frontends": frontends, "goals": GOALS}
    for name, (per_call, in_flight) in SHAPES.items():
        row = {"texts_per_call": per_call, "calls_in_flight": in_flight * processes}
        for peer, samples in runs[name].items():
            row[peer] = {k: statistics.median(s[k] for s in samples) for k in
                         ("texts_per_s", "p50_ms", "p99_ms", "cpu_ms_per_text")} | {"rounds": samples}
        row["texts_per_s_ratio"] = round(row["infercache"]["texts_per_s"] / row["infinity"]["texts_per_s"], 3)
        out[name] = row
    out["met"] = {"single": out["single"]["texts_per_s_ratio"] >= GOALS["single_ratio_min"],
                  "batch32": out["batch32"]["texts_per_s_ratio"] >= GOALS["batch32_ratio_min"]}
    return out


def print_peers_infinity(report: dict) -> None:
    if "skipped" in report:
        print(f"\nmisses against infinity: skipped ({report['skipped']})")
        return
    label = " (dry run on the CPU)" if report["dry_run_on_cpu"] else ""
    print(f"\nmisses against {report['peer']}{label}")
    for name in SHAPES:
        row = report[name]
        for peer in ("infercache", "infinity"):
            figures = row[peer]
            print(f"  {name:<8} {peer:<10} {figures['texts_per_s']:9.0f} texts/s  p50 {figures['p50_ms']:8.2f} ms  "
                  f"p99 {figures['p99_ms']:8.2f} ms  CPU {figures['cpu_ms_per_text']:.4f} ms/text")
        print(f"  {name:<8} infercache / infinity: {row['texts_per_s_ratio']}x texts/s")
    print(f"  goals: {report['goals']}; met: {report['met']}")
