"""What `infercache train-head` measures of a head as a judge of semantic answers, on its own labelled
rows (server/worker/semantic/label_calibration.py says what it is for): class scores of every row by a head that
never saw it (k folds), the temperature that makes them honest, and the labelled pairs by their
probability of sharing a label."""

from __future__ import annotations

import numpy as np

from server.worker.semantic.label_calibration import BINS, LabelCalibration, tempered

FOLDS = 5
NEIGHBORS = 10     # a row's nearest rows among which its pair is looked for (the rule's default k)
DUPLICATE = 0.9999  # rows this similar are one text (an exact hit, never a semantic one): not paired
TEMPERATURES = np.exp(np.linspace(-3.0, 2.0, 101))


def held_out_logits(x: np.ndarray, y: np.ndarray, classes: int, fit) -> np.ndarray:
    """Each row's logits by a head fitted on the other folds (`fit(x, y) -> (w, b)`); rows i % FOLDS apart."""
    fold = np.arange(len(x)) % FOLDS
    out = np.zeros((len(x), classes), dtype=np.float32)
    for f in range(min(FOLDS, len(x))):
        w, b = fit(x[fold != f], y[fold != f])
        out[fold == f] = x[fold == f] @ w + b
    return out


def softmax(logits: np.ndarray) -> np.ndarray:
    z = logits - logits.max(axis=1, keepdims=True)
    p = np.exp(z)
    return p / p.sum(axis=1, keepdims=True)


def temperature(logits: np.ndarray, y: np.ndarray) -> float:
    """The temperature of least log-loss on held-out logits."""
    rows = np.arange(len(y))
    losses = [-np.log(softmax(logits / t)[rows, y] + 1e-12).mean() for t in TEMPERATURES]
    return float(TEMPERATURES[int(np.argmin(losses))])


def pairs(x: np.ndarray, y: np.ndarray, logits: np.ndarray, temperature_: float, chunk: int = 1024
          ) -> tuple[np.ndarray, np.ndarray]:
    """Each row paired with its nearest other row (of the NEIGHBORS nearest by the embeddings `x`, unit
    vectors) that the held-out heads label alike: counts per bin of same_label, and of those whose labels
    differ."""
    p = tempered(softmax(logits.astype(np.float64)), temperature_)
    judged = logits.argmax(axis=1)
    n, errors = np.zeros(BINS), np.zeros(BINS)
    k = min(NEIGHBORS + 1, len(x))
    for start in range(0, len(x), chunk):
        similarity = x[start:start + chunk] @ x.T
        rows = np.arange(start, min(start + chunk, len(x)))
        similarity[rows - start, rows] = -np.inf
        nearest = np.argpartition(-similarity, k - 1, axis=1)[:, :k]
        for i, row in enumerate(rows):
            for j in nearest[i][np.argsort(-similarity[i, nearest[i]])]:
                if similarity[i, j] >= DUPLICATE or judged[j] != judged[row]:
                    continue
                b = min(BINS - 1, int(float(p[row] @ p[j]) * BINS))
                n[b] += 1
                errors[b] += y[row] != y[j]
                break
    return n, errors


def calibrate(x: np.ndarray, y: np.ndarray, classes: int, fit) -> tuple[LabelCalibration, float]:
    """The head's label calibration from its rows (`fit(x, y) -> (w, b)` trains a head), and the
    held-out accuracy."""
    logits = held_out_logits(x, y, classes, fit)
    t = temperature(logits, y)
    n, errors = pairs(x, y, logits, t)
    return LabelCalibration(t, n, errors), float((logits.argmax(axis=1) == y).mean())
