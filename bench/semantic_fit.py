"""Offline replay of the calibrated semantic rule: with and without the namespace's fit, and hits against
fidelity across `max_error` (`python -m bench.semantic_fit`).

What the server's eval (bench/semantic.py) cannot show: how the rule does for a model that is not a
linear head on the embedder. Banking77 train is embedded once with MiniLM; two models answer it:
- `linear`: the head train-head fits (multinomial logistic regression on the embedding), which the fit
  (server/shared/surrogate.py) can reproduce;
- `mlp`: a two-layer network trained to memorize every row (train accuracy ~100%), whose scores
  saturate: the stress case, where cached entries hold next to nothing of classes they do not answer.

The split is eval-semantic's: every 4th label (sorted) is left out, every 5th row of the others is
replayed, the rest warm the cache in shuffled order. The rule is the server's own code
(match_policy.assess, CalibratedPolicy, Calibration, Surrogate) over exact nearest neighbours instead of
hnswlib. Warm-up stores misses and learns from every covered miss and every hit (as if each hit were
shadow-verified); the replays change nothing. Reported: held-out hits among queries and how many differ
from the model; novel (left-out label) queries answered and how many differ.

The curve: both models with the fit, `max_error` CURVE, the cache warmed by every warm row and by a
quarter of the file's rows; each point's fidelity with its 95% interval; drawn into docs/semantic-curve.png.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import numpy as np

from bench import BANKING77, banking77_missing, default_out, proportion, recorded

LEAVE_OUT, HOLDOUT = 4, 5
CURVE = (0.002, 0.005, 0.01, 0.02, 0.05)
QUARTER = 0.25
PLOT = Path(__file__).resolve().parent.parent / "docs" / "semantic-curve.png"


def embed_banking77() -> tuple[np.ndarray, np.ndarray]:
    from server.engines.onnxruntime import OrtEngine
    from server.shared.models import MODEL_FILE, TOKENIZER_FILE, load_model
    from server.shared.normalize import Normalizer
    from server.shared.tokenization import TextEncoder
    from server.tools.labelled_csv import read_labelled_csv
    from server.tools.train_head import embed

    spec = load_model(Path(__file__).resolve().parent.parent / "models" / "minilm")
    version_dir = spec.version_dir(spec.serving_version)
    rows = read_labelled_csv(BANKING77, "text", "category", None)
    normalize = Normalizer()
    classes = sorted({label for _, label in rows})
    x = embed(OrtEngine(version_dir / MODEL_FILE), TextEncoder(version_dir / TOKENIZER_FILE, spec.max_tokens),
              [normalize(t) for t, _ in rows], lambda m: None)
    return x / np.linalg.norm(x, axis=1, keepdims=True), np.array([classes.index(label) for _, label in rows])


def softmax(logits: np.ndarray) -> np.ndarray:
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def mlp_logits(x: np.ndarray, y: np.ndarray, classes: int, hidden: int = 512, epochs: int = 300) -> np.ndarray:
    """A ReLU network fitted on every row (full-batch Adam): it memorizes them."""
    rng = np.random.default_rng(0)
    params = [rng.normal(0, 0.05, (x.shape[1], hidden)).astype(np.float32), np.zeros(hidden, np.float32),
              rng.normal(0, 0.05, (hidden, classes)).astype(np.float32), np.zeros(classes, np.float32)]
    moments = [[np.zeros_like(p), np.zeros_like(p)] for p in params]
    onehot = np.eye(classes, dtype=np.float32)[y]
    for step in range(1, epochs + 1):
        w1, b1, w2, b2 = params
        h = np.maximum(x @ w1 + b1, 0)
        g = (softmax(h @ w2 + b2) - onehot) / len(x)
        gh = g @ w2.T * (h > 0)
        for p, (m, v), grad in zip(params, moments, (x.T @ gh, gh.sum(0), h.T @ g, g.sum(0))):
            m[:] = 0.9 * m + 0.1 * grad
            v[:] = 0.999 * v + 0.001 * grad * grad
            p -= 0.01 * (m / (1 - 0.9 ** step)) / (np.sqrt(v / (1 - 0.999 ** step)) + 1e-8)
    w1, b1, w2, b2 = params
    return np.maximum(x @ w1 + b1, 0) @ w2 + b2


def replay(x: np.ndarray, y: np.ndarray, logits: np.ndarray, with_fit: bool = True, max_error: float = 0.01,
           warm_share: float | None = None) -> dict:
    """The split above; `warm_share`: only this share of the rows warms the cache (the first of the
    shuffled warm rows), not every row outside the replays."""
    from server.worker.semantic.calibration import Calibration, learn
    from server.shared.match_policy import CalibratedPolicy, Neighbor, assess
    from server.shared.surrogate import Surrogate

    policy = CalibratedPolicy(max_error=max_error)
    model, scores = logits.argmax(axis=1), softmax(logits)
    labels = [str(c) for c in range(logits.shape[1])]
    novel = {c for i, c in enumerate(sorted(set(y.tolist()))) if i % LEAVE_OUT == 0}
    warm = [i for i in range(len(x)) if i % HOLDOUT and y[i] not in novel]
    random.Random(0).shuffle(warm)
    if warm_share is not None:
        warm = warm[:int(len(x) * warm_share)]
    calibration, fit, cached = Calibration.under(policy, ""), Surrogate(x.shape[1], len(labels)), []
    calibration.rebase_s = 0.0  # every decision reads the current regions: the figures do not depend on the replay's speed

    def decide(i: int, learning: bool) -> tuple[bool, bool]:
        """(a hit that agrees with the model, a hit)"""
        if len(cached) < 2:
            return False, False
        index = np.array(cached)
        nearest = index[np.argsort(-(x[index] @ x[i]))[:policy.k]]
        fitted = labels[fit.answer(x[i])] if with_fit and fit.ready else None
        found = assess(x[i], x[nearest], scores[nearest], labels, fitted)
        neighbors = [Neighbor(float(x[j] @ x[i]), b"", labels[model[j]]) for j in nearest]
        hit = policy.decide(neighbors, found, calibration) is not None
        if learning:
            learn(calibration, neighbors, found, labels[model[i]])
        return hit and found.answer == labels[model[i]], hit

    for i in warm:
        if not decide(i, learning=True)[1]:
            cached.append(i)
            fit.add(x[i:i + 1], scores[i:i + 1])
    out: dict = {"cached": len(cached), "threshold": calibration.threshold,
                 "threshold_with_fit": calibration.threshold_for(True)}
    for name, rows in (("heldout", [i for i in range(len(x)) if i % HOLDOUT == 0 and y[i] not in novel]),
                       ("novel", [i for i in range(len(x)) if y[i] in novel])):
        decided = [decide(i, learning=False) for i in rows]
        hits = sum(hit for _, hit in decided)
        wrong = hits - sum(right for right, _ in decided)
        out[name] = {"queries": len(rows), "hits": hits, "hit_rate": round(hits / len(rows), 4), "differ": wrong,
                     "differ_share": round(wrong / hits, 4) if hits else None,
                     "fidelity_95": proportion(hits - wrong, hits)["interval95"]}
    return out


def curve(x: np.ndarray, y: np.ndarray, models: dict[str, np.ndarray]) -> dict:
    """Each model with the fit at each max_error in CURVE, warmed by every warm row and by QUARTER of the rows."""
    out: dict = {}
    for name, logits in models.items():
        for warm, share in (("all", None), ("quarter", QUARTER)):
            points = out[f"{name}_{warm}"] = []
            for max_error in CURVE:
                r = replay(x, y, logits, True, max_error, share)
                points.append({"max_error": max_error, "cached": r["cached"], "heldout": r["heldout"],
                               "novel": r["novel"]})
                h, n = r["heldout"], r["novel"]
                print(f"curve {name:<6} warm {warm:<7} max_error {max_error:<5} held-out hits {h['hit_rate']:.1%} "
                      f"({h['differ']} differ); novel answered {n['hit_rate']:.1%} ({n['differ']} differ)", flush=True)
    return out


def plot(points: dict, path: Path) -> None:
    """Held-out hits against fidelity (95% intervals), and realized error against max_error."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.6))
    for key, series in points.items():
        hits = [p for p in series if p["heldout"]["hits"]]
        rates = [p["heldout"]["hit_rate"] for p in hits]
        fidelity = [1 - p["heldout"]["differ_share"] for p in hits]
        low = [f - p["heldout"]["fidelity_95"][0] for f, p in zip(fidelity, hits)]
        high = [p["heldout"]["fidelity_95"][1] - f for f, p in zip(fidelity, hits)]
        label = key.replace("_all", ", 80% of rows warm").replace("_quarter", ", 25% warm")
        line = left.errorbar(rates, fidelity, yerr=[low, high], marker="o", capsize=3, label=label)
        for rate, f, p in zip(rates, fidelity, hits):
            left.annotate(f"{p['max_error']}", (rate, f), textcoords="offset points", xytext=(4, 4), fontsize=7)
        errors = [p["heldout"]["differ_share"] for p in hits]
        upper = [1 - p["heldout"]["fidelity_95"][0] - e for e, p in zip(errors, hits)]
        right.errorbar([p["max_error"] for p in hits], errors, yerr=[[0] * len(hits), upper], marker="o",
                       capsize=3, color=line[0].get_color(), label=label)
    bound = [0, max(CURVE)]
    right.plot(bound, bound, "--", color="grey", linewidth=1, label="the bound (max_error)")
    left.set_xlabel("held-out queries answered semantically")
    left.set_ylabel("fidelity (the hit's answer = the model's), 95% interval")
    left.set_title("hits against fidelity, max_error marked")
    right.set_xlabel("max_error")
    right.set_ylabel("realized error, with its 95% upper bound")
    right.set_title("realized error against the bound")
    for ax in (left, right):
        ax.grid(True, alpha=0.3)
    left.legend(fontsize=8, loc="lower left")
    fig.suptitle("Banking77 (MiniLM embeddings), offline replay of the calibrated rule: python -m bench.semantic_fit",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.semantic_fit")
    parser.add_argument("--out", default=str(default_out("semantic-fit")))
    parser.add_argument("--png", default=str(PLOT))
    args = parser.parse_args()
    if banking77_missing():
        raise SystemExit(f"bench.semantic_fit: nothing to replay: {banking77_missing()}")
    from server.tools.train_head import fit_softmax

    x, y = embed_banking77()
    classes = int(y.max()) + 1
    w, b = fit_softmax(x, y, classes, epochs=300, l2=1e-4)
    report: dict = {"recorded": recorded("bench.semantic_fit")}
    models = {"linear": x @ w + b, "mlp": mlp_logits(x, y, classes)}
    for name, logits in models.items():
        report[name] = {"train_accuracy": round(float((logits.argmax(1) == y).mean()), 4)}
        for rule, with_fit in (("interpolation", False), ("with_fit", True)):
            r = report[name][rule] = replay(x, y, logits, with_fit)
            print(f"{name:<6} {rule:<13} held-out hits {r['heldout']['hit_rate']:.1%} ({r['heldout']['differ']} differ); "
                  f"novel answered {r['novel']['hit_rate']:.1%} ({r['novel']['differ']} of {r['novel']['hits']} "
                  f"differ); thresholds {r['threshold']} / with the fit {r['threshold_with_fit']}", flush=True)
    report["curve"] = curve(x, y, models)
    Path(args.out).write_text(json.dumps(report, indent=1))
    plot(report["curve"], Path(args.png))
    print(f"wrote {args.out} and {args.png}")


if __name__ == "__main__":
    main()
