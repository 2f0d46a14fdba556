"""Security section (`make bench ARGS="--sections security"`): what authentication, encryption at rest
and PII redaction cost on the exact-hit path, and what redaction costs per text.

Two servers with the same weights, filled with the same Banking77 hits: one with everything off, one
with a token file (every call carries its token), an encryption key (every hit opens an AES-256-GCM
record) and `privacy.pii: redact` (every text goes through the redaction step). One frontend each: with
two, SO_REUSEPORT hashes the load generator's connections unevenly onto them, differently for each server,
and at 32 callers that imbalance moved p50 by up to 40% between two identical servers.

The load generator is one Python process, and gRPC Python's client spends 40-80 us of its own CPU per
call on sending a metadata header (measured: 200 -> 240-280 us per call), which on a shared machine
slows whatever it measures. So the "off" server is called twice: as is ("off") and with the same token
header it ignores ("off_token"): on / off_token is the server's cost (the target), on / off adds the
Python client's. Each round starts a fresh pair of servers and alternates which is measured first: a
process keeps its place on the machine's cores for its life, and on an H200 host that alone moved
one-caller p50 between 0.70 and 0.97 ms across identical servers. On a host of 8 CPUs or more the load
generator runs on two physical cores of its own and the servers on the rest (bench/cores.py). Medians over rounds at 1 and 32 callers; each frontend's CPU per hit (its CPU seconds
over a 32-caller run, from /proc). Then redaction alone, in this process, over every
Banking77 text: the normalizer with and without its redaction step.

The target's figure is the median over rounds of each round's on / off_token p50: the two servers of a
round are measured back to back, in alternating order, so a round's ratio cancels what the machine's
load does to that round, which a ratio of the medians over rounds does not (it is reported too).
"""

from __future__ import annotations

import asyncio
import base64
import os
import statistics
import time
from pathlib import Path

import yaml

from bench import cores
from bench.probes import cpu_during, frontend_pids
from bench.load import minilm_only, run_load, warm
from bench.sections import Run
from harness.servers import ServerProcess
from infercache.v1 import infercache_pb2 as pb

HITS = 200


REDACT = "privacy:\n  pii: redact\n"


def _servers(workdir: Path, frontends: int, round_: int, token: str) -> tuple[ServerProcess, ServerProcess]:
    """A fresh pair for each round. Hits never reach the engine, so both serve on ONNX Runtime (a GPU
    host's torch-cuda start is 15 s of nothing measured here)."""
    secrets = workdir / "secrets"
    if not secrets.exists():
        secrets.mkdir(mode=0o700)
        (secrets / "tokens.yaml").write_text(yaml.safe_dump([{"token": token, "role": "client"}]))
        (secrets / "key").write_text(base64.b64encode(os.urandom(32)).decode() + "\n")
    common = {"frontends": frontends, "engines_dir": workdir / "engines"}
    runtime = ("engines.runtime=onnxruntime",)
    for name in ("off", "on"):
        (workdir / f"{name}{round_}").mkdir()
    off = ServerProcess(workdir / f"off{round_}", minilm_only(workdir / f"models-off{round_}"), **common,
                        settings=runtime)
    on = ServerProcess(workdir / f"on{round_}", minilm_only(workdir / f"models-on{round_}", REDACT), **common,
                       client_options={"token": token},
                       settings=(*runtime, f"security.tokens_file={secrets / 'tokens.yaml'}",
                                 f"cache.encryption_key_file={secrets / 'key'}"))
    return off, on


def frontend_cpu_us_per_hit(server: ServerProcess, requests: list, total: int, metadata) -> float:
    """The frontends' CPU seconds over a 32-caller run of hits, per hit, in microseconds."""
    result, cpu_s = cpu_during(frontend_pids(server), lambda: asyncio.run(
        run_load(server.address, requests, concurrency=32, total=total, metadata=metadata)))
    assert result.errors == 0
    return round(1e6 * cpu_s / result.requests, 1)


def bench_hit_path(workdir: Path, texts: list[str], rounds: int, scale: float, frontends: int = 1) -> dict:
    workdir.mkdir(parents=True)
    token = base64.b64encode(os.urandom(32)).decode()
    metadata = (("authorization", f"Bearer {token}"),)
    chosen = texts[:HITS]
    requests = [pb.InferRequest(model="minilm", text=t) for t in chosen]
    plan = {1: int(3000 * scale), 32: int(20000 * scale)}
    names = ("off", "off_token", "on")
    runs: dict[str, dict[int, list[dict]]] = {name: {1: [], 32: []} for name in names}
    cpu_runs: dict[str, list[float]] = {name: [] for name in names}
    placement = cores.split()
    for round_ in range(rounds):
        with cores.affinity(placement and placement.servers):
            off, on = _servers(workdir, frontends, round_, token)
        calls = (("off", off, None), ("off_token", off, metadata), ("on", on, metadata))
        try:
            with cores.affinity(placement and placement.load):
                for server, md in ((off, None), (on, metadata)):
                    warm(server.address, requests, md)
                for name, server, md in (calls if round_ % 2 == 0 else calls[::-1]):  # neither always first
                    for concurrency, total in plan.items():
                        asyncio.run(run_load(server.address, requests, concurrency=concurrency, total=total // 10,
                                             metadata=md))
                        result = asyncio.run(run_load(server.address, requests, concurrency=concurrency, total=total,
                                                      metadata=md))
                        assert result.errors == 0, f"{name}: {result.errors} errors"
                        assert result.sources == {"RESULT_EXACT": result.requests}, (name, result.sources)
                        runs[name][concurrency].append(result.summary())
                    cpu_runs[name].append(frontend_cpu_us_per_hit(server, requests, plan[32], md))
                unsealable = int(on.stats().frontend.counters.get("l1.records_unsealable", 0))
        finally:
            assert off.stop() == 0 and on.stop() == 0
    cpu = {name: statistics.median(values) for name, values in cpu_runs.items()}
    out: dict = {"frontends": frontends, "hits_cycled": len(chosen),
                 "placement": placement.describe() if placement else "scheduler (fewer than 8 CPUs)"}
    for concurrency in plan:
        row: dict = {name: {k: statistics.median(s[k] for s in runs[name][concurrency])
                      for k in ("p50_ms", "p99_ms", "throughput_rps")} for name in runs}
        for base in ("off_token", "off"):
            row[f"p50_ratio_vs_{base}"] = round(row["on"]["p50_ms"] / row[base]["p50_ms"], 3)
            row[f"throughput_ratio_vs_{base}"] = round(row["on"]["throughput_rps"] / row[base]["throughput_rps"], 3)
            paired = [on["p50_ms"] / off["p50_ms"] for on, off in zip(runs["on"][concurrency], runs[base][concurrency])]
            row[f"p50_ratio_paired_vs_{base}"] = round(statistics.median(paired), 3)
            row[f"p50_ratios_by_round_vs_{base}"] = [round(r, 3) for r in paired]
        row["rounds"] = {name: runs[name][concurrency] for name in runs}
        out[f"concurrency_{concurrency}"] = row
    out["frontend_cpu_us_per_hit"] = {**cpu, "ratio_vs_off_token": round(cpu["on"] / cpu["off_token"], 3)}
    out["unsealable_records_seen"] = unsealable
    return out


def bench_redaction(texts: list[str]) -> dict:
    """Per text: the PII step alone, and the whole normalizer with it against without it."""
    from server.shared import pii
    from server.shared.normalize import DEFAULT_STEPS, REDACTING_STEPS, Normalizer, nfkc

    plain, redacting = Normalizer(DEFAULT_STEPS), Normalizer(REDACTING_STEPS)
    prepared = [nfkc(t) for t in texts]

    def per_text_us(fn, items) -> float:
        best = float("inf")
        for _ in range(5):
            started = time.perf_counter()
            for item in items:
                fn(item)
            best = min(best, (time.perf_counter() - started) / len(items) * 1e6)
        return round(best, 3)

    changed = [t for t in prepared if pii.redact(t) != t]
    return {
        "texts": len(texts),
        "redact_step_us": per_text_us(pii.redact, prepared),
        "normalizer_us": per_text_us(plain, texts),
        "normalizer_with_redaction_us": per_text_us(redacting, texts),
        "texts_changed": len(changed),
        "changed_examples": changed[:10],
    }


def print_security(report: dict) -> None:
    hits = report["hit_path"]
    print(f"\nexact hits, auth + encryption + redaction on vs all off ({hits['frontends']} frontend(s); "
          "median of rounds)")
    print("                              p50 ms    p99 ms    req/s")
    for key in ("concurrency_1", "concurrency_32"):
        row = hits[key]
        for name in ("off", "off_token", "on"):
            r = row[name]
            print(f"  {key:<16} {name:<9} {r['p50_ms']:8.3f}  {r['p99_ms']:8.3f}  {r['throughput_rps']:7.0f}")
        for base in ("off_token", "off"):
            print(f"  {key:<16} on / {base:<9} p50 {row[f'p50_ratio_paired_vs_{base}']:.3f}x by round"
                  f"{' (target <= 1.15)' if base == 'off_token' else ''} ({row[f'p50_ratio_vs_{base}']:.3f}x of the "
                  f"medians), throughput {row[f'throughput_ratio_vs_{base}']:.3f}x")
    cpu = hits["frontend_cpu_us_per_hit"]
    print(f"  frontend CPU per hit: off {cpu['off']} us, off_token {cpu['off_token']} us, on {cpu['on']} us "
          f"= {cpu['ratio_vs_off_token']}x")
    red = report["redaction"]
    print(f"redaction on {red['texts']} Banking77 texts: {red['redact_step_us']} us per text for the step; normalizer "
          f"{red['normalizer_us']} -> {red['normalizer_with_redaction_us']} us; {red['texts_changed']} texts changed")


def section(run: Run) -> None:
    print("benchmarking auth + encryption + redaction on the hit path ...", flush=True)
    run.report["security"] = {"hit_path": bench_hit_path(run.workdir / "security", run.texts, 2 * run.rounds - 1,
                                                         run.scale),
                              "redaction": bench_redaction(run.texts)}
    print_security(run.report["security"])
