"""Does shadow verification delay foreground misses? Miss p50 with hits verified vs none.

Each round starts a fresh server per setting: banking77 with the calibrated rule and `verify_fraction`
0 (verification off), 0.1 (the default) or 1.0 (every hit verified). Each is warmed with 80% of the rows
(semantic on, DEFAULT: the rule learns its threshold from the misses), then runs two streams at once:
16 callers replaying the other 20% with NO_STORE (mostly semantic hits, verified as set) and 2 callers
sending texts never seen before with matching off (every one a miss). The order of the settings rotates
across rounds; the figures are the medians of the per-round ratios of the misses' p50 to the same
round's "off", beside the absolute figures.
"""

from __future__ import annotations

import asyncio
import statistics
import uuid
from pathlib import Path

import grpc

from bench import BANKING77
from bench.load import run_load
from bench.semantic import banking77_with, train_banking77
from infercache.testing import ServerProcess
from infercache.v1 import infercache_pb2 as pb
from infercache.v1 import infercache_pb2_grpc
from server.tools.labelled_csv import read_labelled_csv
from server.tools.semantic_eval import send_all

HIT_CALLERS, MISS_CALLERS = 16, 2
FRACTIONS = {"off": 0.0, "default": 0.1, "every_hit": 1.0}  # verify_fraction of each setting
SETTINGS = tuple(FRACTIONS)


async def _measure(address: str, warm: list[str], replay: list[str], misses: int) -> dict:
    async with grpc.aio.insecure_channel(address) as channel:
        await send_all(infercache_pb2_grpc.InferenceCacheStub(channel),
                        [pb.InferRequest(model="banking77", text=t) for t in warm], 16)
    tag = uuid.uuid4().hex[:8]
    novel = [pb.InferRequest(model="banking77", text=f"{replay[n % len(replay)]} ({tag} {n})",
                             semantic=pb.SemanticPolicy(enabled=False)) for n in range(misses)]
    hits = [pb.InferRequest(model="banking77", text=t, cache=pb.CachePolicy(mode=pb.CachePolicy.NO_STORE))
            for t in replay]
    foreground = asyncio.ensure_future(run_load(address, novel, concurrency=MISS_CALLERS, total=misses))
    background = []
    while not foreground.done():  # hits keep flowing for as long as the misses are measured
        background.append(await run_load(address, hits, concurrency=HIT_CALLERS, total=len(hits)))
    missed = (await foreground).summary()
    return {"miss": missed, "hits": sum(r.sources.get("RESULT_SEMANTIC", 0) for r in background),
            "hit_requests": sum(r.requests for r in background)}


def bench_shadow(models: Path, workdir: Path, rounds: int, limit: int | None = 5000, misses: int = 600) -> dict:
    train_banking77(models)
    rows = read_labelled_csv(BANKING77, "text", "category", limit)
    warm = [t for i, (t, _) in enumerate(rows) if i % 5]
    replay = [t for i, (t, _) in enumerate(rows) if i % 5 == 0]
    out: dict = {"rounds": [], "warm": len(warm), "replay": len(replay), "misses_per_run": misses}
    for n in range(rounds):
        figures = {}
        for setting in SETTINGS[n % 3:] + SETTINGS[:n % 3]:  # the order rotates between rounds
            run_dir = workdir / f"shadow-{n}-{setting}"
            fraction = FRACTIONS[setting]
            root = banking77_with(models, run_dir / "models",
                                  lambda config: config.replace("verify_fraction: 0.1", f"verify_fraction: {fraction}"))
            with ServerProcess(run_dir, root, engines_dir=workdir / "engines") as server:
                figures[setting] = asyncio.run(_measure(server.address, warm, replay, misses))
                counters = dict(server.stats().worker.counters)
                figures[setting]["verified"] = counters.get("semantic.banking77.1.verified", 0)
                assert server.stop() == 0
        for setting in ("default", "every_hit"):
            figures[f"{setting}_miss_p50_ratio"] = figures[setting]["miss"]["p50_ms"] / figures["off"]["miss"]["p50_ms"]
        out["rounds"].append(figures)
        print(f"  round {n + 1}/{rounds}: miss p50 off {figures['off']['miss']['p50_ms']} ms; "
              f"verify_fraction 0.1: {figures['default']['miss']['p50_ms']} ms ({figures['default']['verified']} "
              f"checks) = {figures['default_miss_p50_ratio']:.3f}x; every hit: {figures['every_hit']['miss']['p50_ms']} "
              f"ms ({figures['every_hit']['verified']} checks) = {figures['every_hit_miss_p50_ratio']:.3f}x", flush=True)
    for setting in ("default", "every_hit"):
        out[f"{setting}_miss_p50_ratio_median"] = statistics.median(r[f"{setting}_miss_p50_ratio"] for r in out["rounds"])
    return out


def print_shadow(result: dict) -> None:
    print(f"\nshadow verification: foreground miss p50 on vs off, median of {len(result['rounds'])} rounds: "
          f"{result['default_miss_p50_ratio_median']:.3f}x at verify_fraction 0.1 (target <= 1.05x), "
          f"{result['every_hit_miss_p50_ratio_median']:.3f}x with every hit verified")
