"""Batches by length group against batches by bucket (`make bench ARGS="--sections groups"`).

Two servers of the shipped minilm on ONNX Runtime, one with `server.length_groups` on (the default), one
with it off, both up for the whole run; rounds alternate between them. Every call is a real miss: 32
callers, distinct Banking77 texts, a fresh tenant per round. ONNX Runtime pads a batch to its longest
row, so a batch cut from a bucket of 16 tokens computes every row at up to 16 tokens; cut by group, at
most a quarter more than its own length.
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path

from bench.l2 import CALLERS, LOAD_PROCESSES, _requests, distinct_texts
from bench.load import minilm_only, run_each_once
from bench.sections import Run
from harness.servers import ServerProcess

VARIANTS = {"groups": (), "buckets": ("server.length_groups=false",)}


def _misses(server: ServerProcess, texts: list[str], tenant: str) -> dict:
    result = run_each_once(server.address, _requests("minilm", texts, tenant), concurrency=CALLERS, processes=LOAD_PROCESSES, timeout=120)
    summary = result.summary()
    assert result.errors == 0 and summary["sources"] == {"MISS": len(texts)}, summary
    return summary


def bench_length_groups(workdir: Path, rounds: int, quick: bool, out: dict, checkpoint=lambda: None) -> None:
    models = minilm_only(workdir / "models")
    texts = distinct_texts()
    per_round = min(300 if quick else 1500, (len(texts) - 300) // rounds)
    servers: dict[str, ServerProcess] = {}
    try:
        for name, settings in VARIANTS.items():
            (workdir / name).mkdir(parents=True)
            servers[name] = ServerProcess(workdir / name, models, frontends=os.cpu_count() or 1,
                                          engines_dir=workdir / "engines", settings=settings)
            _misses(servers[name], texts[-300:], "warm-up")  # the engine's first batches of each shape
        runs: dict[str, list[dict]] = {name: [] for name in VARIANTS}
        for n in range(rounds):
            print(f"  round {n + 1} of {rounds} ...", flush=True)
            chosen = texts[n * per_round:(n + 1) * per_round]
            for name in VARIANTS if n % 2 == 0 else reversed(VARIANTS):
                runs[name].append(_misses(servers[name], chosen, f"round-{n}"))
        for name, samples in runs.items():
            out[name] = {k: statistics.median(s[k] for s in samples) for k in ("throughput_rps", "p50_ms", "p99_ms")}
            out[name]["rounds"] = samples
        out["texts_per_round"] = per_round
        out["ratio_by_round"] = [round(g["throughput_rps"] / b["throughput_rps"], 3)
                                 for g, b in zip(runs["groups"], runs["buckets"])]
        out["throughput_ratio"] = round(out["groups"]["throughput_rps"] / out["buckets"]["throughput_rps"], 3)
        checkpoint()
    finally:
        for server in servers.values():
            assert server.stop() == 0


def print_length_groups(result: dict) -> None:
    groups, buckets = result["groups"], result["buckets"]
    print("\n## Batches by length group (ONNX Runtime, minilm misses)\n")
    print("| what | by length group | by bucket (`server.length_groups=false`) |\n| --- | --- | --- |")
    print(f"| misses at {CALLERS} callers, req/s (median of rounds) | {groups['throughput_rps']:.0f} "
          f"({result['throughput_ratio']:.2f}x; by round {', '.join(f'{r:.2f}' for r in result['ratio_by_round'])}) "
          f"| {buckets['throughput_rps']:.0f} |")
    print(f"| p50 / p99 | {groups['p50_ms']:.0f} / {groups['p99_ms']:.0f} ms | {buckets['p50_ms']:.0f} / "
          f"{buckets['p99_ms']:.0f} ms |")


def section(run: Run) -> None:
    print("benchmarking batches by length group against by bucket (ONNX Runtime misses) ...", flush=True)
    run.report["length_groups"] = {}
    bench_length_groups(run.workdir / "groups", run.rounds, run.quick, run.report["length_groups"], checkpoint=run.save)
    print_length_groups(run.report["length_groups"])
