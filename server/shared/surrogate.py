"""A namespace's cache-wide fit of the model's scores over the embedding: the calibrated rule's second opinion.

Every cached entry of a classification model stores the model's scores for every class, not only for the
one it answers. So the entries together say how each class's score moves with the embedding, also for a
class that no entry answers (a topic the cache has never stored). This module fits one linear map from
the embedding to the model's centred log-scores, by ridge regression over every entry indexed in the
namespace, and answers with its first class at a query.

Why the rule needs it (match_policy.py): the neighbours' interpolation only knows the directions the
neighbours span. A query of a new topic beside a cached one leaves their hull toward the new topic, and
the interpolation, blind to that direction, answers the cached topic with confidence. The fit sees that
direction through the scores of every entry. For a model that is a linear head on the embedder (what
`train-head` makes) it is the model itself, up to rounding; for others it is an approximation. The rule
uses it only to refuse, and hits decided with it have a threshold of their own (server/worker/semantic/calibration.py).
It is consulted once the namespace holds more entries than the embedding has dimensions: before, the
ridge, not the entries, decides the directions they do not span (on 52 FAQ rows it refused mostly right
answers).

Observations are never taken out: an entry evicted or expired was still the model's answer for its
embedding (a namespace is one model version). A namespace whose index empties (an invalidation, or the
last entry's expiry or eviction) starts over. Memory: (dim + 1) x (dim + 1 + 2 x classes) doubles, about
1.7 MB for MiniLM and 77 classes. One owner: the semantic tier's thread.
"""

from __future__ import annotations

import numpy as np

FLOOR = 1e-12       # scores are clipped here before the log (match_policy.assess reads them through log_scores too)
RIDGE = 1e-3        # on the Gram matrix of unit vectors: bounds the map while entries are few
REFIT_GROWTH = 0.1  # the map is solved again (at a search: a few ms) once the entries grew by this share ...
REFIT_MIN = 16      # ... and by at least this many
FOLD_ROWS = 256     # entries added are summed this many at a time (or at a solve)


def log_scores(scores: np.ndarray) -> np.ndarray:
    """Log-scores, centred per row: the softmax's normalizer drops out, so a linear head's are linear."""
    logs = np.log(np.maximum(scores, FLOOR))
    return logs - logs.mean(axis=-1, keepdims=True)


class Surrogate:
    def __init__(self, dim: int, classes: int) -> None:
        self.classes = classes
        self.count = 0
        self._gram = np.zeros((dim + 1, dim + 1))      # sum of x x^T, x = [embedding, 1]
        self._cross = np.zeros((dim + 1, classes))     # sum of x log_scores^T
        self._pending: list[tuple[np.ndarray, np.ndarray]] = []  # added, not yet in the sums
        self._pending_rows = 0
        self._map: np.ndarray | None = None
        self._solved_at = 0

    def add(self, embeddings: np.ndarray, scores: np.ndarray) -> None:
        """Rows of embeddings (n x dim) with the model's scores for them (n x classes). Folded into the
        sums FOLD_ROWS at a time: one row's update touches all of the Gram matrix (1.2 MB for MiniLM,
        about 360 us), which an entry at a time would cost every miss."""
        self._pending.append((embeddings, scores))
        self._pending_rows += len(embeddings)
        self.count += len(embeddings)
        if self._pending_rows >= FOLD_ROWS:
            self._fold()

    @property
    def ready(self) -> bool:
        """More entries than dimensions: the map is the data's, not the ridge's."""
        return self.count >= len(self._gram)

    def answer(self, vector: np.ndarray) -> int:
        """The class the fit ranks first at `vector`."""
        if self._map is None or self.count >= self._solved_at + max(REFIT_MIN, int(self._solved_at * REFIT_GROWTH)):
            self._fold()
            self._map = np.linalg.solve(self._gram + RIDGE * np.eye(len(self._gram)), self._cross)
            self._solved_at = self.count
        return int(np.argmax(vector @ self._map[:-1] + self._map[-1]))

    def _fold(self) -> None:
        if not self._pending:
            return
        embeddings = np.vstack([e for e, _ in self._pending])
        x = np.hstack([embeddings, np.ones((len(embeddings), 1))])
        self._gram += x.T @ x
        self._cross += x.T @ log_scores(np.vstack([s for _, s in self._pending]))
        self._pending.clear()
        self._pending_rows = 0
