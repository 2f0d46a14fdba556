"""Semantic tier: Banking77 5-fold evaluation, and index rebuild after restart with 100k entries."""

from __future__ import annotations

import asyncio
import shutil
import statistics
import time
from pathlib import Path

import numpy as np

from bench import BANKING77
from bench.load import run_load
from bench.sections import Run
from cachestore import records
from cachestore.env import Store, StoreSettings
from cachestore.keys import Namespace, entry_key
from cachestore.semantic_log import SemanticEntry
from cachestore.writer import WriteBehind
from harness.servers import ServerProcess
from infercache.v1 import infercache_pb2 as pb
from server.shared.answers import to_tensors
from server.shared.normalize import Normalizer



def train_banking77(models: Path, limit: int | None = None) -> None:
    """The banking77 head under `models`, trained once per run: on every row, or the first `limit` (the
    rows a --quick or --dry-run replays; the file is sorted by label, so fewer labels too)."""
    from server.tools.train_head import train

    if not (models / "banking77").exists():
        train(BANKING77, text_column="text", label_column="category", models_dir=models, encoder="minilm",
              name="banking77", limit=limit, progress=lambda m: None)


def banking77_with(models: Path, root: Path, edit) -> Path:
    """minilm and banking77 under `root`, banking77's config.yaml passed through `edit`, versions linked."""
    config = (models / "banking77" / "config.yaml").read_text()
    assert "verify_fraction: 0.1" in config, "banking77 was not trained with the calibrated rule's settings"
    for name, text in (("minilm", (models / "minilm" / "config.yaml").read_text()), ("banking77", edit(config))):
        (root / name).mkdir(parents=True)
        (root / name / "config.yaml").write_text(text)
        (root / name / "1").symlink_to((models / name / "1").resolve())
    return root


def bench_hit_latency(models: Path, workdir: Path, rounds: int, limit: int | None = 5000) -> dict:
    """Semantic hit p50, one call at a time, under the calibrated rule and the fixed consensus rule
    (what served semantic hits before), each beside the same texts computed in the same server;
    rounds alternate the order. Each server is warmed with 80% of the rows first."""
    from server.tools.labelled_csv import read_labelled_csv
    from server.tools.semantic_heldout import LATENCY_SAMPLE, one_at_a_time, settle
    from server.tools.semantic_eval import send_all
    from server.tools.train_head import with_consensus

    train_banking77(models)
    rows = read_labelled_csv(BANKING77, "text", "category", limit)
    warm = [pb.InferRequest(model="banking77", text=t) for i, (t, _) in enumerate(rows) if i % 5]
    replay = [r for i, r in enumerate(rows) if i % 5 == 0][:LATENCY_SAMPLE]
    rules = {"calibrated": lambda config: config, "consensus": lambda config: with_consensus(config, "minilm")}
    out: dict = {"rounds": []}

    async def measure(address: str) -> dict:
        import grpc

        from infercache.v1 import infercache_pb2_grpc

        async with grpc.aio.insecure_channel(address) as channel:
            stub = infercache_pb2_grpc.InferenceCacheStub(channel)
            await send_all(stub, warm, 16)
            await settle(stub, "banking77")  # the last entries indexed, the warm-up's checks done (as the eval does)
            return await one_at_a_time(stub, "banking77", "", "computed", replay)

    for n in range(rounds):
        figures = {}
        for rule in (("calibrated", "consensus") if n % 2 == 0 else ("consensus", "calibrated")):
            run_dir = workdir / f"latency-{n}-{rule}"
            root = banking77_with(models, run_dir / "models", rules[rule])
            with ServerProcess(run_dir, root, engines_dir=workdir / "engines") as server:
                figures[rule] = asyncio.run(measure(server.address))
                assert server.stop() == 0
        out["rounds"].append(figures)
        print(f"  round {n + 1}/{rounds}: " + "; ".join(
            f"{rule} hit p50 {f.get('semantic_hit_p50_ms')} ms vs computed {f.get('computed_p50_ms')} ms"
            for rule, f in figures.items()), flush=True)
    for rule in rules:  # (None where no round had a semantic hit: a rule that saw too few rows to bound one)
        for figure, median in (("semantic_hit_vs_computed", "hit_vs_computed_median"),
                               ("semantic_hit_p50_ms", "hit_p50_ms_median")):
            found = [r[rule][figure] for r in out["rounds"] if r[rule].get(figure) is not None]
            out[f"{rule}_{median}"] = statistics.median(found) if found else None
    return out


def bench_eval(models: Path, workdir: Path, limit: int | None) -> dict:
    """The calibrated rule on Banking77 train, each run on a fresh server (nothing learnt carries over):
    held out, every 5th row replayed (the other 80% warm the cache; and, on another server, only a
    quarter of the rows warms it); leave labels out, every 4th label in sorted order never warms the
    cache and its rows are replayed as novel queries, against the cache as warmed (static) and, on
    another server, as traffic that joins it (streaming)."""
    from server.tools.semantic_heldout import main as evaluate

    train_banking77(models)
    out: dict = {}
    for name, leave_out, novel, warm_share in (("heldout", 0, (), None), ("heldout_quarter", 0, (), 0.25),
                                               ("novel_static", 4, ("static",), None),
                                               ("novel_streaming", 4, ("streaming",), None)):
        run_dir = workdir / f"eval-{name}"
        run_dir.mkdir()
        server = ServerProcess(run_dir, models, engines_dir=workdir / "engines")
        try:
            out[name] = evaluate(server.address, "banking77", BANKING77, text_column="text", label_column="category",
                                 limit=limit, holdout=5, leave_out=leave_out, out=run_dir / "eval.json",
                                 novel_modes=novel, warm_share=warm_share)
        finally:
            assert server.stop() == 0
    return out


def _fill(cache_dir: Path, count: int, dim: int) -> list[str]:
    """`count` cached answers with semantic entries in tenant "bench" of banking77/1; returns the texts."""
    store = Store(StoreSettings(cache_dir, 8 << 30, 6 << 30, sync=False), readonly=False)
    writer = WriteBehind(store, batch_max=4096)
    ns = Namespace("bench", "banking77", "1")
    normalize = Normalizer()
    rng = np.random.default_rng(0)
    centers = rng.standard_normal((77, dim)).astype(np.float32)  # clustered like intents, not uniform noise
    scores = np.full(77, 0.1 / 76, dtype=np.float32)
    scores[0] = 0.9  # a classifier's answer, as the server stores it
    payload = pb.InferResponse(classification=pb.Classification(label="card_arrival", probability=0.9),
                               outputs=to_tensors({"scores": scores}),
                               cache=pb.CacheInfo(model_version="1")).SerializeToString()
    now = time.time_ns() // 1000
    texts = []
    for i in range(count):
        text = f"synthetic customer question number {i}"
        texts.append(text)
        vector = centers[i % 77] + 0.6 * rng.standard_normal(dim).astype(np.float32)
        vector /= np.linalg.norm(vector)
        key = entry_key(ns.ns_id, normalize(text))
        writer.put(key, ns, records.Record(now, now + 86_400_000_000, payload),
                   semantic=SemanticEntry(ns.ns_id, f"label{i % 77}", vector))
    writer.flush().result(600)
    writer.close()
    store.close()
    return texts


def _ready_counters(server: ServerProcess, timeout: float = 900) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        counters = dict(server.stats().worker.counters)
        if counters.get("semantic.rebuild_ms"):
            return counters
        time.sleep(0.05)
    raise TimeoutError("semantic rebuild did not finish")


def bench_rebuild(models: Path, workdir: Path, count: int) -> dict:
    train_banking77(models)
    cache_dir = workdir / "rebuild-cache"
    started = time.perf_counter()
    texts = _fill(cache_dir, count, 384)
    fill_s = time.perf_counter() - started
    hits = [pb.InferRequest(model="banking77", tenant="bench", text=t) for t in texts[:500]]
    out: dict = {"entries": count, "fill_s": round(fill_s, 1)}
    for label in ("from_log", "from_snapshot"):
        run_dir = workdir / f"rebuild-{label}"
        run_dir.mkdir()
        with ServerProcess(run_dir, models, engines_dir=workdir / "engines", cache_dir=cache_dir) as server:
            during = asyncio.run(run_load(server.address, hits, concurrency=1, total=1000))  # while it rebuilds
            counters = _ready_counters(server)
            after = asyncio.run(run_load(server.address, hits, concurrency=1, total=1000))
            assert during.sources == {"RESULT_EXACT": 1000} and after.errors == 0
            assert server.stop() == 0  # writes the snapshot the second start loads
        out[label] = {
            "rebuild_s": counters["semantic.rebuild_ms"] / 1000,
            "rows_from_snapshot": counters.get("semantic.rebuilt_from_snapshot", 0),
            "rows_from_log": counters.get("semantic.rebuilt_from_log", 0),
            "exact_hit_p50_ms_during_rebuild": during.summary()["p50_ms"],
            "exact_hit_p50_ms_after": after.summary()["p50_ms"],
        }
    shutil.rmtree(cache_dir)
    return out


def print_semantic(result: dict) -> None:
    from server.tools.semantic_heldout import report

    for name, ev in (result.get("eval") or {}).items():
        print(f"\nsemantic tier, Banking77 train, {name}")
        print(report(ev))
    lat = result.get("hit_latency")
    if lat:
        print(f"\nsemantic hit p50 one call at a time (medians of {len(lat['rounds'])} rounds): calibrated "
              f"{lat['calibrated_hit_p50_ms_median']} ms ({lat['calibrated_hit_vs_computed_median']}x the same texts "
              f"computed), consensus {lat['consensus_hit_p50_ms_median']} ms "
              f"({lat['consensus_hit_vs_computed_median']}x); target <= 10 ms")
    rb = result.get("rebuild")
    if rb:
        print(f"\nindex rebuild after restart, {rb['entries']} entries")
        for label in ("from_log", "from_snapshot"):
            r = rb[label]
            print(f"  {label:<14} {r['rebuild_s']:7.2f} s; exact hit p50 {r['exact_hit_p50_ms_during_rebuild']} ms "
                  f"during, {r['exact_hit_p50_ms_after']} ms after")


def section(run: Run) -> None:
    from bench.shadow import bench_shadow, print_shadow

    print("benchmarking the semantic tier (Banking77 held-out and novel-label replays, index rebuild) ...", flush=True)
    # --quick and --dry-run train the head on the rows they replay (not on all 10,003) and start fewer
    # servers (one round of each pair)
    rows, entries = (300, 500) if run.dry else (2000, 10_000) if run.quick else (None, 100_000)
    if rows:
        train_banking77(run.models, limit=rows)
    paired = run.rounds if run.quick else max(2, run.rounds)
    run.report["semantic"] = {
        "eval": bench_eval(run.models, run.workdir, limit=rows),
        "rebuild": bench_rebuild(run.models, run.workdir, entries),
        "hit_latency": bench_hit_latency(run.models, run.workdir, paired, limit=rows or 5000),
        "shadow": bench_shadow(run.models, run.workdir, paired, limit=rows or 5000, misses=30 if run.dry else 150),
    }
    print_semantic(run.report["semantic"])
    print_shadow(run.report["semantic"]["shadow"])
