"""Semantic answers for generated text against GPTCache (`--sections generate-semantic`).

Banking77 questions as a FAQ bot's traffic. The rows are shuffled (seed 7) and the first `rows` taken;
every 5th of them replays, the others warm the cache first. The judge is a Banking77 head trained by
train-head on every row of the split except the replayed ones. SmolLM2 generates the answers; both
systems hold the same warm questions and answers, and embed with the same MiniLM (the server's `minilm`,
on the normalized question). Replays do not store, so both caches hold the warm set alone.

- infercache: the model's semantic answers at `max_error` 0.01 (server/shared/answer_match.py), under
  the judge as train-head wrote it (with its label calibration: server/worker/semantic/label_calibration.py);
- infercache, judge only: a second model in the same server, its judge the same head without its label
  calibration (a head trained before train-head wrote one): the bound holds to the judge's verdicts alone.
- GPTCache, the PyPI package: sqlite and faiss (its documented similar-search setup), `SearchDistanceEvaluation`
  over a threshold sweep, its default threshold (0.8) among them. `Cache.init`'s own default evaluation is
  `ExactMatchEvaluation`, which answers exact texts only.

For each: the semantic hit rate among the replayed questions that are not exact repeats of a warm one
(after normalization: those are exact hits for both), and the hits' fidelity with its 95% Wilson interval:
by the judge (the judge gives the new question and the matched one the same label) and by Banking77's own
labels (the two questions' categories agree). Where a hit's categories differ, who was wrong: the judge
on the new question, on the cached one, on both, or on neither (two questions it labels apart); and the
hits by the probability that the two share a label under the calibrated judge. Then the whole-answer
latency p50 of a semantic hit, an exact hit and a miss, one call at a time, with `latency_tokens`-token answers.
"""

from __future__ import annotations

import csv
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from bench import BANKING77, proportion
from bench.peers import close_gptcache, open_gptcache
from bench.sections import Run
from server.shared.normalize import Normalizer
from server.tools.labelled_csv import read_labelled_csv
from server.worker.semantic import label_calibration
from server.worker.semantic.label_calibration import LABEL_CALIBRATION_FILE, same_label
from harness.servers import REPO, ServerProcess, settled, worker_counters

SEED = 7
MAX_ERROR = 0.01
THRESHOLDS = (0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95, 0.96, 0.97, 0.98, 0.99)
ANSWERS_CONFIG = """
task: generate
serving_version: "1"
generate: {{context_length: 256, max_new_tokens: 64, max_streams: 8, normalize: text}}
cache: {{ttl_s: 86400}}
semantic: {{enabled: true, judge: {judge}, max_error: {max_error}}}
"""
JUDGE = "banking77-judge"
JUDGE_ONLY = "banking77-judge-only"  # the same head without its label calibration
BANDS = (0.0, 0.5, 0.9, 0.95, 0.99)  # hits by the calibrated probability that the two questions share a label


def _models(root: Path, judge_rows: list[tuple[str, str]]) -> Path:
    from server.tools.train_head import train

    (root / "minilm").mkdir(parents=True)
    (root / "minilm" / "config.yaml").write_text((REPO / "models" / "minilm" / "config.yaml").read_text())
    (root / "minilm" / "1").symlink_to(REPO / "models" / "minilm" / "1")
    judge_csv = root.parent / "judge.csv"
    with open(judge_csv, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["text", "category"])
        writer.writerows(judge_rows)
    train(judge_csv, text_column="text", label_column="category", models_dir=root, encoder="minilm",
          name=JUDGE, progress=lambda m: None)
    (root / JUDGE_ONLY / "1").mkdir(parents=True)
    (root / JUDGE_ONLY / "config.yaml").write_text((root / JUDGE / "config.yaml").read_text())
    for path in (root / JUDGE / "1").iterdir():
        if path.name != LABEL_CALIBRATION_FILE:
            (root / JUDGE_ONLY / "1" / path.name).symlink_to(path)
    for name, judge in (("answers", JUDGE), ("answers-judge-only", JUDGE_ONLY)):
        (root / name).mkdir()
        (root / name / "config.yaml").write_text(ANSWERS_CONFIG.format(max_error=MAX_ERROR, judge=judge))
        (root / name / "1").symlink_to(REPO / "models" / "smollm2" / "1")
    return root


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def bench_generate_semantic(workdir: Path, quick: bool, rows: int = 3000, tokens: int = 1,
                            latency_tokens: int = 32, latency_calls: int = 20, judge_limit: int | None = None) -> dict:
    """judge_limit: the judge head trained on that many of the rows not replayed (default all; the dry run's few)."""
    if quick:
        rows, latency_calls = 1000, 8
    every = read_labelled_csv(BANKING77, "text", "category", None)
    random.Random(SEED).shuffle(every)
    chosen = every[:rows]
    replay = chosen[::5]
    warm = [r for i, r in enumerate(chosen) if i % 5]
    replayed = set(replay)
    judge_rows = [r for r in every if r not in replayed][:judge_limit]
    started = time.monotonic()
    models = _models(workdir / "models", judge_rows)
    trained_s = time.monotonic() - started
    normalize = Normalizer()
    warm_normalized = {normalize(t) for t, _ in warm}
    (workdir / "server").mkdir()
    server = ServerProcess(workdir / "server", models, frontends=1)
    out: dict = {"rows": rows, "warm": len(warm), "replayed": len(replay), "answer_tokens": tokens,
                 "max_error": MAX_ERROR, "judge_rows": len(judge_rows), "judge_trained_s": round(trained_s, 1)}
    calibration = label_calibration.read(models / JUDGE / "1")
    out["label_calibration"] = {"temperature": round(calibration.temperature, 4), "pairs": int(calibration.n.sum()),
                                "pairs_disagreed": int(calibration.errors.sum()),
                                "same_label_threshold": calibration.threshold(MAX_ERROR)}
    try:
        with server.client(timeout_s=300) as client:
            judge = _judge(client, [t for t, _ in replay] + [t for t, _ in warm])
            ours, answered, answer_of = _infercache(server, client, "answers", warm, replay, tokens, warm_normalized,
                                                    normalize, judge, calibration, out)
            out["infercache"] = ours
            out["infercache_judge_only"], _, _ = _infercache(server, client, "answers-judge-only", warm, replay, tokens,
                                                             warm_normalized, normalize, judge, calibration, {})
            out["gptcache"] = _gptcache(workdir / "gptcache", client, warm, answer_of, replay, warm_normalized,
                                        normalize, judge, calibration)
            out["comparison"] = _compare(ours, out["gptcache"])
            out["latency"] = _latency(client, warm, replay, answered, latency_tokens, latency_calls)
    finally:
        server.stop()
    return out


def _infercache(server, client, model: str, warm, replay, tokens: int, warm_normalized, normalize, judge, calibration,
                out: dict) -> tuple[dict, list, dict]:
    """Warms `model` with the warm questions (8 callers: its running batch fills), replays the others one at
    a time (NO_STORE), and scores its semantic hits; `out` gets the warm-up's figures."""
    def ask(text: str):
        return client.generate(model, messages=_user(text), max_new_tokens=tokens)

    started = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        warmed = list(pool.map(ask, [t for t, _ in warm]))
    prefix = f"semantic.{model}.1."
    out["warm_s"] = round(time.monotonic() - started, 1)
    out["warm_sources"] = dict(sorted({s: sum(g.source == s for g in warmed) for s in {g.source for g in warmed}}.items()))
    origin = {g.key: (t, c) for g, (t, c) in zip(warmed, warm) if g.source == "MISS"}
    answer_of = {t: g.text for g, (t, _) in zip(warmed, warm)}
    settled(server, "semantic.indexed", timeout=120)
    before = worker_counters(server)
    out["calibration_after_warm"] = {k.split(".")[-1]: v for k, v in before.items() if k.startswith(prefix)}

    def replay_one(text: str):
        t0 = time.perf_counter()
        got = client.generate(model, messages=_user(text), max_new_tokens=tokens, mode="NO_STORE")
        return got, time.perf_counter() - t0

    answered = [replay_one(t) for t, _ in replay]
    ours = _score([(r, g.source == "RESULT_SEMANTIC", origin.get(g.key)) for r, (g, _) in zip(replay, answered)],
                  warm_normalized, normalize, judge, calibration)
    ours["warm_sources"] = out["warm_sources"]
    ours["sources"] = {s: sum(g.source == s for g, _ in answered) for s in {g.source for g, _ in answered}}
    ours["verdicts"] = {v: sum(g.verdict == v for g, _ in answered if g.source == "RESULT_SEMANTIC")
                        for v in ("ESTIMATED", "VERIFIED")}
    time.sleep(2)
    settled(server, f"{prefix}verified", timeout=120)
    after = worker_counters(server)
    ours["refused_by_label_calibration"] = (after.get("worker.answer_label_refused", 0)
                                            - before.get("worker.answer_label_refused", 0))
    ours["calibration_after_replay"] = {k.split(".")[-1]: v for k, v in after.items() if k.startswith(prefix)}
    return ours, answered, answer_of


def _judge(client, texts: list[str]) -> dict[str, tuple[str, np.ndarray]]:
    """The judge's label and class scores of each text (computed: BYPASS)."""
    labels = {}
    distinct = sorted(set(texts))
    for i in range(0, len(distinct), 128):
        chunk = distinct[i:i + 128]
        for text, result in zip(chunk, client.infer_batch(JUDGE, chunk, mode="BYPASS")):
            labels[text] = (result.label, np.asarray(result.outputs["scores"], dtype=np.float32))
    return labels


def _score(results, warm_normalized: set[str], normalize, judge: dict, calibration) -> dict:
    """results: ((query, category), hit?, (matched question, its category) or None) per replayed question."""
    eligible = [(q, hit, m) for q, hit, m in results if normalize(q[0]) not in warm_normalized]
    hits = [(q, m) for q, hit, m in eligible if hit and m is not None]
    unknown = sum(1 for q, hit, m in eligible if hit and m is None)  # (a hit whose entry came from no warm miss)
    by_judge = sum(judge[q[0]][0] == judge[m[0]][0] for q, m in hits)
    by_label = sum(q[1] == m[1] for q, m in hits)
    # Who was wrong where the categories differ; the judge's labels are its argmax, Banking77's the truth.
    wrong = {"judge_wrong_on_new": 0, "judge_wrong_on_cached": 0, "judge_wrong_on_both": 0, "judge_labels_apart": 0}
    for q, m in hits:
        if q[1] != m[1]:
            new_wrong, cached_wrong = judge[q[0]][0] != q[1], judge[m[0]][0] != m[1]
            wrong["judge_wrong_on_both" if new_wrong and cached_wrong else "judge_wrong_on_new" if new_wrong
                  else "judge_wrong_on_cached" if cached_wrong else "judge_labels_apart"] += 1
    bands = {}
    for low, high in zip(BANDS, (*BANDS[1:], 1.01)):
        inside = [(q, m) for q, m in hits
                  if low <= same_label(judge[q[0]][1], judge[m[0]][1], calibration.temperature) < high]
        bands[f"{low:.2f}-{min(high, 1.0):.2f}"] = proportion(sum(q[1] == m[1] for q, m in inside), len(inside))
    return {"exact_misses": len(eligible), "semantic_hits": len(hits) + unknown, "unattributed_hits": unknown,
            "hit_rate": round((len(hits) + unknown) / len(eligible), 4) if eligible else None,
            "fidelity_judge": proportion(by_judge, len(hits)), "fidelity_banking77_labels": proportion(by_label, len(hits)),
            "labels_apart": wrong, "fidelity_labels_by_same_label_probability": bands}


def _gptcache(workdir: Path, client, warm, answer_of, replay, warm_normalized, normalize, judge, calibration) -> dict:
    import gptcache
    from gptcache.adapter.api import get

    texts = [t for t, _ in warm] + [t for t, _ in replay]
    vectors = {}
    for i in range(0, len(texts), 128):  # the same MiniLM, on the same normalized text
        chunk = texts[i:i + 128]
        for text, result in zip(chunk, client.infer_batch("minilm", chunk)):
            vectors[text] = np.asarray(result.outputs["embedding"], dtype=np.float32)
    cache = open_gptcache(workdir, vectors.__getitem__, len(warm) + 1000)
    category = dict(warm)
    started = time.monotonic()
    cache.import_data([t for t, _ in warm], [answer_of[t] or " " for t, _ in warm])
    imported_s = time.monotonic() - started
    sweep = {}
    for threshold in THRESHOLDS:
        cache.config.similarity_threshold = threshold
        results = []
        for query in replay:
            matched = []
            answer = get(query[0], cache_obj=cache, hit_callback=lambda found: matched.extend(found))
            hit = answer is not None and bool(matched)
            results.append((query, hit, (matched[0][0], category.get(matched[0][0])) if hit else None))
        sweep[f"{threshold:.2f}"] = _score(results, warm_normalized, normalize, judge, calibration)
    close_gptcache(cache)
    return {"package": f"gptcache {gptcache.__version__}", "storage": "sqlite + faiss",
            "evaluation": "SearchDistanceEvaluation", "default_threshold": 0.8, "import_s": round(imported_s, 2),
            "sweep": sweep}


def _compare(ours: dict, theirs: dict) -> dict:
    """Our hit rate against GPTCache's best hit rate at a fidelity at least ours, by Banking77's labels and by
    the judge, and at 99% by each."""
    out = {}
    for measure in ("fidelity_banking77_labels", "fidelity_judge"):
        for name, floor in (("at_equal_fidelity", ours[measure]["rate"] or 1.0), ("at_99", 0.99)):
            fit = [(row["hit_rate"], t) for t, row in theirs["sweep"].items()
                   if row[measure]["rate"] is not None and row[measure]["rate"] >= floor]
            key = f"{name}_{'labels' if measure == 'fidelity_banking77_labels' else 'judge'}"
            if fit:
                rate, threshold = max(fit)
                out[key] = {"gptcache_threshold": threshold, "gptcache_hit_rate": rate,
                            "gptcache_fidelity": theirs["sweep"][threshold][measure],
                            "ratio": round(ours["hit_rate"] / rate, 2) if rate else None}
            else:
                out[key] = {"gptcache_threshold": None, "gptcache_hit_rate": 0.0, "ratio": None,
                            "note": "no threshold of the sweep reaches this fidelity"}
    return out


def _latency(client, warm, replay, answered, tokens: int, calls: int) -> dict:
    """Whole-answer p50, one call at a time, of `tokens`-token answers: misses (warm questions asked for the
    first time at this length), exact hits (the same again) and semantic hits (replayed questions that hit
    at the short length: their namespace at this length holds the same warm questions)."""
    questions = [t for t, _ in warm[:calls * 4]]
    timings: dict[str, list[float]] = {"MISS": [], "RESULT_EXACT": [], "RESULT_SEMANTIC": []}

    def timed(text: str, mode: str = "DEFAULT"):
        t0 = time.perf_counter()
        got = client.generate("answers", messages=_user(text), max_new_tokens=tokens, mode=mode)
        timings.setdefault(got.source, []).append((time.perf_counter() - t0) * 1000)
        return got

    for text in questions:  # misses, stored at this length
        timed(text)
    time.sleep(1)
    for text in questions[:calls]:
        timed(text)
    hitting = [q for (q, _), (g, _) in zip(replay, answered) if g.source == "RESULT_SEMANTIC"]
    for text in hitting[:calls * 3]:
        if len(timings["RESULT_SEMANTIC"]) >= calls:
            break
        timed(text, "NO_STORE")
    out = {"answer_tokens": tokens}
    for source, values in timings.items():
        if values:
            out[source.lower()] = {"p50_ms": round(statistics.median(values), 2), "calls": len(values)}
    if "result_semantic" in out and "miss" in out:
        out["semantic_over_exact"] = round(out["result_semantic"]["p50_ms"] / out["result_exact"]["p50_ms"], 2)
        out["miss_over_semantic"] = round(out["miss"]["p50_ms"] / out["result_semantic"]["p50_ms"], 1)
    return out


def print_generate_semantic(report: dict) -> None:
    def fidelity(row: dict) -> str:
        judge, labels = row["fidelity_judge"], row["fidelity_banking77_labels"]
        return (f"fidelity by the labels {labels['rate']} {labels['interval95']}, by the judge {judge['rate']} "
                f"{judge['interval95']}")

    print(f"\nsemantic answers, Banking77 ({report['warm']} warm, {report['replayed']} replayed), max_error "
          f"{report['max_error']}; the judge's label calibration: {report['label_calibration']}")
    for name in ("infercache", "infercache_judge_only"):
        ours = report[name]
        print(f"  {name}: hit rate {ours['hit_rate']} of {ours['exact_misses']} exact misses; {fidelity(ours)}; "
              f"categories apart: {ours['labels_apart']}")
    for threshold, row in report["gptcache"]["sweep"].items():
        print(f"  gptcache {threshold}: hit rate {row['hit_rate']}; {fidelity(row)}")
    print(f"  comparison: {report['comparison']}")
    print(f"  latency: {report.get('latency')}")


def section(run: Run) -> None:
    print("benchmarking semantic answers for generated text against GPTCache (Banking77, SmolLM2) ...", flush=True)
    (run.workdir / "generate-semantic").mkdir()
    dry = {"rows": 100, "latency_calls": 2, "judge_limit": 500} if run.dry else {}
    run.report["generate_semantic"] = bench_generate_semantic(run.workdir / "generate-semantic",
                                                              run.quick and not run.dry, **dry)
    print_generate_semantic(run.report["generate_semantic"])
