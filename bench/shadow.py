"""Does shadow verification delay foreground misses? Miss p50 with every semantic hit verified vs none.

Each round starts a fresh server per setting (banking77 with the calibrated rule; `verify_fraction` 1.0,
or 0, which turns verification off), warms it with 80% of the rows (semantic on, DEFAULT: the rule learns
its threshold from the misses), then runs two streams at once: 16 callers replaying the other 20% with
NO_STORE (mostly semantic hits, each one verified when on) and 2 callers sending texts never seen before
with matching off (every one a miss). Settings alternate in order across rounds; the figure is the median
of the per-round on/off ratios of the misses' p50, beside the absolute figures.
"""

from __future__ import annotations

import asyncio
import statistics
import uuid
from pathlib import Path

import grpc

from bench import BANKING77
from bench.load import run_load
from bench.semantic import train_banking77
from infercache.testing import ServerProcess
from infercache.v1 import infercache_pb2 as pb
from infercache.v1 import infercache_pb2_grpc
from server.tools.labelled_csv import read_labelled_csv
from server.tools.semantic_eval import send_all

HIT_CALLERS, MISS_CALLERS = 16, 2


def _models(models: Path, root: Path, fraction: float) -> Path:
    """minilm and banking77 (its verify_fraction set to `fraction`), version dirs linked."""
    config = (models / "banking77" / "config.yaml").read_text()
    assert "verify_fraction: 0.1" in config, "banking77 was not trained with the calibrated rule's settings"
    configs = {"minilm": (models / "minilm" / "config.yaml").read_text(),
               "banking77": config.replace("verify_fraction: 0.1", f"verify_fraction: {fraction}")}
    for name, text in configs.items():
        (root / name).mkdir(parents=True)
        (root / name / "config.yaml").write_text(text)
        (root / name / "1").symlink_to((models / name / "1").resolve())
    return root


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
        order = ("on", "off") if n % 2 == 0 else ("off", "on")
        figures = {}
        for setting in order:
            run_dir = workdir / f"shadow-{n}-{setting}"
            root = _models(models, run_dir / "models", 1.0 if setting == "on" else 0.0)
            with ServerProcess(run_dir, root, engines_dir=workdir / "engines") as server:
                figures[setting] = asyncio.run(_measure(server.address, warm, replay, misses))
                counters = dict(server.stats().worker.counters)
                figures[setting]["verified"] = counters.get("semantic.banking77.1.verified", 0)
                assert server.stop() == 0
        figures["miss_p50_ratio"] = figures["on"]["miss"]["p50_ms"] / figures["off"]["miss"]["p50_ms"]
        out["rounds"].append(figures)
        print(f"  round {n + 1}/{rounds}: miss p50 on {figures['on']['miss']['p50_ms']} ms "
              f"({figures['on']['verified']} hits verified), off {figures['off']['miss']['p50_ms']} ms: "
              f"{figures['miss_p50_ratio']:.3f}x", flush=True)
    out["miss_p50_ratio_median"] = statistics.median(r["miss_p50_ratio"] for r in out["rounds"])
    return out


def print_shadow(result: dict) -> None:
    print(f"\nshadow verification: foreground miss p50 on vs off, median of {len(result['rounds'])} rounds: "
          f"{result['miss_p50_ratio_median']:.3f}x (target <= 1.05x)")
