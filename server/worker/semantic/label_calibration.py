"""A judge's calibration against the truth: how often two questions that a classifier judge would give
the same answer really share a label (semantic answers of generative models: answer_matching.py).

The judge's own verdicts (server/worker/semantic/calibration.py) bound how often a semantic answer's question and
the new one differ in the judge's eyes; the judge is itself wrong now and then, on either question, and
two questions it labels alike can then differ in meaning. `infercache train-head` measures that on the
labelled rows it was given, with heads that never saw them (cross-validation,
server/tools/judge_calibration.py), and writes beside the head (LABEL_CALIBRATION_FILE):
- `temperature`: the one that makes the held-out scores honest probabilities (least log-loss);
- counts of labelled pairs by their probability of sharing a label, `same_label`: each row paired
  with its nearest other row that its held-out head labels alike (as a cache offers the nearest entry
  holding the judge's label), and whether the two rows' own labels agree.
A semantic answer then needs `same_label` of the new question and the cached one at or above the lowest
probability of a pair at and above which the pairs disagree, by the one-sided 95% upper bound (Wilson),
at most `max_error` (`threshold`); none reaches it: no semantic answers under that judge.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from server.worker.semantic.calibration import wilson_upper

LABEL_CALIBRATION_FILE = "label_calibration.json"
BINS = 1000  # pairs are counted in bins of same_label this wide: 1/BINS


def tempered(scores: np.ndarray, temperature: float) -> np.ndarray:
    """Class probabilities (softmax outputs) at another temperature: softmax(logits / temperature)."""
    p = np.power(np.maximum(np.asarray(scores, dtype=np.float64), 0.0), 1.0 / temperature)
    total = p.sum(axis=-1, keepdims=True)
    return np.divide(p, total, out=np.zeros_like(p), where=total > 0)


def same_label(query: np.ndarray, cached: np.ndarray, temperature: float) -> float:
    """The probability that two questions share a label, their calibrated class probabilities being
    independent: the sum over labels of p_query(label) * p_cached(label)."""
    return float(tempered(query, temperature) @ tempered(cached, temperature))


@dataclass
class LabelCalibration:
    temperature: float
    n: np.ndarray        # labelled pairs per bin of same_label (BINS bins over [0, 1])
    errors: np.ndarray   # ... whose rows' labels differ
    _thresholds: dict[float, float] = field(default_factory=dict, repr=False)

    def threshold(self, max_error: float) -> float:
        """The lowest probability of a pair (its bin's lower edge) at and above which the pairs disagree, by
        the one-sided 95% upper bound, at most max_error (inf: no such pair). Between pairs nothing is known:
        the threshold is never below the pairs that bound it."""
        if (found := self._thresholds.get(max_error)) is None:
            n, errors = np.cumsum(self.n[::-1])[::-1], np.cumsum(self.errors[::-1])[::-1]
            passing = np.flatnonzero((wilson_upper(errors, n) <= max_error) & (self.n > 0))
            found = self._thresholds[max_error] = float(passing[0]) / BINS if len(passing) else math.inf
        return found

    def admits(self, query: np.ndarray, cached: np.ndarray, max_error: float) -> bool:
        """Whether the cached question's answer may answer the query: their same_label at or above the threshold."""
        return same_label(query, cached, self.temperature) >= self.threshold(max_error)

    def to_json(self) -> dict:
        return {"temperature": self.temperature, "bins": BINS, "pairs": self.n.astype(int).tolist(),
                "disagreed": self.errors.astype(int).tolist()}


def read(version_dir: Path) -> LabelCalibration | None:
    """The head version's calibration (None: it has none). ValueError where the file does not read."""
    path = version_dir / LABEL_CALIBRATION_FILE
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: {exc}") from None
    try:
        temperature = float(data["temperature"])
        n, errors = np.asarray(data["pairs"], dtype=float), np.asarray(data["disagreed"], dtype=float)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{path}: {exc!r}") from None
    if (data.get("bins") != BINS or n.shape != (BINS,) or errors.shape != (BINS,) or not 0 < temperature < math.inf
            or (errors > n).any() or (errors < 0).any()):
        raise ValueError(f"{path}: not a calibration of {BINS} bins with a positive temperature")
    return LabelCalibration(temperature, n, errors)
