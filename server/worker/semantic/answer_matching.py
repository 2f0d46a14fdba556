"""Semantic answers of generative models in a worker (server/shared/answer_match.py says when one is
right): a request's question is embedded and searched in its namespace's index; the judge's class scores
stored with the nearest cached questions decide, under the model's calibrated threshold and the guards,
whether one of their answers may answer it; then the judge runs on the question (a head on the
embedding: a matrix product), and its scores against the cached question's, under the judge's label
calibration (server/worker/semantic/label_calibration.py), decide whether it does (RESULT_SEMANTIC, with the
similarity, the answer's age and the verdict so far). On a miss the judge's scores of the question are
an outcome for the calibration where the rule had an opinion, and, once the model's answer is generated
and stored, the question's entry: the judge's response for it (its class scores, the guard marks, and
the key of the answer as CacheInfo.key) under the question's key, indexed by its embedding.

It reuses the classifier tier whole: the index and the judge's interpolated scores and fit
(server/worker/semantic/semantic_index.py), the threshold and guard of server/worker/semantic/calibration.py (one
Calibration per generative model version, saved with the others), and shadow verification
(server/worker/semantic/shadow.py): a share of hits, and every hit of an unproven entry, has the judge run on the
question while the worker is idle; a disagreement contests the entry, which answers no more.
A model whose judge is answer equivalence (`semantic.answer_cosine`) is matched by
server/worker/semantic/answer_equivalence.py instead, with the same calibration and shadow verifier.
Any failure is a miss. A caller that goes away during the lookup (a millisecond or two) is not heard
of until its generation starts: that generation runs for nobody and is stored. Event loop only."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from cachestore.keys import NS_ID_BYTES
from cachestore.results import now_us
from cachestore.semantic_log import SemanticEntry
from infercache.v1 import infercache_pb2 as pb
from infercache.v1 import worker_pb2
from server.shared import question_guards as guards
from server.shared.answer_match import AnswerMatchPolicy
from server.shared.generated import marked
from server.worker.semantic import question_entries
from server.worker.semantic.answer_equivalence import AnswerEquivalence
from server.worker.semantic.calibration import Calibration, learn
from server.worker.flights import token_ids
from server.worker.semantic.heads import HeadRuntime
from server.worker.semantic.shadow import Check

log = logging.getLogger("infercache.answers")

Source = pb.CacheInfo.Source
Verdict = pb.CacheInfo.Verdict


@dataclass
class Companion:
    """What a missed question adds beside its generated answer once that is stored."""

    key: bytes               # the question's key
    payload: bytes           # the judge's serialized response for it (scores, marks, the answer's key)
    entry: SemanticEntry     # its row in the namespace's index
    awaits_answer: ClassVar[bool] = False  # (answer equivalence's needs the answer first: answer_equivalence.py)


@dataclass
class Lookup:
    answer: bytes | None = None        # a semantic hit: the whole answer, marked
    companion: Companion | None = None  # (or answer_equivalence.py's AwaitingAnswer)


class AnswerMatching:
    def __init__(self, core) -> None:
        self.core = core  # server/worker/core.py WorkerCore: its semantic tier, cache, runtimes, matching
        self._refused: set[tuple[str, str]] = set()  # (model, version) whose judge cannot run here (logged once)
        self._told: set[tuple[str, str]] = set()     # ... whose judge's label calibration is missing or empty (logged once)
        self.equivalence = AnswerEquivalence(core, self)

    def enabled(self, spec) -> bool:
        return spec.answer_match is not None and self.core.semantic is not None and self.core.cache is not None

    async def lookup(self, runtime, item: worker_pb2.ComputeItem, deadline: float | None) -> Lookup:
        """A semantic hit for a generation item with a question (one that a cached answer may answer), or
        what its miss stores."""
        policy: AnswerMatchPolicy = runtime.spec.answer_match
        if policy.by_answers:
            answer, awaiting = await self.equivalence.lookup(runtime, item, deadline)
            return Lookup(answer, awaiting)
        judge = self._judge(runtime, policy)
        if judge is None:
            return Lookup()
        core = self.core
        embedder = core.serving(policy.rule.embedder)
        embedding = (await embedder.batcher.submit(token_ids(item.embed_ids), deadline))["embedding"]
        ns_id = item.question_key[:NS_ID_BYTES]
        rule = policy.rule
        neighbors, assessment = [], None
        if item.cached_ok:  # (BYPASS: a fresh answer, indexed all the same)
            neighbors, assessment = await core.semantic.search(ns_id, embedding, rule.k, judge.labels)
        calibration = self.calibration(runtime, policy)
        marks = guards.decode(item.question_marks)
        feature = self._feature(judge, embedding)
        outputs = None  # the judge's scores of the question, once computed
        if assessment is not None:
            chosen = rule.decide(neighbors, assessment, calibration)
            if chosen is not None and core.matching.shadow.contested(chosen.key):
                chosen = None
            if chosen is not None:
                hit = self._answer(item, neighbors, assessment.answer, marks)
                if hit is None:
                    core.counters["answer_guarded"] += 1
                else:
                    answer, entry, cached_scores = hit
                    outputs = await judge.batcher.submit(feature, deadline)
                    if self._same_label(runtime, judge, outputs["scores"], cached_scores):
                        self._verify(runtime, calibration, judge, item, embedding, assessment, entry)
                        core.counters["answer_semantic_hits"] += 1
                        return Lookup(answer=answer)
                    core.counters["answer_label_refused"] += 1
        # A miss: the judge's own label of the question (an outcome where the rule had an opinion), and
        # the question's entry once its answer is stored.
        if outputs is None:
            outputs = await judge.batcher.submit(feature, deadline)
        response = judge.response(outputs, item.question_key)
        label = response.classification.label
        if assessment is not None:
            learn(calibration, neighbors, assessment, label)
        response.cache.key = item.key.hex()  # the answer's entry
        question_entries.add_marks(response, item.question_marks)
        return Lookup(companion=Companion(item.question_key, response.SerializeToString(),
                                          SemanticEntry(ns_id, label, embedding)))

    async def answered(self, runtime, companion, answer: bytes, put) -> None:
        """A missed question's answer is generated: what it settles of a companion that awaits it (answer
        equivalence: answer_equivalence.py). `put(key, payload, semantic entry)` stores (None: nothing)."""
        await self.equivalence.answered(runtime, companion, answer, put)

    def calibration(self, runtime, policy: AnswerMatchPolicy) -> Calibration:
        key = (runtime.spec.name, runtime.version)
        calibrations = self.core.matching.calibrations
        if (found := calibrations.get(key)) is None:
            found = calibrations[key] = Calibration.under(policy.rule, self.settings(policy))
        return found

    def settings(self, policy: AnswerMatchPolicy) -> str:
        repository = self.core.repository
        embedder_version = repository.get(policy.rule.embedder).serving_version
        if policy.by_answers:
            return policy.settings(embedder_version)
        return policy.settings(embedder_version, repository.get(policy.judge).serving_version)

    def _judge(self, runtime, policy: AnswerMatchPolicy) -> HeadRuntime | None:
        """The judge's runtime: a head served here that reads the embedder's embedding (None otherwise)."""
        try:
            judge = self.core.serving(policy.judge)
            embedder = self.core.serving(policy.rule.embedder)
        except Exception:  # noqa: BLE001 (not served here: exact answers only)
            judge = embedder = None
        if isinstance(judge, HeadRuntime) and judge.reads(embedder, "embedding"):
            return judge
        if (runtime.spec.name, runtime.version) not in self._refused:
            self._refused.add((runtime.spec.name, runtime.version))
            log.error("%s: no semantic answers: its judge %r is not a served head on %r's embedding",
                      runtime.spec.name, policy.judge, policy.rule.embedder)
        return None

    def _same_label(self, runtime, judge: HeadRuntime, query: np.ndarray, cached: np.ndarray | None) -> bool:
        """Whether the query and the cached question share a label with the probability that the judge's
        label calibration asks for at the model's max_error (server/worker/semantic/label_calibration.py). A judge
        without one is taken at its word (its own verdicts bound the error); one whose calibration does not
        read, or reaches no threshold, answers nothing."""
        max_error = runtime.spec.answer_match.rule.max_error
        calibration = judge.label_calibration
        if judge.label_refused:
            self._once(runtime, logging.ERROR, "%s: no semantic answers: its judge's label calibration does not "
                       "read (%s)", runtime.spec.name, judge.label_refused)
            return False
        if calibration is None:
            self._once(runtime, logging.WARNING, "%s: its judge %s/%s has no label calibration: max_error bounds how "
                       "often the judge labels two questions apart, not how often they differ in truth; train the "
                       "judge again with train-head to bound that", runtime.spec.name, judge.spec.name, judge.version)
            return True
        if not calibration.threshold(max_error) <= 1:
            self._once(runtime, logging.ERROR, "%s: its judge %s/%s's labelled pairs bound no same-label threshold "
                       "at max_error %s: no semantic answers", runtime.spec.name, judge.spec.name, judge.version,
                       max_error)
            return False
        if cached is None or cached.shape != query.shape:
            return False
        return calibration.admits(query, cached, max_error)

    def _once(self, runtime, level: int, message: str, *args) -> None:
        if (runtime.spec.name, runtime.version) not in self._told:
            self._told.add((runtime.spec.name, runtime.version))
            log.log(level, message, *args)

    def _feature(self, judge: HeadRuntime, embedding: np.ndarray) -> np.ndarray:
        features = self.core.features
        stored = features.stored_form(judge.source, embedding) if features is not None else None
        return embedding if stored is None else stored

    def _answer(self, item: worker_pb2.ComputeItem, neighbors, label: str, marks: tuple[str, ...]
                ) -> tuple[bytes, bytes, np.ndarray | None] | None:
        """The nearest neighbour holding `label` whose question's guard marks are the query's, and whose
        answer is fresh: (the answer marked RESULT_SEMANTIC, the neighbour's key, the judge's scores of
        its question)."""
        cache = self.core.cache
        now = now_us()
        max_age = item.max_age_us if item.HasField("max_age_us") else None
        for neighbor in neighbors:
            if neighbor.answer != label or self.core.matching.shadow.contested(neighbor.key):
                continue  # (a contested entry answers no more, whichever neighbour it is)
            entry = question_entries.read(cache, neighbor.key, now, max_age)
            if entry is None or not guards.same(marks, entry.marks):
                continue  # (a negation, number, date or entity apart: never this one's answer)
            verdict = Verdict.VERIFIED if self.core.matching.shadow.proven(neighbor.key) else Verdict.ESTIMATED
            age = entry.answer.age_s(now)
            return (marked(entry.answer.payload, Source.RESULT_SEMANTIC, age, neighbor.similarity, verdict), neighbor.key,
                    _scores(entry))
        return None

    def _verify(self, runtime, calibration: Calibration, judge: HeadRuntime, item: worker_pb2.ComputeItem,
                embedding: np.ndarray, assessment, entry: bytes) -> None:
        """Offers the hit for shadow verification: the judge runs on the question when the worker is idle
        (always while the entry is unproven, else at verify_fraction)."""
        shadow = self.core.matching.shadow
        chance = shadow.drawn(entry, runtime.spec.answer_match.rule.verify_fraction)
        if chance is None:
            return
        checked = worker_pb2.ComputeItem(key=item.question_key, tenant=item.tenant, model=judge.spec.name,
                                         version=judge.version, store=False)  # the check stores nothing
        shadow.offer(Check(judge, calibration, checked, self._feature(judge, embedding), embedding, assessment.answer,
                           assessment.margin, entry, chance, now_us(), assessment.fitted is not None,
                           assessment.residual))


def _scores(entry: question_entries.QuestionEntry) -> np.ndarray | None:
    """The judge's class scores stored with a cached question (None: none that read)."""
    tensor = entry.outputs.get("scores")
    try:
        values = np.frombuffer(tensor.data, dtype=np.dtype(tensor.dtype)).astype(np.float32) if tensor is not None else None
    except (TypeError, ValueError):
        return None
    return values if values is not None and values.ndim == 1 and np.all(np.isfinite(values)) else None
