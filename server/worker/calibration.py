"""What a model version's semantic hits have been verified to be worth (calibrated rule, match_policy.py).

Outcomes come from two places, both the model's own answer beside what the rule would have answered:
- every covered miss (the neighbours were searched, the rule did not answer, the model computed);
- shadow verification of semantic hits (server/worker/shadow.py), recomputed in the background.

They are counted by the assessment's margin, in bins, in two sets: every outcome (the interpolation's own),
and those where the namespace's fit (server/shared/surrogate.py) agreed with the answer. A hit decided with a fit
uses the second set's threshold (or the first's, if lower); one decided without (no fit ready, beyond the
worker's fits, scores of another length, a fit dropped on an error) the first's, which bounds the
interpolation alone. One pool for both let outcomes the fit had filtered teach a near-zero threshold to
namespaces that have no fit to filter with. A set's threshold is the lowest bin edge at which the
one-sided 95% upper bound (Wilson) of the error rate among that set's outcomes at or above it is at most
`max_error`: with no outcomes there is no threshold (no semantic hits), and a few lucky ones do not make
one (0 errors in n bound the error by about 2.7/n, so 0.01 needs some 270 outcomes above the edge).

The guard: the live fidelity of the recent verified hits (weighted by the inverse of each one's chance of
being verified) below 1 - max_error raises both thresholds by a step per disagreement, until the recent
hits agree again (one guard over all hits: it protects the fidelity of what is served, not of each set).
Live fidelity is reported in GetStats and /metrics.

The outcomes describe the cached entries, which outlive a restart: a worker that stops cleanly writes
them beside its semantic index snapshots (counts only, no text), with the rule's settings, and the
next start reads them back unless the settings changed.
One owner: the worker's event loop.
"""

from __future__ import annotations

import json
import logging
import math
from collections import deque
from pathlib import Path

import numpy as np

from cachestore.env import DIR_MODE
from server.shared.telemetry import write_snapshot

log = logging.getLogger("infercache.calibration")

BIN = 0.125
EDGES = np.arange(0.0, 8.0 + BIN / 2, BIN)    # the last bin holds every margin >= 8
GUARD_STEP = 0.25                             # the threshold's rise per disagreement under the guard
Z = 1.645                                     # one-sided 95%
RECENT = 200                                  # verified hits the guard looks at
GUARD_MIN = 30                                # ... once it has this many


def wilson_upper(errors, n, z: float = Z):
    """One-sided upper bound of the error rate (Wilson); 1 where n is 0. Scalars or arrays."""
    n = np.asarray(n, dtype=float)
    safe = np.maximum(n, 1e-12)
    p = np.asarray(errors, dtype=float) / safe
    bound = (p + z * z / (2 * safe) + z * np.sqrt(p * (1 - p) / safe + z * z / (4 * safe * safe))) / (1 + z * z / safe)
    bound = np.where(n > 0, np.minimum(1.0, bound), 1.0)
    return float(bound) if bound.ndim == 0 else bound


def wilson_lower(agreed: float, n: float, z: float = 1.96) -> float:
    return 1.0 - wilson_upper(n - agreed, n, z) if n > 0 else 0.0


class Calibration:
    """One model version under one rule (`rule`: its settings, so outcomes of another rule never count)."""

    def __init__(self, max_error: float, rule: str = "") -> None:
        self.max_error = max_error
        self.rule = rule
        self.n = np.zeros((2, len(EDGES)))       # [every outcome, those the fit agreed with] x bins
        self.errors = np.zeros((2, len(EDGES)))
        self._base = np.full(2, math.inf)        # from the outcomes (read through `threshold_for`)
        self.tightened = 0       # guard steps in force
        self.verified = 0        # shadow-verified hits (since the first start), and their weighted agreement
        self.disagreed = 0
        self.verified_at_start = 0  # ... of which restored from before this process (for /metrics counters)
        self.disagreed_at_start = 0
        self._weight = 0.0
        self._agreed_weight = 0.0
        self._recent: deque[tuple[float, bool]] = deque(maxlen=RECENT)
        self._recent_weight = 0.0  # the weights in _recent, and those of its agreements
        self._recent_agreed = 0.0
        self._stale = False        # outcomes recorded since `_base` was last worked out

    @property
    def threshold(self) -> float:
        """The threshold of a hit decided without a fit."""
        return self.threshold_for(False)

    def threshold_for(self, fitted: bool) -> float:
        """The threshold of a hit decided with the namespace's fit consulted (True) or without (False).
        With: the lower of the two (a hit the fit agrees with also passes the rule without it; so a
        namespace whose fit becomes ready does not stop answering while outcomes with a fit gather)."""
        if self._stale:
            self._rebase()
        base = float(self._base.min() if fitted else self._base[0])
        return base + GUARD_STEP * self.tightened

    @property
    def fidelity(self) -> float | None:
        """Fidelity of every semantic hit served since the first start (None before one was verified)."""
        return self._agreed_weight / self._weight if self._weight else None

    def record(self, margin: float, agreed: bool, fit_agreed: bool = False) -> None:
        """An outcome at an assessment's margin: did the rule's answer equal the model's? `fit_agreed`:
        the namespace's fit ranked that answer first too (the outcome also counts for hits with a fit)."""
        if not math.isfinite(margin):
            return
        b = min(len(EDGES) - 1, max(0, int(np.searchsorted(EDGES, margin, side="right")) - 1))
        sets = [0, 1] if fit_agreed else [0]
        self.n[sets, b] += 1
        self.errors[sets, b] += not agreed
        self._stale = True  # worked out when next read: under load many outcomes come between decisions

    def _rebase(self) -> None:
        self._stale = False
        for s in (0, 1):
            at_or_above = np.cumsum(self.errors[s, ::-1])[::-1], np.cumsum(self.n[s, ::-1])[::-1]  # each edge
            bounds = wilson_upper(*at_or_above)
            passing = np.flatnonzero(bounds <= self.max_error)
            self._base[s] = float(EDGES[passing[0]]) if len(passing) else math.inf

    def verified_hit(self, margin: float, agreed: bool, chance: float, fit_agreed: bool = False) -> None:
        """A shadow-verified hit, which was verified with probability `chance`. It counts once among the
        outcomes (the checked hits over-represent those answered by unproven entries), and 1/chance
        times in the live fidelity, which estimates the fidelity of all hits served."""
        self.record(margin, agreed, fit_agreed)
        self.verified += 1
        self.disagreed += not agreed
        weight = 1.0 / chance
        self._weight += weight
        self._agreed_weight += weight * agreed
        self._remember(weight, agreed)
        recent = self._recent_agreed / self._recent_weight
        if len(self._recent) >= GUARD_MIN and recent < 1.0 - self.max_error:
            self.tightened += not agreed  # below the target: each disagreement raises the bar a step
        elif agreed and self.tightened:
            self.tightened -= 1           # recovered: each agreement lowers it a step

    def _remember(self, weight: float, agreed: bool) -> None:
        if len(self._recent) == RECENT:
            old_weight, old_agreed = self._recent[0]
            self._recent_weight -= old_weight
            self._recent_agreed -= old_weight * old_agreed
        self._recent.append((weight, agreed))
        self._recent_weight += weight
        self._recent_agreed += weight * agreed

    def stats(self) -> dict[str, int]:
        """GetStats figures (integers: thousandths and parts per million)."""
        out = {"verified": self.verified, "verified_disagreed": self.disagreed, "guard_steps": self.tightened,
               "outcomes": int(self.n[0].sum()), "outcomes_fit": int(self.n[1].sum()),
               # the weighted sums behind the fidelity, so a reader can take it over an interval
               "verified_weight_milli": int(round(self._weight * 1000)),
               "agreed_weight_milli": int(round(self._agreed_weight * 1000))}
        for name, fitted in (("threshold_milli", False), ("threshold_fit_milli", True)):
            if math.isfinite(threshold := self.threshold_for(fitted)):
                out[name] = int(round(threshold * 1000))
        if self.fidelity is not None:
            out["fidelity_ppm"] = int(round(self.fidelity * 1_000_000))
        return out

    def state(self) -> dict:
        """What a restart keeps (save/load)."""
        return {"rule": self.rule, "n": self.n.tolist(), "errors": self.errors.tolist(), "verified": self.verified,
                "disagreed": self.disagreed, "weight": self._weight, "agreed_weight": self._agreed_weight,
                "tightened": self.tightened, "recent": [[w, ok] for w, ok in self._recent]}

    @classmethod
    def restored(cls, state: dict, max_error: float, rule: str) -> "Calibration":
        calibration = cls(max_error, rule)
        n, errors = np.asarray(state["n"], dtype=float), np.asarray(state["errors"], dtype=float)
        if n.shape != calibration.n.shape or errors.shape != calibration.errors.shape:
            raise ValueError("outcome bins of another shape")
        calibration.n, calibration.errors = n, errors
        calibration.verified = calibration.verified_at_start = int(state["verified"])
        calibration.disagreed = calibration.disagreed_at_start = int(state["disagreed"])
        calibration._weight, calibration._agreed_weight = float(state["weight"]), float(state["agreed_weight"])
        calibration.tightened = int(state["tightened"])
        for w, ok in state["recent"][-RECENT:]:
            calibration._remember(float(w), bool(ok))
        calibration._rebase()
        return calibration


def path_for(snapshot_dir: Path) -> Path:
    """Beside the worker's snapshot folder, not in it (that folder is deleted when encryption is on)."""
    return snapshot_dir.parent / f"calibration-{snapshot_dir.name}.json"


def save(calibrations: dict[tuple[str, str], Calibration], path: Path) -> None:
    """Writes every model version's outcomes and live figures (atomically, the owner's user only)."""
    state = [{"model": model, "version": version, **c.state()} for (model, version), c in calibrations.items()]
    try:
        path.parent.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        write_snapshot(path, {"edges": EDGES.tolist(), "calibrations": state})
    except OSError as exc:
        log.warning("semantic calibration not saved (the next start learns it again): %s", exc)


def load(path: Path, served: dict[tuple[str, str], tuple[float, str]]) -> dict[tuple[str, str], Calibration]:
    """The saved outcomes of the served (model, version) -> (max_error, rule) whose rule is unchanged;
    none when the file is missing, unreadable or binned otherwise."""
    try:
        saved = json.loads(path.read_text())
        if saved["edges"] != EDGES.tolist():
            return {}
        out = {}
        for entry in saved["calibrations"]:
            key = (entry["model"], entry["version"])
            if key not in served:
                continue
            max_error, rule = served[key]
            if entry["rule"] != rule:
                log.info("semantic calibration of %s/%s was learnt under other settings; learning it again", *key)
                continue
            out[key] = Calibration.restored(entry, max_error, rule)
        return out
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("semantic calibration at %s unreadable, learning it again: %s", path, exc)
        return {}
