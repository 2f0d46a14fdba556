"""Does shadow verification delay foreground misses? Miss p50 with hits verified vs none.

Three servers run side by side: banking77 with the calibrated rule and `verify_fraction` 0 (verification
off), 0.1 (the default) or 1.0 (every hit verified). Each is warmed with 80% of the rows (semantic on,
DEFAULT: the rule learns its threshold from the misses), then left to settle: the checks of the warm-up's
hits run and their answers are stored and indexed (so the verifying servers hold those answers as
entries of their own, which "off" does not), and the measurement is of verification at steady state,
not of a warm-up's backlog still draining.

Then short segments, one server at a time, the order rotating: 16 callers replay the other 20% with
NO_STORE (mostly semantic hits, verified as set) while 2 callers send texts never seen before with
matching off (every one a miss); the hits stop with the misses, and the server settles (its checks
done) before the next segment. A cycle is one segment per server, so each setting is read against the
"off" segment of its own cycle, seconds apart: the machine's drift (other tenants, a shared host) that
made minute-apart runs scatter by 20% cancels out. Reported: the median over cycles of each setting's
miss p50 over "off"'s, beside the p50 of all segments' misses pooled per setting and the checks run
(those still waiting when a segment's misses ended are counted apart: they ran during the settling).
banking77 is a head on the embedder, so a check here runs the head only; a whole-graph model's check
runs the encoder too.
"""

from __future__ import annotations

import asyncio
import statistics
import time
import uuid
from collections import Counter
from contextlib import ExitStack
from pathlib import Path

import grpc
import numpy as np

from bench import BANKING77
from bench.load import run_load
from bench.semantic import banking77_with, train_banking77
from harness.servers import ServerProcess
from infercache.v1 import infercache_pb2 as pb
from infercache.v1 import infercache_pb2_grpc
from server.tools.labelled_csv import read_labelled_csv
from server.tools.semantic_eval import send_all

HIT_CALLERS, MISS_CALLERS = 16, 2
FRACTIONS = {"off": 0.0, "default": 0.1, "every_hit": 1.0}  # verify_fraction of each setting
SETTINGS = tuple(FRACTIONS)
SETTLE_TIMEOUT_S = 120.0


async def _warm(address: str, warm: list[str]) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        await send_all(infercache_pb2_grpc.InferenceCacheStub(channel),
                       [pb.InferRequest(model="banking77", text=t) for t in warm], 16)


async def _hits_until(address: str, hits: list[pb.InferRequest], done: asyncio.Future) -> dict:
    """HIT_CALLERS replaying `hits` in turn until `done`: requests sent and semantic hits answered."""
    counts = {"requests": 0, "semantic_hits": 0}
    order = iter(range(1 << 62))
    async with grpc.aio.insecure_channel(address) as channel:
        stub = infercache_pb2_grpc.InferenceCacheStub(channel)

        async def caller() -> None:
            while not done.done():
                response = await stub.Infer(hits[next(order) % len(hits)], timeout=30)
                counts["requests"] += 1
                counts["semantic_hits"] += response.cache.source == pb.CacheInfo.RESULT_SEMANTIC

        await asyncio.gather(*(caller() for _ in range(HIT_CALLERS)))
    return counts


async def _segment(address: str, replay: list[str], misses: int) -> dict:
    tag = uuid.uuid4().hex[:8]
    novel = [pb.InferRequest(model="banking77", text=f"{replay[n % len(replay)]} ({tag} {n})",
                             semantic=pb.SemanticPolicy(enabled=False)) for n in range(misses)]
    hits = [pb.InferRequest(model="banking77", text=t, cache=pb.CachePolicy(mode=pb.CachePolicy.NO_STORE))
            for t in replay]
    foreground = asyncio.ensure_future(run_load(address, novel, concurrency=MISS_CALLERS, total=misses))
    background = await _hits_until(address, hits, foreground)
    missed = await foreground
    assert missed.errors == 0, f"{missed.errors} misses failed"
    return {"latencies_ms": missed.latencies_ms, **background}


def _figures(counters: Counter) -> dict:
    return {name: counters.get(f"semantic.{name}", 0)
            for name in ("banking77.1.verified", "shadow_pending", "shadow_unidle", "shadow_deferred", "shadow_dropped")}


def _counters(server: ServerProcess) -> Counter:
    """Every worker's counters, summed."""
    total: Counter = Counter()
    for worker in server.stats().workers:
        total.update(worker.counters)
    return total


def _settle(server: ServerProcess) -> dict:
    """Waits until the server's checks are all settled and its semantic index has stopped growing (the
    verified answers stored and indexed); returns its counters then."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    last = None
    while True:
        counters = _counters(server)
        now = (counters.get("semantic.shadow_pending", 0), counters.get("writer.backlog", 0),
               counters.get("semantic.indexed", 0))
        if now == last and now[:2] == (0, 0):
            return counters
        assert time.monotonic() < deadline, f"the server did not settle: {now}"
        last = now
        time.sleep(0.5)


def bench_shadow(models: Path, workdir: Path, rounds: int, limit: int | None = 5000, misses: int = 150) -> dict:
    """`rounds` x 4 cycles of one segment per setting, `misses` misses each."""
    train_banking77(models)
    rows = read_labelled_csv(BANKING77, "text", "category", limit)
    warm = [t for i, (t, _) in enumerate(rows) if i % 5]
    replay = [t for i, (t, _) in enumerate(rows) if i % 5 == 0]
    cycles = 4 * rounds
    out: dict = {"warm": len(warm), "replay": len(replay), "misses_per_segment": misses, "cycles": []}
    with ExitStack() as stack:
        servers = {}
        for setting, fraction in FRACTIONS.items():
            run_dir = workdir / f"shadow-{setting}"
            root = banking77_with(models, run_dir / "models",
                                  lambda config: config.replace("verify_fraction: 0.1", f"verify_fraction: {fraction}"))
            servers[setting] = stack.enter_context(ServerProcess(run_dir, root, engines_dir=workdir / "engines"))
            asyncio.run(_warm(servers[setting].address, warm))
        verified = {s: _settle(server).get("semantic.banking77.1.verified", 0) for s, server in servers.items()}
        out["checks_in_warmup"] = dict(verified)
        pooled: dict[str, list[np.ndarray]] = {s: [] for s in SETTINGS}
        for n in range(cycles):
            cycle = {}
            for setting in SETTINGS[n % 3:] + SETTINGS[:n % 3]:  # the order rotates between cycles
                segment = asyncio.run(_segment(servers[setting].address, replay, misses))
                ended = _figures(_counters(servers[setting]))
                checks = _settle(servers[setting]).get("semantic.banking77.1.verified", 0)
                pooled[setting].append(segment.pop("latencies_ms"))
                cycle[setting] = {"miss_p50_ms": round(float(np.percentile(pooled[setting][-1], 50)), 3),
                                  "checks": checks - verified[setting], "at_segment_end": ended, **segment}
                verified[setting] = checks
            for setting in ("default", "every_hit"):
                cycle[f"{setting}_ratio"] = round(cycle[setting]["miss_p50_ms"] / cycle["off"]["miss_p50_ms"], 4)
            out["cycles"].append(cycle)
            print(f"  cycle {n + 1}/{cycles}: miss p50 off {cycle['off']['miss_p50_ms']} ms; verify_fraction 0.1 "
                  f"{cycle['default']['miss_p50_ms']} ms ({cycle['default']['checks']} checks) = "
                  f"{cycle['default_ratio']:.3f}x; every hit {cycle['every_hit']['miss_p50_ms']} ms "
                  f"({cycle['every_hit']['checks']} checks) = {cycle['every_hit_ratio']:.3f}x", flush=True)
        for setting in SETTINGS:
            latencies = np.concatenate(pooled[setting])
            out[setting] = {"misses": len(latencies), "miss_p50_ms": round(float(np.percentile(latencies, 50)), 3),
                            "miss_p99_ms": round(float(np.percentile(latencies, 99)), 3),
                            "checks": sum(c[setting]["checks"] for c in out["cycles"]),
                            "checks_pending_at_segment_ends": sum(c[setting]["at_segment_end"]["shadow_pending"]
                                                                  for c in out["cycles"]),
                            "hit_requests": sum(c[setting]["requests"] for c in out["cycles"]),
                            "semantic_hits": sum(c[setting]["semantic_hits"] for c in out["cycles"])}
        for setting in ("default", "every_hit"):
            out[f"{setting}_miss_p50_ratio_median"] = statistics.median(c[f"{setting}_ratio"] for c in out["cycles"])
            out[f"{setting}_pooled_p50_ratio"] = round(out[setting]["miss_p50_ms"] / out["off"]["miss_p50_ms"], 4)
        for server in servers.values():
            assert server.stop() == 0
    return out


def print_shadow(result: dict) -> None:
    print(f"\nshadow verification: foreground miss p50 on vs off, median of {len(result['cycles'])} cycles: "
          f"{result['default_miss_p50_ratio_median']:.3f}x at verify_fraction 0.1 (target <= 1.05x; all misses "
          f"pooled {result['default_pooled_p50_ratio']:.3f}x, {result['default']['checks']} checks), "
          f"{result['every_hit_miss_p50_ratio_median']:.3f}x with every hit verified (pooled "
          f"{result['every_hit_pooled_p50_ratio']:.3f}x, {result['every_hit']['checks']} checks); off: "
          f"{result['off']['miss_p50_ms']} ms over {result['off']['misses']} misses")
