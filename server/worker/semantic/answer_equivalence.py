"""Semantic answers judged by answer equivalence (`semantic.answer_cosine`, server/shared/answer_match.py):
a cached answer answers a new question when the model's own answer to it, embedded by the embedder, lies
within the configured cosine of the cached answer's embedding.

- **Entries**: a missed question's entry is stored once its answer is generated and embedded: the
  question's guard marks, the answer's embedding, and the answer's key (CacheInfo.key), under the
  question's key, indexed by the question's embedding.
- **The rule**: the candidate is the nearest cached question (of the `k` nearest) that no check
  contested, whose answer is fresh and whose guard marks are the query's; it answers when its
  similarity's margin (answer_match.margin) reaches the threshold the calibration learnt for `max_error`.
  With no outcomes there is no threshold, so a question unlike anything verified is never answered.
- **Outcomes**: a miss generates the answer anyway; where the rule had a candidate, the fresh answer's
  embedding against the candidate's answer's is an outcome at the candidate's margin (the calibration
  learns the similarity at which answers stay alike). A share of the hits (every hit of an unproven
  entry) is regenerated while the worker is idle (server/worker/semantic/regeneration.py, through the shadow
  verifier of server/worker/semantic/shadow.py): an agreement proves the entry, a disagreement contests it (it
  answers no more), and either counts in the calibration (live fidelity, its guard).
- **Guards overruled**: the nearest entry the rule would have taken but whose marks differ from the
  query's (a negation, number, date or entity apart) is a miss; the model's fresh answer then says whether
  the difference mattered for that entry. An agreement proves the pair (the entry, the query's marks), so
  later questions with exactly those marks may take that entry's answer (hits of it are checked like any,
  and a disagreement ends it); a disagreement contests the pair. Only this judge overrules a guard: it
  reads the model's answer to the guarded question itself, where a classifier's label cannot see the
  number or the name that the guard saw.

Any failure is a miss (an answer not embedded: no outcome, no entry). Event loop only; the embedding runs
on the embedder's batcher as background work (its callers have their answer already): within the share of
its queue that shadow checks keep to, and skipped past it (`answer_embed_skipped`), so that foreground
embeddings are never refused for it."""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from functools import partial
from typing import ClassVar

import numpy as np

from cachestore.keys import NS_ID_BYTES
from cachestore.results import now_us
from cachestore.semantic_log import SemanticEntry
from infercache.v1 import infercache_pb2 as pb
from infercache.v1 import worker_pb2
from server.shared import question_guards as guards
from server.shared.answer_match import AnswerMatchPolicy, margin
from server.shared.generated import marked
from server.worker.semantic import question_entries
from server.worker.semantic.calibration import Calibration
from server.worker.flights import token_ids
from server.worker.semantic.regeneration import Regeneration, RegenerationLane
from server.worker.semantic.shadow import Check, has_room

log = logging.getLogger("infercache.answers")

Source = pb.CacheInfo.Source
Verdict = pb.CacheInfo.Verdict
ANSWER_EMBEDDING = "answer_embedding"  # a question entry's tensor of its answer's embedding (float32)
ENTRY_LABEL = "answer"                 # every entry's label in the index (no classes)


@dataclass
class Candidate:
    key: bytes                   # the cached question's entry
    verdict: bytes               # what a verification proves or contests: the entry, or a guarded pair's id
    similarity: float
    answer: bytes                # the cached answer (server/shared/generated.py)
    age_s: float
    answer_embedding: np.ndarray


@dataclass
class AwaitingAnswer:
    """A missed question: what its generated answer settles (a Companion of answer_matching.py's kind)."""

    key: bytes                   # the question's key
    answer_key: bytes
    ns_id: bytes
    embedding: np.ndarray        # the question's
    marks: str
    calibration: Calibration
    candidate: Candidate | None  # the rule's, below the threshold: an outcome
    guarded: Candidate | None    # one the rule would have taken but for the guards: the pair's verification
    awaits_answer: ClassVar[bool] = True


def alike(a: np.ndarray, b: np.ndarray, cosine: float) -> bool:
    a, b = np.asarray(a, dtype=np.float32).ravel(), np.asarray(b, dtype=np.float32).ravel()
    norms = float(np.linalg.norm(a) * np.linalg.norm(b))
    return a.shape == b.shape and norms > 0 and float(a @ b) / norms >= cosine


def pair_id(entry: bytes, marks: tuple[str, ...]) -> bytes:
    """A guarded pair's id (the entry and the query's marks) for the shadow verifier's proven and contested."""
    material = b"guarded\0" + entry + b"\0" + guards.encode(tuple(sorted(marks))).encode()
    return hashlib.blake2b(material, digest_size=len(entry) or 24).digest()


class AnswerEquivalence:
    def __init__(self, core, matching) -> None:
        self.core = core          # server/worker/core.py WorkerCore
        self.matching = matching  # its AnswerMatching (the calibrations)
        self._lanes: dict[tuple[str, str], RegenerationLane] = {}

    async def lookup(self, runtime, item: worker_pb2.ComputeItem, deadline: float | None
                     ) -> tuple[bytes | None, AwaitingAnswer | None]:
        """(the answer marked RESULT_SEMANTIC, None) for a hit, else (None, what its answer settles)."""
        core = self.core
        policy: AnswerMatchPolicy = runtime.spec.answer_match
        embedding = (await self._embedder(policy).batcher.submit(token_ids(item.embed_ids), deadline))["embedding"]
        ns_id = item.question_key[:NS_ID_BYTES]
        calibration = self.matching.calibration(runtime, policy)
        marks = guards.decode(item.question_marks)
        candidate = guarded = None
        if item.cached_ok:  # (BYPASS: a fresh answer, indexed all the same)
            neighbors, _ = await core.semantic.search(ns_id, embedding, policy.rule.k)
            candidate, guarded = self._candidates(item, neighbors, marks)
        threshold = calibration.threshold_for(False)
        if candidate is not None and margin(candidate.similarity) >= threshold:
            self._verify(runtime, policy, calibration, item, embedding, candidate)
            core.counters["answer_semantic_hits"] += 1
            core.counters["answer_guard_waived"] += candidate.verdict != candidate.key
            verdict = Verdict.VERIFIED if core.matching.shadow.proven(candidate.verdict) else Verdict.ESTIMATED
            return marked(candidate.answer, Source.RESULT_SEMANTIC, candidate.age_s, candidate.similarity,
                          verdict), None
        if guarded is not None and not margin(guarded.similarity) >= threshold:
            guarded = None  # the rule would not have taken it either: nothing to verify
        core.counters["answer_guarded"] += guarded is not None
        return None, AwaitingAnswer(item.question_key, item.key, ns_id, embedding, item.question_marks,
                                    calibration, candidate, guarded)

    async def answered(self, runtime, waiting: AwaitingAnswer, answer: bytes, put) -> None:
        """A missed question's answer: its embedding against the candidates' (an outcome, a guarded
        pair's verdict), then the question's entry (`put(key, payload, semantic entry)`, None: not stored)."""
        core = self.core
        policy: AnswerMatchPolicy = runtime.spec.answer_match
        if not has_room(self._embedder(policy).batcher):  # within the share background work may take
            core.counters["answer_embed_skipped"] += 1       # (no outcome, no entry: later questions miss)
            return
        try:
            fresh = await self.embed(policy, pb.GenerateResponse.FromString(answer).text)
        except Exception:  # noqa: BLE001 (no outcome, no entry: later questions miss)
            core.counters["answer_embed_errors"] += 1
            log.warning("%s: a generated answer was not embedded", runtime.spec.name, exc_info=True)
            return
        cosine = policy.answer_cosine
        if (candidate := waiting.candidate) is not None:
            waiting.calibration.record(margin(candidate.similarity), alike(fresh, candidate.answer_embedding, cosine))
        if (guarded := waiting.guarded) is not None:
            agreed = alike(fresh, guarded.answer_embedding, cosine)
            core.matching.shadow.judged(guarded.verdict, agreed)
            core.counters["answer_guard_agreed" if agreed else "answer_guard_disagreed"] += 1
        if put is None:
            return
        response = pb.InferResponse()
        response.cache.key = waiting.answer_key.hex()
        question_entries.add_marks(response, waiting.marks)
        vector = np.ascontiguousarray(fresh, dtype="<f4").ravel()
        response.outputs.add(name=ANSWER_EMBEDDING, dtype="float32", shape=[len(vector)], data=vector.tobytes())
        put(waiting.key, response.SerializeToString(), SemanticEntry(waiting.ns_id, ENTRY_LABEL, waiting.embedding))

    async def embed(self, policy: AnswerMatchPolicy, text: str) -> np.ndarray:
        """The embedder's embedding of an answer (low priority: no deadline, never refused for a wait)."""
        embedder = self._embedder(policy)
        ids = np.asarray(embedder.encoder.encode(text), dtype=np.int32)
        return (await embedder.batcher.enqueue(ids, None, waits=True))["embedding"]

    def _embedder(self, policy: AnswerMatchPolicy):
        return self.core.serving(policy.rule.embedder)

    def _candidates(self, item: worker_pb2.ComputeItem, neighbors, marks: tuple[str, ...]
                    ) -> tuple[Candidate | None, Candidate | None]:
        """The rule's candidate: the nearest uncontested neighbour with a fresh answer whose marks are the
        query's (or a pair proven alike); and the nearest guarded one before it."""
        cache, shadow = self.core.cache, self.core.matching.shadow
        now = now_us()
        max_age = item.max_age_us if item.HasField("max_age_us") else None
        guarded = None
        for neighbor in neighbors:
            if shadow.contested(neighbor.key):
                continue  # a check found it answering wrongly: it answers no more
            entry = question_entries.read(cache, neighbor.key, now, max_age)
            if entry is None or ANSWER_EMBEDDING not in entry.outputs:
                continue  # (an entry another judge wrote carries no answer embedding)
            embedding = np.frombuffer(entry.outputs[ANSWER_EMBEDDING].data, dtype="<f4")
            found = Candidate(neighbor.key, neighbor.key, neighbor.similarity, entry.answer.payload,
                              entry.answer.age_s(now), embedding)
            if not guards.same(marks, entry.marks):
                found.verdict = pair_id(neighbor.key, marks)
                if shadow.contested(found.verdict) or not shadow.proven(found.verdict):
                    guarded = guarded or found
                    continue
            return found, guarded
        return None, guarded

    def _verify(self, runtime, policy: AnswerMatchPolicy, calibration: Calibration, item: worker_pb2.ComputeItem,
                embedding: np.ndarray, candidate: Candidate) -> None:
        """Offers the hit for shadow regeneration (always while its entry or pair is unproven, else at
        verify_fraction)."""
        shadow = self.core.matching.shadow
        chance = shadow.drawn(candidate.verdict, policy.rule.verify_fraction)
        if chance is None:
            return
        again = worker_pb2.ComputeItem()
        again.CopyFrom(item)
        again.store = again.cached_ok = False  # (the check stores nothing)
        agrees = partial(_agrees, candidate.answer_embedding, policy.answer_cosine)
        shadow.offer(Check(self._lane(runtime, policy), calibration, again, Regeneration(again), embedding, "",
                           margin(candidate.similarity), candidate.verdict, chance, now_us(), agrees=agrees))

    def _lane(self, runtime, policy: AnswerMatchPolicy) -> RegenerationLane:
        key = (runtime.spec.name, runtime.version)
        if (lane := self._lanes.get(key)) is None:
            lane = self._lanes[key] = RegenerationLane(self.core.generations, partial(self.embed, policy))
        return lane


def _agrees(served: np.ndarray, cosine: float, outputs: dict) -> bool:
    return alike(outputs["embedding"], served, cosine)
