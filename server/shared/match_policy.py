"""The semantic match policies: when may a cached near-duplicate answer a request?

A wrong cached answer is worse than a slow one. Two rules:

- **calibrated** (the default): the user sets `max_error`, the probability that a semantic hit differs
  from the model's own answer. The k nearest entries' class scores are interpolated at the query
  (`assess`): weights that rebuild the query's embedding from theirs (an affine combination, ridge
  regularized) applied to their log-scores. For a model whose scores vary smoothly with the embedding
  this is a first-order estimate of the model's scores at the query; for a linear head on the embedder it
  is exact when the query lies in the neighbours' affine hull. The predicted answer's lead over its
  runner-up (`margin`) and the query's distance from the neighbours' hull (`residual`) must lie in the
  region that verified outcomes say keeps the error under `max_error` (server/worker/semantic/calibration.py);
  the residual at most `coverage` unless the namespace's fit is proven to reproduce the model. A query far
  from everything cached is a miss whatever its nearest label.
  And the namespace's cache-wide fit of the model's scores (server/shared/surrogate.py) must not rank another
  answer first: the interpolation cannot see where the query leaves the neighbours' hull, the fit can,
  from the scores every entry holds for classes no entry answers. A query of a topic the cache has never
  stored, beside one it has, is a miss when the fit says the model would answer the new topic. A hit
  decided with the fit has a region of its own, learnt from the outcomes the fit agreed with; one
  decided without (a namespace with fewer entries than the embedding has dimensions, beyond the worker's
  MAX_FITS, or with scores of another length) that of every outcome (server/worker/semantic/calibration.py).
- **consensus** (an expert override, chosen by setting `min_similarity` in the config): a fixed
  similarity floor and agreement among the nearest neighbours.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import numpy as np

from server.shared.surrogate import RIDGE as FIT_RIDGE
from server.shared.surrogate import log_scores

RIDGE = 0.01  # keeps the weights bounded when neighbours nearly coincide


@dataclass(frozen=True)
class Neighbor:
    similarity: float
    key: bytes
    answer: str


@dataclass(frozen=True)
class Assessment:
    """What the nearest entries say of the model's answer at the query."""

    answer: str      # the label the interpolated scores rank first
    margin: float    # its lead over the runner-up (log-probability)
    residual: float  # the query's distance from the neighbours' affine hull (unit vectors: 0 .. 2)
    fitted: str | None = None  # the label the namespace's cache-wide fit ranks first (None: no fit yet)


def assess(query: np.ndarray, vectors: np.ndarray, scores: np.ndarray, labels: list[str],
           fitted: str | None = None) -> Assessment:
    """`vectors` (k x dim) and `scores` (k x classes, probabilities) of the k nearest entries; `fitted`:
    what the namespace's fit (server/shared/surrogate.py) answers at the query."""
    k = len(vectors)
    gram = vectors @ vectors.T + RIDGE * np.eye(k)
    toward_query, toward_ones = np.linalg.solve(gram, np.stack([vectors @ query, np.ones(k)], axis=1)).T
    weights = toward_query + (1.0 - toward_query.sum()) / toward_ones.sum() * toward_ones  # they sum to 1
    logits = weights @ log_scores(scores)
    first = int(np.argmax(logits))
    if len(logits) > 1:
        lead = logits[first]
        logits[first] = -np.inf
        margin = float(lead - logits.max())
    else:
        margin = math.inf
    residual = float(np.linalg.norm(query - weights @ vectors))
    return Assessment(labels[first] if first < len(labels) else "", margin, residual, fitted)


@dataclass(frozen=True)
class CalibratedPolicy:
    embedder: str = "minilm"
    max_error: float = 0.01      # P(semantic hit != the model's answer) to stay under
    coverage: float = 0.5        # the most residual of a hit no proven fit vouched for (Banking77: held-out median 0.31)
    k: int = 10                  # neighbours interpolated
    verify_fraction: float = 0.1  # share of hits recomputed in the background (all while an entry is unproven)
    calibrated = True
    rule = "calibrated"

    def decide(self, neighbors: list[Neighbor], assessment: Assessment | None, calibration,
               min_similarity: float | None = None) -> Neighbor | None:
        """The entry that answers (the nearest holding the predicted answer), or None. `calibration`:
        the model version's (server/worker/semantic/calibration.py), which says what margin and residual it admits."""
        if assessment is None or not neighbors:
            return None
        if min_similarity is not None and neighbors[0].similarity < min_similarity:
            return None
        if not self.opines(neighbors, assessment):
            return None
        if not calibration.admits(assessment.margin, assessment.residual, assessment.fitted is not None):
            return None
        if assessment.fitted not in (None, assessment.answer):  # the fit refuses
            return None
        return next(n for n in neighbors if n.answer == assessment.answer)

    def settings(self, embedder_version: str) -> str:
        """What outcomes learnt under this rule depend on (server/worker/semantic/calibration.py keeps them with it)."""
        return (f"{self.embedder}/{embedder_version} k={self.k} coverage={self.coverage} ridge={RIDGE} "
                f"fit_ridge={FIT_RIDGE}")

    @staticmethod
    def opines(neighbors: list[Neighbor], assessment: Assessment) -> bool:
        """An entry holds the predicted answer: the interpolation would answer in a wide enough region, so
        such a miss is an outcome to calibrate on, at its margin and residual (for hits with a fit too
        when the fit agreed: server/worker/semantic/calibration.py)."""
        return any(n.answer == assessment.answer for n in neighbors)


@dataclass(frozen=True)
class MatchPolicy:
    """The fixed consensus rule. All of:
    - the nearest neighbour's similarity >= min_similarity;
    - the nearest and every neighbour among the k nearest with similarity >= neighborhood hold the
      same answer, and at least min_agree of them do (the nearest included).
    """

    embedder: str = "minilm"
    min_similarity: float = 0.62
    neighborhood: float = 0.65
    k: int = 5
    min_agree: int = 2
    calibrated = False
    rule = "consensus"

    def decide(self, neighbors: list[Neighbor], min_similarity: float | None = None) -> Neighbor | None:
        floor = self.min_similarity if min_similarity is None else min_similarity
        if not neighbors or neighbors[0].similarity < floor:
            return None
        nearest = neighbors[0]
        close = [nearest] + [n for n in neighbors[1:self.k] if n.similarity >= self.neighborhood]
        if len(close) < self.min_agree or any(n.answer != nearest.answer for n in close):
            return None
        return nearest


def policy_from_config(section: dict | None) -> CalibratedPolicy | MatchPolicy | None:
    """The model's policy from its config.yaml `semantic:` section (None when off). Setting
    `min_similarity` chooses the fixed consensus rule; otherwise the calibrated rule applies."""
    if not section:
        return None
    if not isinstance(section, dict):
        raise ValueError(f"semantic: expected a mapping of settings, got {section!r}")
    if not section.get("enabled", False):  # off: still no key that neither rule knows
        names = {f.name for cls in (MatchPolicy, CalibratedPolicy) for f in fields(cls)}
        if unknown := set(section) - names - {"enabled"}:
            raise ValueError(f"semantic: {', '.join(sorted(unknown))} not settings of either rule "
                             f"({', '.join(sorted(names))})")
        return None
    cls = MatchPolicy if "min_similarity" in section else CalibratedPolicy
    names = {f.name for f in fields(cls)}
    unknown = set(section) - names - {"enabled"}
    if unknown:
        raise ValueError(f"semantic: {', '.join(sorted(unknown))} not settings of the {cls.rule} rule "
                         f"({', '.join(sorted(names))}; min_similarity chooses the consensus rule)")
    try:
        policy = cls(**{k: type(getattr(cls, k))(v) for k, v in section.items() if k in names})
    except (TypeError, ValueError) as exc:
        raise ValueError(f"semantic: {exc}") from None
    if isinstance(policy, MatchPolicy):
        if not (0 < policy.min_similarity <= 1 and 0 < policy.neighborhood <= 1 and policy.k >= policy.min_agree >= 1):
            raise ValueError("semantic: need 0 < min_similarity, neighborhood <= 1 and k >= min_agree >= 1")
    elif not (0 < policy.max_error < 1 and 0 < policy.coverage <= 2 and policy.k >= 2
              and 0 <= policy.verify_fraction <= 1):
        raise ValueError("semantic: need 0 < max_error < 1, 0 < coverage <= 2, k >= 2 and 0 <= verify_fraction <= 1")
    return policy
