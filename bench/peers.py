"""infercache beside what users would run instead (`--sections peers`).

Semantic hits against GPTCache (the PyPI package), on Banking77: every 5th row of the train split is
replayed, the other rows warm the cache; the model is the Banking77 head train-head fits (the semantic
section's), and both caches embed with the same MiniLM.
- infercache: a fresh server, the calibrated rule at `max_error` 0.01, warmed and replayed as
  eval-semantic does (server/tools/semantic_heldout.py: warm misses stored, replays NO_STORE).
- GPTCache: sqlite and faiss (its documented similar-search setup), `SearchDistanceEvaluation` over a
  threshold sweep (its default 0.8 among them), holding every warm text with the model's label as its
  answer, embedded by the server's MiniLM (the same normalized text).
Both are scored on the replayed texts that are not exact repeats of a warm one (after normalization):
hits among them, and the hits' fidelity (the answer served is the model's own label for the text) with
its 95% Wilson interval. Then the semantic hit p50, one call at a time: infercache's over gRPC from
another process (it embeds on the server); GPTCache's in the caller's process, embedding with the same
MiniLM in ONNX Runtime there (no network hop: what embedding it in the application costs).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path

import numpy as np

from bench import BANKING77, proportion
from bench.sections import Run
from server.shared.normalize import Normalizer
from harness.servers import REPO, ServerProcess

THRESHOLDS = (0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95, 0.97, 0.99)
HOLDOUT = 5
LATENCY_CALLS = 300


def bench_peers_semantic(models: Path, workdir: Path, quick: bool, dry: bool = False) -> dict:
    """quick: 2,000 rows (the head trained on them, as the semantic section's quick run), dry: 300."""
    from server.tools.labelled_csv import read_labelled_csv
    from server.tools.semantic_heldout import run, split

    from bench.semantic import train_banking77

    limit = 300 if dry else 2000 if quick else None
    train_banking77(models, limit=limit)
    rows = read_labelled_csv(BANKING77, "text", "category", limit)
    warm, replay, _ = split(rows, HOLDOUT, 0)
    normalize = Normalizer()
    warm_normalized = {normalize(t) for t, _ in warm}
    out: dict = {"rows": len(rows), "warm": len(warm), "replayed": len(replay)}
    (workdir / "server").mkdir(parents=True)
    with ServerProcess(workdir / "server", models, engines_dir=workdir / "engines") as server:
        ours = asyncio.run(run(server.address, "banking77", rows, holdout=HOLDOUT, novel_modes=(),
                               progress=lambda m: print(m, flush=True)))["heldout"]
        out["infercache"] = {"max_error": 0.01, "exact_misses": ours["exact_misses"], "semantic_hits": ours["semantic_hits"],
                             "hit_rate": round(ours["hit_rate"], 4),
                             "fidelity": proportion(ours["semantic_hits"] - ours["disagreed"], ours["semantic_hits"]),
                             "hit_p50_ms": ours.get("semantic_hit_p50_ms")}
        with server.client(timeout_s=120) as client:
            texts = sorted({t for t, _ in warm + replay})
            label, vector = {}, {}
            for i in range(0, len(texts), 128):
                chunk = texts[i:i + 128]
                for text, result in zip(chunk, client.infer_batch("banking77", chunk, tenant="peers-oracle",
                                                                  mode="NO_STORE", semantic=False)):
                    label[text] = result.label
                for text, result in zip(chunk, client.infer_batch("minilm", chunk, tenant="peers-oracle",
                                                                  mode="NO_STORE")):
                    vector[text] = np.asarray(result.outputs["embedding"], dtype=np.float32)
        assert server.stop() == 0
    out["gptcache"] = _gptcache(workdir / "gptcache", warm, replay, label, vector, warm_normalized, normalize)
    out["comparison"] = _compare(out["infercache"], out["gptcache"])
    return out


def open_gptcache(workdir: Path, embedding, size: int):
    """GPTCache as its docs set up similar search: sqlite and faiss (MiniLM's 384 dimensions),
    `SearchDistanceEvaluation`, its default threshold 0.8; `embedding(text)` embeds."""
    from gptcache import Cache, Config
    from gptcache.manager import CacheBase, VectorBase, get_data_manager
    from gptcache.processor.pre import get_prompt
    from gptcache.similarity_evaluation.distance import SearchDistanceEvaluation

    workdir.mkdir()
    cache = Cache()
    cache.init(pre_embedding_func=get_prompt, embedding_func=lambda text, **_: embedding(text),
               data_manager=get_data_manager(CacheBase("sqlite", sql_url=f"sqlite:///{workdir}/cache.db"),
                                             VectorBase("faiss", dimension=384, index_path=str(workdir / "index.faiss")),
                                             max_size=size),
               similarity_evaluation=SearchDistanceEvaluation(), config=Config(similarity_threshold=0.8))
    return cache


def close_gptcache(cache) -> None:
    """Closed while its folder exists: GPTCache would close it at the interpreter's exit, after a run's
    temporary folder is gone (an error in the log)."""
    cache.data_manager.close()
    cache.data_manager = _Closed()


class _Closed:
    def close(self) -> None:
        pass


def _gptcache(workdir: Path, warm, replay, label: dict, vector: dict, warm_normalized: set[str], normalize) -> dict:
    import gptcache
    from gptcache.adapter.api import get

    embedding = {"func": vector.__getitem__}  # the server's vectors; in-process MiniLM for the latency
    cache = open_gptcache(workdir, lambda text: embedding["func"](text), len(warm) + 1000)
    started = time.monotonic()
    cache.import_data([t for t, _ in warm], [label[t] for t, _ in warm])
    imported_s = time.monotonic() - started
    eligible = [t for t, _ in replay if normalize(t) not in warm_normalized]
    sweep = {}
    for threshold in THRESHOLDS:
        cache.config.similarity_threshold = threshold
        answers = [get(text, cache_obj=cache) for text in eligible]
        hits = [(text, answer) for text, answer in zip(eligible, answers) if answer is not None]
        sweep[f"{threshold:.2f}"] = {"exact_misses": len(eligible), "semantic_hits": len(hits),
                                     "hit_rate": round(len(hits) / len(eligible), 4),
                                     "fidelity": proportion(sum(answer == label[t] for t, answer in hits), len(hits))}
    out = {"package": f"gptcache {gptcache.__version__}", "storage": "sqlite + faiss",
           "evaluation": "SearchDistanceEvaluation", "default_threshold": 0.8, "import_s": round(imported_s, 2),
           "sweep": sweep}
    best = _best(sweep, 0.99)
    if best is not None:  # its hit p50 where its fidelity reaches 99%, embedding in-process
        cache.config.similarity_threshold = float(best)
        embedding["func"] = _ort_embedder(normalize)
        timings = []
        for text in eligible:
            started = time.perf_counter()
            answer = get(text, cache_obj=cache)
            if answer is not None:
                timings.append((time.perf_counter() - started) * 1000)
            if len(timings) >= LATENCY_CALLS:
                break
        out["hit_p50_ms"] = {"threshold": best, "p50_ms": round(statistics.median(timings), 2), "calls": len(timings)}
    close_gptcache(cache)
    return out


def _ort_embedder(normalize):
    """MiniLM in ONNX Runtime in this process: the normalized text, unit length (as the server embeds)."""
    from server.engines.onnxruntime import OrtEngine
    from server.shared.models import MODEL_FILE, TOKENIZER_FILE, load_model
    from server.shared.tokenization import TextEncoder
    from server.tools.train_head import embed

    spec = load_model(REPO / "models" / "minilm")
    version_dir = spec.version_dir(spec.serving_version)
    engine, encoder = OrtEngine(version_dir / MODEL_FILE), TextEncoder(version_dir / TOKENIZER_FILE, spec.max_tokens)

    def embedding(text: str) -> np.ndarray:
        x = embed(engine, encoder, [normalize(text)], lambda m: None)[0]
        return x / np.linalg.norm(x)

    return embedding


def _best(sweep: dict, floor: float) -> str | None:
    """The threshold of the sweep with the most hits at a fidelity of at least `floor`."""
    fit = [(row["hit_rate"], t) for t, row in sweep.items() if row["fidelity"]["rate"] is not None
           and row["fidelity"]["rate"] >= floor]
    return max(fit)[1] if fit else None


def _compare(ours: dict, theirs: dict) -> dict:
    """Our hit rate against GPTCache's best at a fidelity at least ours, and at least 99%; and at its default."""
    out = {}
    for name, floor in (("at_equal_fidelity", ours["fidelity"]["rate"] or 1.0), ("at_99", 0.99)):
        threshold = _best(theirs["sweep"], floor)
        rate = theirs["sweep"][threshold]["hit_rate"] if threshold else 0.0
        out[name] = {"gptcache_threshold": threshold, "gptcache_hit_rate": rate,
                     "ratio": round(ours["hit_rate"] / rate, 2) if rate else None}
    default = theirs["sweep"][f"{theirs['default_threshold']:.2f}"]
    out["gptcache_default"] = {"hit_rate": default["hit_rate"], "fidelity": default["fidelity"]["rate"]}
    return out


def print_peers(report: dict) -> None:
    semantic = report.get("semantic")
    if not semantic:
        return
    ours, theirs = semantic["infercache"], semantic["gptcache"]
    print(f"\nsemantic hits on Banking77 ({semantic['warm']} warm, {semantic['replayed']} replayed)")
    print(f"  infercache (max_error {ours['max_error']}): {ours['hit_rate']:.1%} of {ours['exact_misses']} exact misses, "
          f"fidelity {ours['fidelity']['rate']} {ours['fidelity']['interval95']}; hit p50 {ours['hit_p50_ms']} ms")
    for threshold, row in theirs["sweep"].items():
        print(f"  {theirs['package']} at {threshold}: {row['hit_rate']:.1%}, fidelity {row['fidelity']['rate']} "
              f"{row['fidelity']['interval95']}")
    print(f"  comparison: {semantic['comparison']}; GPTCache hit p50 {theirs.get('hit_p50_ms')}")


def section(run: Run) -> None:
    """The parts --peers-parts names: hits (against Triton's response cache), infinity (misses), semantic."""
    parts = set(run.args.peers_parts.split(","))
    report = run.report["peers"] = {}
    if "hits" in parts:
        from bench.peers_hits import bench_peers_hits, print_peers_hits

        print("benchmarking exact hits against Triton's response cache ...", flush=True)
        report["hits"] = bench_peers_hits(run.workdir / "peers-hits", run.texts, run.rounds, run.quick, dry=run.dry)
        run.save()
        print_peers_hits(report["hits"])
    if "infinity" in parts:
        from bench.peers_infinity import bench_peers_infinity, minilm_source, print_peers_infinity

        print("benchmarking misses against infinity ...", flush=True)
        report["infinity"] = bench_peers_infinity(run.workdir / "peers-infinity", run.texts, minilm_source(),
                                                  max(2, run.rounds), run.quick)
        run.save()
        print_peers_infinity(report["infinity"])
    if "semantic" in parts:
        print("benchmarking semantic hits against GPTCache (Banking77) ...", flush=True)
        report["semantic"] = bench_peers_semantic(run.models, run.workdir / "peers", run.quick, dry=run.dry)
        run.save()
        print_peers(report)
