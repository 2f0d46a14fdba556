"""What a model version's semantic hits have been verified to be worth (calibrated rule, match_policy.py).

Outcomes come from two places, both the model's own answer beside what the rule would have answered:
- every miss where the rule had an opinion (an entry holds the answer the interpolation predicts, the
  rule did not answer, the model computed);
- shadow verification of semantic hits (server/worker/semantic/shadow.py), recomputed in the background.

They are counted in bins of the assessment's margin and of its residual (the query's distance from the
neighbours' hull), in two sets: every outcome (the interpolation's own), and those where the namespace's
fit (server/shared/surrogate.py) agreed with the answer. A set's region is a residual reach and a margin
threshold: a hit is admitted when its residual is within the reach and its margin at or above the
threshold. For each reach (residual bin edges), the threshold is the lowest margin edge at which the
one-sided 95% upper bound (Wilson) of the error rate among the set's outcomes within the reach and at or
above it is at most `max_error`; the region is the one of these that holds the most outcomes (the hits
it would have served). With no outcomes there is no region (no semantic hits), and a few lucky ones do
not make one (0 errors in n bound the error by about 2.7/n, so 0.01 needs some 270 outcomes in it).

How far the reach may go: a query far from every cached entry can be of a topic the cache never stored,
which no outcome within the cache's own traffic speaks for. Only the fit sees such a topic (from the
scores every entry holds for classes no entry answers), and only as well as it reproduces the model. So
the reach of hits decided without a fit is at most the policy's `coverage`; that of hits the fit agreed
with may go further once the fit is proven: its first class equalled the model's answer on computed
misses with the 95% upper bound of its disagreement at most `max_error` (a linear head, which the fit
reproduces, proves it; a model the fit only approximates does not, and keeps `coverage`).

A hit decided with a fit may pass either set's region; one decided without (no fit ready, beyond the
worker's fits, scores of another length, a fit dropped on an error) only the first's, which bounds the
interpolation alone. One pool for both let outcomes the fit had filtered teach a near-zero threshold to
namespaces that have no fit to filter with.

The guard: the live fidelity of the recent verified hits (weighted by the inverse of each one's chance of
being verified) below 1 - max_error raises every threshold by a step per disagreement, and keeps every
reach within `coverage`, until the recent hits agree again (one guard over all hits: it protects the
fidelity of what is served, not of each set). Live fidelity is reported in GetStats and /metrics.

The outcomes describe the cached entries, which outlive a restart: a worker that stops cleanly writes
them beside its semantic index snapshots (counts only, no text), with the rule's settings, and the
next start reads them back unless the settings changed.
One owner: the worker's event loop.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections import deque
from pathlib import Path

import numpy as np

from cachestore.env import DIR_MODE
from server.shared.match_policy import CalibratedPolicy
from server.shared.telemetry import write_snapshot

log = logging.getLogger("infercache.calibration")

BIN = 0.125
EDGES = np.arange(0.0, 8.0 + BIN / 2, BIN)    # the last bin holds every margin >= 8
REACHES = np.arange(21) / 20               # residual bins (0, 0.05, .. 1); the last holds every residual >= 1
NO_REGION = (math.inf, -math.inf)             # (margin threshold, reach) of a set whose outcomes bound no region
GUARD_STEP = 0.25                             # the threshold's rise per disagreement under the guard
Z = 1.645                                     # one-sided 95%
RECENT = 200                                  # verified hits the guard looks at
GUARD_MIN = 30                                # ... once it has this many
REBASE_S = 0.05                               # decisions work the regions out again at most this often (about
#                                               100 us each: under load an outcome comes with almost every miss)


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

    def __init__(self, max_error: float, rule: str = "", coverage: float = math.inf) -> None:
        self.max_error = max_error
        self.rule = rule
        self.coverage = coverage                 # the reach of hits no proven fit vouched for
        # [every outcome, those the fit agreed with] x residual bins x margin bins
        self.n = np.zeros((2, len(REACHES), len(EDGES)))
        self.errors = np.zeros_like(self.n)
        self.fit_answers = 0                     # computed misses where the fit had an answer ...
        self.fit_disagreed = 0                   # ... and it was not the model's
        self.fit_proven = False                  # ... seldom enough to let hits reach beyond coverage (`_prove_fit`)
        # each set's region (margin threshold, the residual below which it admits), within coverage and not
        self._regions = [[NO_REGION, NO_REGION], [NO_REGION, NO_REGION]]
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
        self._stale = False        # outcomes recorded since `_regions` were last worked out ...
        self._rebased_at = -math.inf  # ... at this time (monotonic)
        self.rebase_s = REBASE_S   # decisions work them out again at most this often

    @classmethod
    def under(cls, policy, rule: str) -> "Calibration":
        """For a model version under the calibrated `policy` (match_policy.CalibratedPolicy); `rule`: its settings."""
        return cls(policy.max_error, rule, policy.coverage)

    @property
    def threshold(self) -> float:
        """The margin threshold of a hit decided without a fit."""
        return self.threshold_for(False)

    def threshold_for(self, fitted: bool) -> float:
        """The margin threshold of the region of hits decided without a fit (False) or of those the fit
        agreed with (True)."""
        return self._region(int(fitted))[0]

    def reach_for(self, fitted: bool) -> float:
        """The residual below which that region admits (-inf: no region; inf: any residual)."""
        return self._region(int(fitted))[1]

    def admits(self, margin: float, residual: float, fitted: bool) -> bool:
        """Whether a hit at this margin and residual is within the rule's bound. Decided with the fit
        consulted (it agreed), it may pass either region: a hit the fit agrees with also passes the rule
        without it, so a namespace whose fit becomes ready does not stop answering while outcomes with
        a fit gather."""
        for s in ((0, 1) if fitted else (0,)):
            threshold, reach = self._region(s, self.rebase_s)
            if margin >= threshold and residual < reach:
                return True
        return False

    def _region(self, s: int, within_s: float = 0.0) -> tuple[float, float]:
        """Set s's region; worked out again if outcomes came since, and (for decisions: `within_s`) the
        last time is that long ago."""
        if self._stale and time.monotonic() - self._rebased_at >= within_s:
            self._rebase()
        beyond = s == 1 and not self.tightened and self.fit_proven
        threshold, reach = self._regions[s][beyond]
        return threshold + GUARD_STEP * self.tightened, reach

    @property
    def fidelity(self) -> float | None:
        """Fidelity of every semantic hit served since the first start (None before one was verified)."""
        return self._agreed_weight / self._weight if self._weight else None

    def record(self, margin: float, agreed: bool, fit_agreed: bool = False, residual: float = 0.0) -> None:
        """An outcome at an assessment's margin and residual: did the rule's answer equal the model's?
        `fit_agreed`: the namespace's fit ranked that answer first too (the outcome also counts for hits
        with a fit)."""
        if not (math.isfinite(margin) and math.isfinite(residual)):
            return
        m = min(len(EDGES) - 1, max(0, int(np.searchsorted(EDGES, margin, side="right")) - 1))
        r = min(len(REACHES) - 1, max(0, int(np.searchsorted(REACHES, residual, side="right")) - 1))
        sets = [0, 1] if fit_agreed else [0]
        self.n[sets, r, m] += 1
        self.errors[sets, r, m] += not agreed
        self._stale = True  # worked out when next read: under load many outcomes come between decisions

    def record_fit(self, agreed: bool) -> None:
        """A computed miss where the namespace's fit had an answer: was it the model's?"""
        self.fit_answers += 1
        self.fit_disagreed += not agreed
        self._prove_fit()

    def _prove_fit(self) -> None:
        """Worked out when the counts change (decisions read it): the 95% bound of the fit's disagreement
        with the model within max_error."""
        self.fit_proven = wilson_upper(self.fit_disagreed, self.fit_answers) <= self.max_error

    def _rebase(self) -> None:
        self._stale, self._rebased_at = False, time.monotonic()
        tops = np.append(REACHES[1:], math.inf)  # each residual bin's upper edge: a reach
        within = tops <= self.coverage + 1e-9 if self.coverage < 2 else np.ones(len(tops), bool)  # (residuals <= 2)
        # Both sets at once: outcomes within each reach (axis 1), at or above each margin edge (axis 2).
        n = np.cumsum(np.cumsum(self.n, axis=1)[:, :, ::-1], axis=2)[:, :, ::-1]
        errors = np.cumsum(np.cumsum(self.errors, axis=1)[:, :, ::-1], axis=2)[:, :, ::-1]
        passing = wilson_upper(errors, n) <= self.max_error
        first = np.where(passing.any(axis=2), passing.argmax(axis=2), -1)  # the lowest passing edge per set and reach
        held = np.where(first >= 0, np.take_along_axis(n, np.maximum(first, 0)[:, :, None], axis=2)[:, :, 0], 0)
        for beyond, candidates in ((False, np.where(within, held, 0)), (True, held)):
            best = candidates.argmax(axis=1)  # the region that holds the most outcomes (the nearest reach of a tie)
            for s in (0, 1):
                b = int(best[s])
                self._regions[s][beyond] = (float(EDGES[first[s, b]]), float(tops[b])) if candidates[s, b] else NO_REGION

    def verified_hit(self, margin: float, agreed: bool, chance: float, fit_agreed: bool = False,
                     residual: float = 0.0) -> None:
        """A shadow-verified hit, which was verified with probability `chance`. It counts once among the
        outcomes (the checked hits over-represent those answered by unproven entries), and 1/chance
        times in the live fidelity, which estimates the fidelity of all hits served."""
        self.record(margin, agreed, fit_agreed, residual)
        if fit_agreed:  # decided with the fit, which answered as the hit did
            self.record_fit(agreed)
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
               "fit_answers": self.fit_answers, "fit_disagreed": self.fit_disagreed,
               # the weighted sums behind the fidelity, so a reader can take it over an interval
               "verified_weight_milli": int(round(self._weight * 1000)),
               "agreed_weight_milli": int(round(self._agreed_weight * 1000))}
        for suffix, fitted in (("", False), ("_fit", True)):
            threshold, reach = self._region(int(fitted))
            if math.isfinite(threshold):
                out[f"threshold{suffix}_milli"] = int(round(threshold * 1000))
                out[f"reach{suffix}_milli"] = int(round(min(reach, 2.0) * 1000))  # (residuals of unit vectors <= 2)
        if self.fidelity is not None:
            out["fidelity_ppm"] = int(round(self.fidelity * 1_000_000))
        return out

    def state(self) -> dict:
        """What a restart keeps (save/load)."""
        return {"rule": self.rule, "n": self.n.tolist(), "errors": self.errors.tolist(),
                "fit_answers": self.fit_answers, "fit_disagreed": self.fit_disagreed, "verified": self.verified,
                "disagreed": self.disagreed, "weight": self._weight, "agreed_weight": self._agreed_weight,
                "tightened": self.tightened, "recent": [[w, ok] for w, ok in self._recent]}

    @classmethod
    def restored(cls, state: dict, max_error: float, rule: str, coverage: float = math.inf) -> "Calibration":
        calibration = cls(max_error, rule, coverage)
        n, errors = np.asarray(state["n"], dtype=float), np.asarray(state["errors"], dtype=float)
        if n.shape != calibration.n.shape or errors.shape != calibration.errors.shape:
            raise ValueError("outcome bins of another shape")
        calibration.n, calibration.errors = n, errors
        calibration.fit_answers, calibration.fit_disagreed = int(state["fit_answers"]), int(state["fit_disagreed"])
        calibration._prove_fit()
        calibration.verified = calibration.verified_at_start = int(state["verified"])
        calibration.disagreed = calibration.disagreed_at_start = int(state["disagreed"])
        calibration._weight, calibration._agreed_weight = float(state["weight"]), float(state["agreed_weight"])
        calibration.tightened = int(state["tightened"])
        for w, ok in state["recent"][-RECENT:]:
            calibration._remember(float(w), bool(ok))
        calibration._rebase()
        return calibration


def learn(calibration: Calibration, neighbors, assessment, answer: str) -> None:
    """What a computed miss teaches: the fit's answer against the model's (`answer`), and, where the rule
    had an opinion (match_policy.CalibratedPolicy.opines), an outcome at its margin and residual."""
    if assessment.fitted is not None:
        calibration.record_fit(assessment.fitted == answer)
    if CalibratedPolicy.opines(neighbors, assessment):
        calibration.record(assessment.margin, assessment.answer == answer, assessment.fitted == assessment.answer,
                           assessment.residual)


def path_for(snapshot_dir: Path) -> Path:
    """Beside the worker's snapshot folder, not in it (that folder is deleted when encryption is on)."""
    return snapshot_dir.parent / f"calibration-{snapshot_dir.name}.json"


def save(calibrations: dict[tuple[str, str], Calibration], path: Path) -> None:
    """Writes every model version's outcomes and live figures (atomically, the owner's user only)."""
    state = [{"model": model, "version": version, **c.state()} for (model, version), c in calibrations.items()]
    try:
        path.parent.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        write_snapshot(path, {"edges": EDGES.tolist(), "reaches": REACHES.tolist(), "calibrations": state})
    except OSError as exc:
        log.warning("semantic calibration not saved (the next start learns it again): %s", exc)


def load(path: Path, served: dict[tuple[str, str], tuple]) -> dict[tuple[str, str], Calibration]:
    """The saved outcomes of the served (model, version) -> (its match_policy.CalibratedPolicy, the rule's
    settings) whose settings are unchanged; none when the file is missing, unreadable or binned otherwise."""
    try:
        saved = json.loads(path.read_text())
        if saved["edges"] != EDGES.tolist() or saved.get("reaches") != REACHES.tolist():
            return {}
        out = {}
        for entry in saved["calibrations"]:
            key = (entry["model"], entry["version"])
            if key not in served:
                continue
            policy, rule = served[key]
            if entry["rule"] != rule:
                log.info("semantic calibration of %s/%s was learnt under other settings; learning it again", *key)
                continue
            out[key] = Calibration.restored(entry, policy.max_error, rule, policy.coverage)
        return out
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("semantic calibration at %s unreadable, learning it again: %s", path, exc)
        return {}
