"""The semantic match policy: when may a cached near-duplicate answer a request?

A wrong cached answer is worse than a slow one, so one similarity over one threshold is not enough:
the nearest neighbours must also agree on the answer they hold (consensus).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Neighbor:
    similarity: float
    key: bytes
    answer: str


@dataclass(frozen=True)
class MatchPolicy:
    """When a cached neighbour may answer. All of:
    - the nearest neighbour's similarity >= min_similarity;
    - every neighbour among the k nearest with similarity >= neighborhood holds the same answer;
    - at least min_agree of them (the nearest included) do.
    """

    # Defaults from `infercache eval-semantic` on Banking77 train (5-fold CV, 10,003 rows): 80.1% of
    # exact misses answered at 99.32% fidelity, where the best fixed threshold reaching 99% (0.96)
    # answers 20.5% (bench/results/semantic.json). Two agreeing neighbours are required: with one, a
    # lone entry in a sparse cache answers for anything near it.
    embedder: str = "minilm"
    min_similarity: float = 0.62
    neighborhood: float = 0.65
    k: int = 5
    min_agree: int = 2

    def decide(self, neighbors: list[Neighbor], min_similarity: float | None = None) -> Neighbor | None:
        floor = self.min_similarity if min_similarity is None else min_similarity
        if not neighbors or neighbors[0].similarity < floor:
            return None
        nearest = neighbors[0]
        close = [n for n in neighbors[: self.k] if n.similarity >= min(self.neighborhood, floor)]
        if len(close) < self.min_agree or any(n.answer != nearest.answer for n in close):
            return None
        return nearest


def policy_from_config(section: dict | None) -> MatchPolicy | None:
    """The model's policy from its config.yaml `semantic:` section (None when off)."""
    if not section or not section.get("enabled", False):
        return None
    fields = {k: section[k] for k in ("embedder", "min_similarity", "neighborhood", "k", "min_agree") if k in section}
    try:
        policy = MatchPolicy(**{k: type(getattr(MatchPolicy, k))(v) for k, v in fields.items()})
    except (TypeError, ValueError) as exc:
        raise ValueError(f"semantic: {exc}") from None
    if not (0 < policy.min_similarity <= 1 and 0 < policy.neighborhood <= 1 and policy.k >= policy.min_agree >= 1):
        raise ValueError("semantic: need 0 < min_similarity, neighborhood <= 1 and k >= min_agree >= 1")
    return policy
