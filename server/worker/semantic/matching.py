"""Head models' and semantic models' misses in a worker: a head's features from the feature tier (L2)
or its encoder (which runs once: its output is also the semantic embedding when the encoder is the
embedder), then a near-duplicate's answer if the model's policy trusts one, else the model. Under the
calibrated rule it records what each computed answer teaches the calibration, offers hits for shadow
verification, and stores what a check computed. State it reads (stores, index, counters) is the worker
core's (server/worker/core.py); the calibrations and the shadow checks are its own. Event loop only."""

from __future__ import annotations

from cachestore.keys import NS_ID_BYTES, namespace
from cachestore.results import now_us
from cachestore.semantic_log import SemanticEntry
from infercache.v1 import infercache_pb2 as pb
from infercache.v1 import worker_pb2
from server.shared.answers import answer_record
from server.shared.errors import ModelNotFound
from server.shared.feature_records import feature_namespace
from server.shared.match_policy import Assessment, CalibratedPolicy, Neighbor
from server.worker.semantic.calibration import Calibration, learn
from server.worker.flights import Outcome, Source, token_ids
from server.worker.semantic.heads import HeadRuntime
from server.worker.model_runtime import ModelRuntime
from server.worker.semantic.shadow import Check, ShadowVerifier


class Matching:
    def __init__(self, core) -> None:
        self.core = core  # server/worker/core.py WorkerCore
        # The calibrated semantic rule: outcomes per model version, and the hits' background checks.
        self.calibrations: dict[tuple[str, str], Calibration] = {}
        self.shadow = ShadowVerifier(self._checked, core.batchers) if core.semantic is not None else None

    async def answer(self, runtime: ModelRuntime, item: worker_pb2.ComputeItem, deadline: float | None) -> Outcome:
        """A head model's or a semantic model's miss: the head's features from L2 or the encoder (which
        runs once: its output is also the semantic embedding when the encoder is the embedder), then a
        near-duplicate's answer if the policy trusts one, else the model."""
        feature = embedding = None
        policy = runtime.spec.semantic if self.core.semantic is not None else None
        if isinstance(runtime, HeadRuntime):
            started = now_us()
            source = runtime.source
            ns = feature_namespace(item.tenant, runtime.spec.share_features, source)
            key = item.feature_key  # derived by the frontend; empty would mean no feature tier for this item
            if key and item.cached_ok and (found := self.core.features.get(ns, source, key)) is not None:
                feature, level = found
                self.core.counters[f"{level}_hits"] += 1
                try:
                    outputs = await runtime.batcher.submit(feature, deadline)
                finally:
                    self.core.features.release(feature)
                # Not indexed for semantic matching: when the encoder is the embedder, a near-duplicate
                # runs it anyway to search, so a semantic hit would save only the head; indexing every
                # answer of a version bump doubled its cost (bench/l2.py: 3.8 s vs 1.7 s for 9,972 texts).
                return Outcome(runtime.payload(outputs, item.key), Source.FEATURE)
            embedding = (await runtime.encoder_runtime.batcher.submit(token_ids(item.ids), deadline))[source[2]]
            feature = self.core.features.stored_form(source, embedding)
            if feature is None:  # out of the stored form's range: the head reads it as computed, not kept
                feature = embedding
            elif item.store and key:
                self.core.features.put(ns, source, key, feature, started)
        neighbors: list[Neighbor] = []
        assessment: Assessment | None = None
        rejected = False  # neighbours found, none the policy trusts (/metrics miss reason)
        if policy is not None:
            overrides = item.semantic
            lookup = not overrides.HasField("enabled") or overrides.enabled
            embedder = self._embedder(policy)
            if embedding is None or item.embed_ids or not runtime.reads(embedder, "embedding"):
                embedding = None
                if lookup or item.store:  # a stored result is indexed even when its request does not search
                    ids = token_ids(item.embed_ids or item.ids)
                    embedding = (await embedder.batcher.submit(ids, deadline))["embedding"]
            if embedding is not None and lookup:
                k, labels = (policy.k, runtime.labels) if policy.calibrated else (max(policy.k, 5), None)
                neighbors, assessment = await self.core.semantic.search(item.key[:NS_ID_BYTES], embedding, k, labels)
                if neighbors and self.core.metrics is not None:
                    self.core.metrics.observe(("infercache_semantic_nearest_similarity", runtime.spec.name),
                                         neighbors[0].similarity)
                floor = overrides.min_similarity if overrides.HasField("min_similarity") else None
                if item.cached_ok:
                    if policy.calibrated:
                        calibration = self._calibration(runtime)
                        chosen = policy.decide(neighbors, assessment, calibration, floor)
                        if chosen is not None and self.shadow.contested(chosen.key):
                            chosen = None  # a check found this entry answering wrongly: it answers no more
                    else:
                        chosen = policy.decide(neighbors, floor)
                    if chosen is not None and (matched := self._matched(chosen, item, neighbors)) is not None:
                        if policy.calibrated:
                            self._verify(runtime, calibration, item, feature, embedding, chosen, assessment)
                        return matched
                    rejected = bool(neighbors) and chosen is None
        outputs = await runtime.batcher.submit(token_ids(item.ids) if feature is None else feature, deadline)
        if policy is None:
            return Outcome(runtime.payload(outputs, item.key))
        response = runtime.response(outputs, item.key)
        if assessment is not None:  # what the rule would have said
            learn(self._calibration(runtime), neighbors, assessment, response.classification.label)
        stored = response.SerializeToString()
        payload = stored
        if self._explain(response, item, neighbors):
            payload = response.SerializeToString()
        return Outcome(payload, stored=stored, embedding=embedding, label=response.classification.label,
                        rejected=rejected)

    def calibrated_versions(self) -> dict[tuple[str, str], tuple[CalibratedPolicy, str]]:
        """(model, version) -> (the calibrated rule, its settings) of each version under it, generative
        models' semantic answers among them."""
        versions = {key: (runtime.spec.semantic, self._rule(runtime)) for key, runtime in self.core.runtimes.items()
                    if runtime.spec.semantic is not None and runtime.spec.semantic.calibrated}
        generations = self.core.generations
        for key, runtime in (generations.runtimes.items() if generations is not None else ()):
            if (policy := runtime.spec.answer_match) is not None:  # semantic answers (server/worker/semantic/answer_matching.py)
                try:
                    versions[key] = (policy.rule, generations.answers.settings(policy))
                except ModelNotFound:  # its judge or embedder is not in the repository (logged where it is used)
                    continue
        return versions

    def _rule(self, runtime: ModelRuntime) -> str:
        policy = runtime.spec.semantic
        return policy.settings(self.core.repository.get(policy.embedder).serving_version)

    def _calibration(self, runtime: ModelRuntime) -> Calibration:
        key = (runtime.spec.name, runtime.version)
        if (calibration := self.calibrations.get(key)) is None:
            calibration = self.calibrations[key] = Calibration.under(runtime.spec.semantic, self._rule(runtime))
        return calibration

    def _verify(self, runtime: ModelRuntime, calibration: Calibration, item: worker_pb2.ComputeItem, feature,
                embedding, chosen: Neighbor, assessment: Assessment) -> None:
        """Offers a semantic hit for shadow verification: always while its entry is unproven, else at
        the model's verify_fraction."""
        chance = self.shadow.drawn(chosen.key, runtime.spec.semantic.verify_fraction)
        if chance is None:
            return
        model_input = token_ids(item.ids) if feature is None else feature
        self.shadow.offer(Check(runtime, calibration, item, model_input, embedding, chosen.answer,
                                assessment.margin, chosen.key, chance, now_us(), assessment.fitted is not None,
                                assessment.residual))

    def _checked(self, check: Check, outputs: dict, agreed: bool) -> None:
        """A verified hit: the model's answer replaces the alias the hit wrote (when its request stored
        one) and joins the index, so the same text gets the model's own answer, and its neighbours one
        more verified entry (a wrong hit's correction among them)."""
        item = check.item
        if not item.store or self.core.writer is None:
            return
        runtime = check.runtime
        response = runtime.response(outputs, item.key)
        # Dated at the hit, not now: an invalidation since then covers it (the writer's fences drop it).
        record = answer_record(runtime.spec, check.created_us, response.SerializeToString(), item.ttl_class)
        self.core.writer.put(item.key, namespace(item.tenant, item.model, item.version), record,
                             semantic=SemanticEntry(item.key[:NS_ID_BYTES], response.classification.label,
                                                    check.embedding), ttl_class=item.ttl_class)
        self.core.counters["semantic_verified_stored" if agreed else "semantic_corrected"] += 1

    def _embedder(self, policy) -> ModelRuntime:
        return self.core.serving(policy.embedder)

    def _matched(self, chosen: Neighbor, item: worker_pb2.ComputeItem, neighbors: list[Neighbor]) -> Outcome | None:
        """The chosen neighbour's entry as a RESULT_SEMANTIC answer, if it is still fresh."""
        max_age = item.max_age_us if item.HasField("max_age_us") else None
        found = self.core.cache.answer(chosen.key, max_age, Source.RESULT_SEMANTIC) if self.core.cache is not None else None
        if found is None:
            return None  # expired or gone since it was indexed: compute instead
        record, response = found
        response.cache.similarity = chosen.similarity
        self._explain(response, item, neighbors)
        return Outcome(response.SerializeToString(), Source.RESULT_SEMANTIC, matched=record)

    @staticmethod
    def _explain(response: pb.InferResponse, item: worker_pb2.ComputeItem, neighbors: list[Neighbor]) -> bool:
        if not item.semantic.explain:
            return False
        response.cache.neighbors.extend(pb.Neighbor(similarity=n.similarity, answer=n.answer) for n in neighbors)
        return True
