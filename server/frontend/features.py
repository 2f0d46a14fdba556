"""FEATURE answers made in a frontend: a head model's text that L1 missed, whose encoder output the
host's LMDB feature store holds (server/worker/store/features.py), is answered here, without the worker and without
tokenizing (features are keyed by the normalized text). The head is one matrix product and a softmax
(server/shared/head_scoring.py), so such an answer costs a frontend little more than an exact hit, where a round trip
to the worker costs several times that (bench/l2.py: a head version bump).

The answer is the worker's for the same stored feature (the same stored form, head and response; the
worker may run the head in torch on a GPU, so the scores can differ in the last bits). A text's second
FEATURE answer here, while the doorkeeper still holds its key (DOORKEEPER keys, cleared when full), is
also copied into L1, and into the fleet tier where there is one, through the key's worker (frontends
never write a store): a repeated text becomes an exact hit, while a one-off (a version bump's sweep over
every text, the long tail) costs no L1 write, which would cost more than answering it again. What is not
in the store yet (written behind), what does not decode, and heads over `l2.frontend_head_mb` go to the
worker as before: its memory level, then the store, then the encoder.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cachestore import records
from cachestore.errors import CorruptRecord
from cachestore.results import now_us
from server.config import Config, feature_store_settings
from server.shared.feature_records import Source, decode, feature_key as stored_feature_key, feature_namespace
from server.shared.head_scoring import head_scores, load_head
from server.shared.answers import Answers, answer_record
from server.shared.models import HeadRef, ModelConfigError, ModelRepository, ModelSpec
from server.frontend.read_cache import ReadCache

DOORKEEPER = 65536  # keys of recent FEATURE answers kept to copy a text's second one into L1


def feature_key(spec: ModelSpec, source: Source, tenant: str, normalized: str) -> bytes:
    """The feature tier's key of the encoder output `source` for a head model's text."""
    return stored_feature_key(feature_namespace(tenant, spec.share_features, source), source, normalized)


@dataclass(frozen=True, slots=True)
class FrontHead:
    """What a frontend needs to answer one head model version from a stored feature."""

    weight: np.ndarray
    bias: np.ndarray
    answers: Answers  # its serialized answers (its spec, version and labels)

    @classmethod
    def load(cls, repository: ModelRepository, spec: ModelSpec, version: str, ref: HeadRef, max_bytes: int
             ) -> FrontHead | None:
        """The head `ref` of a version, checked as the workers check its files (head_scoring.load_head; the
        feature length only when a feature is read: one of another length does not decode), or None when
        its weights are over max_bytes (left to the workers). ModelConfigError for a head they refuse too."""
        encoder = repository.models.get(ref.encoder)
        if encoder is None:
            raise ModelConfigError(f"its encoder {ref.encoder} is not in the repository")
        weight, bias, labels = load_head(spec, version, ref, encoder)
        if weight.nbytes + bias.nbytes > max_bytes:
            return None
        return cls(weight, bias, Answers(spec, version, labels))


class FeatureAnswers:
    """A frontend's reader of the host's feature store and the answers it makes from it. Used on the
    frontend's event loop only (its counters have that one writer)."""

    def __init__(self, config: Config, counters) -> None:
        self.max_head_bytes = config.l2.frontend_head_mb << 20
        self._store = ReadCache(feature_store_settings(config), "feature store")
        self.counters = counters  # the frontend's own
        self._answered: dict[bytes, None] = {}  # the doorkeeper: keys answered once (cleared when full)

    def answers(self, head: FrontHead, keyed: list[tuple[bytes, bytes]], store: bool, ttl_class: str = "") -> list:
        """For each (result key, feature key): (the serialized InferResponse, its record to copy into L1
        or None; stored for TTL class `ttl_class`) made from the stored feature, or None where the store
        does not hold it. One matrix product for all that it holds."""
        out: list = [None] * len(keyed)
        cache = self._store.get()
        if cache is None:
            return out
        now = now_us()
        found, vectors = [], []
        for n, (_, feature) in enumerate(keyed):
            record = cache.get(feature, now)
            if record is None:
                continue
            try:
                vectors.append(decode(record.payload, head.weight.shape[0]))
            except CorruptRecord:
                self.counters["features_unreadable"] += 1  # the worker finds it so too, and computes
                continue
            found.append(n)
        if not found:
            return out
        scores = head_scores(vectors[0][None] if len(vectors) == 1 else np.stack(vectors), head.weight, head.bias)
        for n, row in zip(found, scores):
            key = keyed[n][0]
            payload = head.answers.payload({"scores": row}, key)
            out[n] = payload, self._copied(head, key, payload, now, ttl_class) if store else None
        self.counters["feature_answers"] += len(found)
        return out

    def _copied(self, head: FrontHead, key: bytes, payload: bytes, now: int, ttl_class: str) -> bytes | None:
        """The record of a text's second answer (the doorkeeper held its key), to copy into L1; None
        for a first one, whose key it now holds."""
        if key not in self._answered:
            if len(self._answered) >= DOORKEEPER:
                self._answered.clear()
            self._answered[key] = None
            return None
        del self._answered[key]
        self.counters["feature_copies"] += 1
        return records.encode(answer_record(head.answers.spec, now, payload, ttl_class))

    def stats(self) -> dict:
        return dict(self._store.cache.counters) if self._store.cache is not None else {}
