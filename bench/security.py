"""Security section (`make bench ARGS="--sections security"`): what authentication, encryption at rest
and PII redaction cost on the exact-hit path, and what redaction costs per text.

Two servers with the same weights, filled with the same Banking77 hits: one with everything off, one
with a token file (every call carries its token), an encryption key (every hit opens an AES-256-GCM
record) and `privacy.pii: redact` (every text goes through the redaction step). One frontend each: with
two, SO_REUSEPORT hashes the load generator's connections unevenly onto them, differently for each server,
and at 32 callers that imbalance moved p50 by up to 40% between two identical servers. Rounds alternate
between them at 1 and 32 callers; medians over rounds and the ratios; then each frontend's CPU per hit
(its CPU seconds over a run, from /proc). Then redaction alone, in this process, over every Banking77
text: the normalizer with and without its redaction step.
"""

from __future__ import annotations

import asyncio
import base64
import os
import statistics
import time
from pathlib import Path

import yaml

from bench.gpu import _children, _cpu_seconds
from bench.load import run_load
from infercache.testing import REPO, ServerProcess
from infercache.v1 import infercache_pb2 as pb

HITS = 200


def _models(root: Path, redact: bool) -> Path:
    (root / "minilm").mkdir(parents=True)
    config = (REPO / "models" / "minilm" / "config.yaml").read_text()
    if redact:
        config += "privacy:\n  pii: redact\n"
    (root / "minilm" / "config.yaml").write_text(config)
    (root / "minilm" / "1").symlink_to(REPO / "models" / "minilm" / "1")
    return root


def _servers(workdir: Path, frontends: int) -> tuple[ServerProcess, ServerProcess, tuple]:
    token = base64.b64encode(os.urandom(32)).decode()
    secrets = workdir / "secrets"
    secrets.mkdir(mode=0o700)
    (secrets / "tokens.yaml").write_text(yaml.safe_dump([{"token": token, "role": "client"}]))
    (secrets / "key").write_text(base64.b64encode(os.urandom(32)).decode() + "\n")
    engines = workdir / "engines"
    for name in ("off", "on"):
        (workdir / name).mkdir()
    off = ServerProcess(workdir / "off", _models(workdir / "models-off", False), frontends=frontends,
                        engines_dir=engines)
    on = ServerProcess(workdir / "on", _models(workdir / "models-on", True), frontends=frontends,
                       engines_dir=engines, client_options={"token": token},
                       settings=(f"security.tokens_file={secrets / 'tokens.yaml'}",
                                 f"cache.encryption_key_file={secrets / 'key'}"))
    return off, on, (("authorization", f"Bearer {token}"),)


def _warm(server: ServerProcess, texts: list[str]) -> None:
    with server.client() as client:
        for text in texts:
            client.infer("minilm", text)
        deadline = time.monotonic() + 60
        for text in texts:
            while True:
                try:
                    client.infer("minilm", text, mode="ONLY_IF_CACHED")
                    break
                except Exception:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.01)


def frontend_cpu_us_per_hit(server: ServerProcess, requests: list, total: int, metadata) -> float:
    """The frontends' CPU seconds over a 32-caller run of hits, per hit, in microseconds."""
    pids = [pid for pid in _children(server.proc.pid) if pid not in {w.pid for w in server.stats().workers}]
    before = sum(_cpu_seconds(pid) for pid in pids)
    result = asyncio.run(run_load(server.address, requests, concurrency=32, total=total, metadata=metadata))
    assert result.errors == 0
    return round(1e6 * (sum(_cpu_seconds(pid) for pid in pids) - before) / result.requests, 1)


def bench_hit_path(workdir: Path, texts: list[str], rounds: int, scale: float, frontends: int = 1) -> dict:
    workdir.mkdir(parents=True)
    off, on, metadata = _servers(workdir, frontends)
    chosen = texts[:HITS]
    requests = [pb.InferRequest(model="minilm", text=t) for t in chosen]
    plan = {1: int(3000 * scale), 32: int(20000 * scale)}
    runs: dict[str, dict[int, list[dict]]] = {"off": {1: [], 32: []}, "on": {1: [], 32: []}}
    try:
        for server in (off, on):
            _warm(server, chosen)
        for _ in range(rounds):
            for name, server, md in (("off", off, None), ("on", on, metadata)):
                for concurrency, total in plan.items():
                    asyncio.run(run_load(server.address, requests, concurrency=concurrency, total=total // 10,
                                         metadata=md))
                    result = asyncio.run(run_load(server.address, requests, concurrency=concurrency, total=total,
                                                  metadata=md))
                    assert result.errors == 0, f"{name}: {result.errors} errors"
                    assert result.sources == {"RESULT_EXACT": result.requests}, (name, result.sources)
                    runs[name][concurrency].append(result.summary())
        cpu = {name: statistics.median(frontend_cpu_us_per_hit(server, requests, plan[32], md) for _ in range(rounds))
               for name, server, md in (("off", off, None), ("on", on, metadata))}
        counters = on.stats().frontend.counters
    finally:
        assert off.stop() == 0 and on.stop() == 0
    out: dict = {"frontends": frontends, "hits_cycled": len(chosen)}
    for concurrency in plan:
        row = {name: {k: statistics.median(s[k] for s in runs[name][concurrency])
                      for k in ("p50_ms", "p99_ms", "throughput_rps")} for name in runs}
        row["p50_ratio"] = round(row["on"]["p50_ms"] / row["off"]["p50_ms"], 3)
        row["throughput_ratio"] = round(row["on"]["throughput_rps"] / row["off"]["throughput_rps"], 3)
        row["rounds"] = {name: runs[name][concurrency] for name in runs}
        out[f"concurrency_{concurrency}"] = row
    out["frontend_cpu_us_per_hit"] = {**cpu, "ratio": round(cpu["on"] / cpu["off"], 3)}
    out["unsealable_records_seen"] = int(counters.get("l1.records_unsealable", 0))
    return out


def bench_redaction(texts: list[str]) -> dict:
    """Per text: the PII step alone, and the whole normalizer with it against without it."""
    from server import pii
    from server.normalize import DEFAULT_STEPS, REDACTING_STEPS, Normalizer, nfkc

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
    print("                         p50 ms    p99 ms    req/s")
    for key in ("concurrency_1", "concurrency_32"):
        row = hits[key]
        for name in ("off", "on"):
            r = row[name]
            print(f"  {key:<16} {name:<4} {r['p50_ms']:8.3f}  {r['p99_ms']:8.3f}  {r['throughput_rps']:7.0f}")
        print(f"  {key:<16} on/off p50 {row['p50_ratio']:.3f}x (target <= 1.15), "
              f"throughput {row['throughput_ratio']:.3f}x")
    cpu = hits["frontend_cpu_us_per_hit"]
    print(f"  frontend CPU per hit: off {cpu['off']} us, on {cpu['on']} us = {cpu['ratio']}x")
    red = report["redaction"]
    print(f"redaction on {red['texts']} Banking77 texts: {red['redact_step_us']} us per text for the step; normalizer "
          f"{red['normalizer_us']} -> {red['normalizer_with_redaction_us']} us; {red['texts_changed']} texts changed")
