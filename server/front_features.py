"""FEATURE answers made in a frontend: a head model's text that L1 missed, whose encoder output the
host's LMDB feature store holds (server/features.py), is answered here, without the worker and without
tokenizing (features are keyed by the normalized text). The head is one matrix product and a softmax
(server/heads.py), so such an answer costs a frontend little more than an exact hit, where a round trip
to the worker costs several times that (bench/l2.py: a head version bump).

The answer is the one the worker would give from the same stored feature (the same stored form, the same
head, the same response). A text's second FEATURE answer here (among this frontend's last DOORKEEPER
answers) is also copied into L1 through the key's worker, as fleet hits are (frontends never write a
store): a repeated text becomes an exact hit, while a one-off (a version bump's sweep over every text,
the long tail) costs no L1 write, which would cost more than answering it again. What is not in the store
yet (written behind), what does not decode, and heads over `l2.frontend_head_mb` go to the worker as
before: its memory level, then the store, then the encoder.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from cachestore import records
from cachestore.errors import CorruptRecord
from cachestore.keys import namespace
from cachestore.results import now_us
from server.config import Config, feature_store_settings
from server.features import FeatureTier, Source, decode, feature_tenant
from server.heads import head_scores, read_weights
from server.model_runtime import answer_record, response_of
from server.models import LABELS_FILE, HeadRef, ModelConfigError, ModelSpec
from server.read_cache import ReadCache


DOORKEEPER = 65536  # keys of recent FEATURE answers kept to copy a text's second one into L1


def feature_key(spec: ModelSpec, source: Source, tenant: str, normalized: str) -> bytes:
    """The feature tier's key of the encoder output `source` for a head model's text."""
    return FeatureTier.key(namespace(feature_tenant(tenant, spec.share_features), *source[:2]), source, normalized)


@dataclass(frozen=True, slots=True)
class FrontHead:
    """What a frontend needs to answer one head model version from a stored feature."""

    spec: ModelSpec
    version: str
    weight: np.ndarray
    bias: np.ndarray
    labels: list[str]

    @classmethod
    def load(cls, spec: ModelSpec, version: str, ref: HeadRef, max_bytes: int) -> FrontHead | None:
        """The head `ref` of a version, or None when its weights are over max_bytes (left to the worker).
        A head whose files do not load raises ModelConfigError (the worker refuses it too)."""
        directory = spec.version_dir(version)
        weight, bias = read_weights(directory)
        if weight.nbytes + bias.nbytes > max_bytes:
            return None
        labels = []
        if spec.task == "classification":
            try:
                labels = json.loads((directory / LABELS_FILE).read_text())
            except (OSError, ValueError) as exc:
                raise ModelConfigError(f"{directory / LABELS_FILE}: {exc}") from None
        return cls(spec, version, weight, bias, labels)


class FeatureAnswers:
    """A frontend's reader of the host's feature store and the answers it makes from it. Used on the
    frontend's event loop only (its counters have that one writer)."""

    def __init__(self, config: Config, counters) -> None:
        self.max_head_bytes = config.l2.frontend_head_mb << 20
        self._store = ReadCache(feature_store_settings(config), "feature store")
        self.counters = counters  # the frontend's own
        self._answered: dict[bytes, None] = {}  # the doorkeeper: keys answered once (cleared when full)

    def answer(self, head: FrontHead, key: bytes, feature: bytes, store: bool) -> tuple[bytes, bytes | None] | None:
        """(the serialized InferResponse of the result key `key`, its record to copy into L1 or None) from
        the stored feature `feature` (feature_key), or None when the store does not hold it."""
        cache = self._store.get()
        if cache is None:
            return None
        now = now_us()
        record = cache.get(feature, now)
        if record is None:
            return None
        try:
            feature = decode(record.payload, head.weight.shape[0])
        except CorruptRecord:
            self.counters["features_unreadable"] += 1  # the worker finds it so too, and computes
            return None
        scores = head_scores(feature[None, :], head.weight, head.bias)[0]
        payload = response_of(head.spec, head.version, head.labels, {"scores": scores}, key).SerializeToString()
        self.counters["feature_answers"] += 1
        if not store:
            return payload, None
        if key not in self._answered:
            if len(self._answered) >= DOORKEEPER:
                self._answered.clear()
            self._answered[key] = None
            return payload, None
        del self._answered[key]
        self.counters["feature_copies"] += 1
        return payload, records.encode(answer_record(head.spec, now, payload))

    def stats(self) -> dict:
        return dict(self._store.cache.counters) if self._store.cache is not None else {}

