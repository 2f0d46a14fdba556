"""What a model version's semantic hits have been verified to be worth (calibrated rule, match_policy.py).

Outcomes come from two places, both the model's own answer beside what the rule would have answered:
- every covered miss (the neighbours were searched, the rule did not answer, the model computed);
- shadow verification of semantic hits (server/shadow.py), recomputed in the background.

They are counted by the assessment's margin, in bins. The threshold is the lowest bin edge at which the
one-sided 95% upper bound (Wilson) of the error rate among every outcome at or above it is at most
`max_error`: with no outcomes there is no threshold (no semantic hits), and a few lucky ones do not make
one (0 errors in n bound the error by about 2.7/n, so 0.01 needs some 270 outcomes above the edge).

The guard: the live fidelity of the recent verified hits (weighted by the inverse of each one's chance of
being verified) below 1 - max_error raises the threshold by a step per disagreement, until the recent
hits agree again. Live fidelity is reported in GetStats and /metrics.

The outcomes describe the cached entries, which outlive a restart: a worker that stops cleanly writes
them beside its semantic index snapshots (counts only, no text), and the next start reads them back.
One owner: the worker's event loop.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections import deque
from pathlib import Path

import numpy as np

from cachestore.env import DIR_MODE, FILE_MODE

log = logging.getLogger("infercache.calibration")

BIN = 0.125
EDGES = np.arange(0.0, 8.0 + BIN / 2, BIN)    # the last bin holds every margin >= 8
GUARD_STEP = 0.25                             # the threshold's rise per disagreement under the guard
Z = 1.645                                     # one-sided 95%
RECENT = 200                                  # verified hits the guard looks at
GUARD_MIN = 30                                # ... once it has this many
FILE_NAME = "calibration.json"                # beside the worker's index snapshots


def wilson_upper(errors: float, n: float, z: float = Z) -> float:
    if n <= 0:
        return 1.0
    p = errors / n
    return min(1.0, (p + z * z / (2 * n) + z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))) / (1 + z * z / n))


def wilson_lower(agreed: float, n: float, z: float = 1.96) -> float:
    return 1.0 - wilson_upper(n - agreed, n, z) if n > 0 else 0.0


class Calibration:
    def __init__(self, max_error: float) -> None:
        self.max_error = max_error
        self.n = np.zeros(len(EDGES))
        self.errors = np.zeros(len(EDGES))
        self.base = math.inf     # from the outcomes
        self.tightened = 0       # guard steps in force
        self.verified = 0        # shadow-verified hits, and their weighted agreement
        self.disagreed = 0
        self._weight = 0.0
        self._agreed_weight = 0.0
        self._recent: deque[tuple[float, bool]] = deque(maxlen=RECENT)

    @property
    def threshold(self) -> float:
        return self.base + GUARD_STEP * self.tightened

    @property
    def fidelity(self) -> float | None:
        """Live fidelity of the semantic hits served (None before one was verified)."""
        return self._agreed_weight / self._weight if self._weight else None

    def record(self, margin: float, agreed: bool) -> None:
        """An outcome at an assessment's margin: did the rule's answer equal the model's?"""
        b = min(len(EDGES) - 1, max(0, int(np.searchsorted(EDGES, margin, side="right")) - 1))
        self.n[b] += 1
        self.errors[b] += not agreed
        self._rebase()

    def state(self) -> dict:
        """What a restart keeps (server/calibration.py save/load)."""
        return {"n": self.n.tolist(), "errors": self.errors.tolist(), "verified": self.verified,
                "disagreed": self.disagreed, "weight": self._weight, "agreed_weight": self._agreed_weight}

    @classmethod
    def restored(cls, state: dict, max_error: float) -> "Calibration":
        calibration = cls(max_error)
        n, errors = np.asarray(state["n"], dtype=float), np.asarray(state["errors"], dtype=float)
        if n.shape != calibration.n.shape or errors.shape != calibration.errors.shape:
            raise ValueError("outcome bins of another shape")
        calibration.n, calibration.errors = n, errors
        calibration.verified, calibration.disagreed = int(state["verified"]), int(state["disagreed"])
        calibration._weight, calibration._agreed_weight = float(state["weight"]), float(state["agreed_weight"])
        calibration._rebase()
        return calibration

    def _rebase(self) -> None:
        n = np.cumsum(self.n[::-1])[::-1]  # outcomes at or above each edge
        errors = np.cumsum(self.errors[::-1])[::-1]
        self.base = next((float(EDGES[i]) for i in range(len(EDGES)) if wilson_upper(errors[i], n[i]) <= self.max_error),
                         math.inf)

    def verified_hit(self, margin: float, agreed: bool, chance: float) -> None:
        """A shadow-verified hit, which was verified with probability `chance`."""
        self.record(margin, agreed)
        self.verified += 1
        self.disagreed += not agreed
        weight = 1.0 / chance
        self._weight += weight
        self._agreed_weight += weight * agreed
        self._recent.append((weight, agreed))
        total = sum(w for w, _ in self._recent)
        recent = sum(w for w, ok in self._recent if ok) / total
        if len(self._recent) >= GUARD_MIN and recent < 1.0 - self.max_error:
            self.tightened += not agreed  # below the target: each disagreement raises the bar a step
        elif agreed and self.tightened:
            self.tightened -= 1           # recovered: each agreement lowers it a step

    def stats(self) -> dict[str, int]:
        """GetStats figures (integers: thousandths and parts per million)."""
        out = {"verified": self.verified, "verified_disagreed": self.disagreed, "guard_steps": self.tightened,
               "outcomes": int(self.n.sum()),
               # the weighted sums behind the fidelity, so a reader can take it over an interval
               "verified_weight_milli": int(round(self._weight * 1000)),
               "agreed_weight_milli": int(round(self._agreed_weight * 1000))}
        if math.isfinite(self.threshold):
            out["threshold_milli"] = int(round(self.threshold * 1000))
        if self.fidelity is not None:
            out["fidelity_ppm"] = int(round(self.fidelity * 1_000_000))
        return out


def save(calibrations: dict[tuple[str, str], Calibration], path: Path) -> None:
    """Writes every model version's outcomes and live figures (atomically, the owner's user only)."""
    state = [{"model": model, "version": version, **c.state()} for (model, version), c in calibrations.items()]
    try:
        path.parent.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"edges": EDGES.tolist(), "calibrations": state}))
        os.chmod(tmp, FILE_MODE)
        tmp.replace(path)
    except OSError as exc:
        log.warning("semantic calibration not saved (the next start learns it again): %s", exc)


def load(path: Path, max_errors: dict[tuple[str, str], float]) -> dict[tuple[str, str], Calibration]:
    """The saved outcomes of the model versions in `max_errors` (their configured bound); none when the
    file is missing, unreadable or binned otherwise."""
    try:
        saved = json.loads(path.read_text())
        if saved["edges"] != EDGES.tolist():
            return {}
        out = {}
        for entry in saved["calibrations"]:
            key = (entry["model"], entry["version"])
            if key in max_errors:
                out[key] = Calibration.restored(entry, max_errors[key])
        return out
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("semantic calibration at %s unreadable, learning it again: %s", path, exc)
        return {}
