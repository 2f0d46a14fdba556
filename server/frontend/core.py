"""A frontend's answer path, transport-free: a call's texts are answered from L1, else from the fleet
tier, else (for a head this frontend runs) from a stored feature, else sent to their workers as token
ids and answered with what those computed. Answers stay serialized bytes throughout (cachestore/wire.py).
The calls' plans come from server/frontend/plan.py; /metrics bookkeeping goes to the call's tally
(server/frontend/tally.py)."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections import Counter
from typing import Container

import numpy as np

from cachestore import records, wire
from cachestore.results import ResultCache, now_us
from infercache.v1 import infercache_pb2 as pb
from server.config import Config, store_settings
from server.frontend.features import FeatureAnswers, feature_key
from server.frontend.generation import GenerateCalls
from server.frontend.hot_keys import HotKeys
from server.frontend.metrics import FEATURE, RESULT_EXACT, RESULT_FLEET, FrontendMetrics
from server.frontend.plan import Keyed, Plan, Planner
from server.frontend.prompts import Prompts
from server.frontend.read_cache import ReadCache
from server.frontend.tally import NO_TALLY
from server.frontend.workers import WorkerPool
from server.shared.errors import DeadlineExceeded, InvalidArgument, NotCached, Overloaded, WorkerUnavailable
from server.shared.models import ModelRepository

log = logging.getLogger("infercache.frontend")

Mode = pb.CachePolicy.Mode
# Read per call: as plain ints (an attribute of a protobuf enum wrapper costs about a microsecond).
BYPASS, ONLY_IF_CACHED = Mode.BYPASS, Mode.ONLY_IF_CACHED
TOKENIZE_INLINE_MAX = 32  # longer batches are tokenized in a thread, off the event loop
# Failures of a miss that a model's cache.stale_if_error_s answers with an expired entry: the model (its
# upstream, its workers) could not compute it in time. Not the caller's own errors, nor a full queue of its own.
STALE_IF = (WorkerUnavailable, DeadlineExceeded, Overloaded)


def _copy_item(item, *, model: str, version: str, tenant: str, key: bytes, raw: bytes, source: int,
               ttl_class: str) -> None:
    item.model, item.version, item.tenant, item.key, item.answered_record = model, version, tenant, key, raw
    item.answered_from, item.ttl_class = source, ttl_class


def _answer(result) -> bytes:
    """A worker's answer as sent: its serialized response marked with how it was answered."""
    return result.response + wire.cache_info(result.source)


class FrontendCore:
    """Transport-free request handling: plans, L1, the fleet tier, FEATURE answers, and sending misses."""

    def __init__(self, config: Config, repository: ModelRepository, workers: WorkerPool, counters: Counter,
                 fleet=None, metrics: FrontendMetrics | None = None, hot: HotKeys | None = None) -> None:
        self.config = config
        self.repository = repository
        self.workers = workers
        self.counters = counters  # the process's counters, written on its event loop only
        self.fleet = fleet        # server/fleet/tier.py FleetTier (lookups only), or None
        self.metrics = metrics    # /metrics figures (server/frontend/metrics.py), None when it is off
        self.hot = hot            # the hottest keys (server/frontend/hot_keys.py), None when server.hot_keys is 0
        self.hot_published = None  # () -> every frontend's published hot keys (set by the process)
        self._l1 = ReadCache(store_settings(config), "result cache")
        # FEATURE answers made here (server/frontend/features.py), where heads may run in frontends
        self.features = FeatureAnswers(config, counters) if config.l2.enabled and config.l2.frontend_head_mb else None
        self.planner = Planner(repository, counters, self.features.max_head_bytes if self.features else None)
        self.generation = GenerateCalls(Prompts(repository), self._l1, workers, counters, metrics)

    def prepare_models(self) -> None:
        """Tokenizers, heads and chat templates of every served version, made before the frontend listens."""
        self.planner.prepare_models()
        self.generation.prompts.prepare_models()

    def l1(self) -> ResultCache | None:
        """The result cache, opened on first use and re-tried while the store is unavailable."""
        return self._l1.get()

    @property
    def l1_cache(self) -> ResultCache | None:
        """The result cache if it is open now (no attempt to open it)."""
        return self._l1.cache

    def _hit(self, plan: Plan, keyed: Keyed) -> bytes | None:
        """The serialized answer of a fresh entry (stored bytes, never parsed), or None."""
        if plan.cached_ok and not keyed.private and (cache := self.l1()) is not None:
            answer = cache.lookup(keyed.key, plan.max_age_us)
            if answer is not None:
                self.counters["hit_exact"] += 1
                return answer
        return None

    def _why_missed(self, plan: Plan, private: bool) -> str:
        """Why _hit (just now) found no answer: a miss reason of /metrics."""
        if not plan.cached_ok:
            return "bypass" if plan.mode == BYPASS else "not_cacheable"  # (the class's TTL is 0)
        if private:
            return "no_store"
        if self._l1.cache is None:
            return "store_error"
        reason = self._l1.cache.missed_because
        if reason == "too_old" and plan.max_age_us >= plan.ttl_us:
            return "expired"  # the class's TTL cut it (shorter than the storing class's, or lowered)
        return reason

    def _seen(self, plan: Plan, one: Keyed) -> None:
        """A call's key into the hot-key sketch (its text and tenant where the model keeps them)."""
        if not one.private:
            served = plan.served
            if served.spec.hot_key_text:
                self.hot.add(served.spec.name, served.version, one.key, plan.tenant, one.text)
            else:
                self.hot.add(served.spec.name, served.version, one.key, "", "")

    async def _fleet_hit(self, plan: Plan, keyed: Keyed) -> bytes | None:
        """A fresh entry of the fleet tier as the answer, its copy sent to the key's worker for L1; or
        None (and the worker need not look again)."""
        if not plan.cached_ok or keyed.private:
            return None
        record = await self.fleet.get(keyed.key, plan.ns, plan.max_age_us,
                                      filtered=plan.mode != ONLY_IF_CACHED)
        if record is None:
            return None
        self.counters["hit_fleet"] += 1
        if plan.store:
            self._copy(plan, keyed.key, records.encode(record), RESULT_FLEET)
        return record.payload + wire.cache_info(pb.CacheInfo.RESULT_FLEET, record.age_s(now_us()))

    def _copy(self, plan: Plan, key: bytes, raw: bytes, source: int) -> None:
        """A record this frontend answered from (encoded, cachestore/records.py; `source`: how) to the
        key's worker, for L1."""
        served = plan.served
        self.workers.send(served.route(key), functools.partial(
            _copy_item, model=served.spec.name, version=served.version, tenant=plan.tenant, key=key, raw=raw,
            source=source, ttl_class=plan.ttl_class))

    def _feature_answers(self, plan: Plan, keyed: list[Keyed]) -> list[bytes | None]:
        """For each keyed text that L1 missed: a FEATURE answer made here from a stored feature (a
        repeated text's record sent on for L1), or None. Only for a head this frontend runs."""
        served = plan.served
        public = [n for n, one in enumerate(keyed) if not one.private]
        found = self.features.answers(served.head, [
            (keyed[n].key, feature_key(served.spec, served.feature_source, plan.tenant, keyed[n].text)) for n in public],
            plan.store, plan.ttl_class)
        answers: list[bytes | None] = [None] * len(keyed)
        for n, made in zip(public, found):
            if made is not None:
                payload, record = made
                if record is not None:
                    self._copy(plan, keyed[n].key, record, FEATURE)
                answers[n] = payload + wire.cache_info(FEATURE)
        return answers

    def _items(self, plan: Plan, keyed: list[Keyed], fleet_looked: bool = False,
               lengths: list | None = None) -> list[tuple[int, object]]:
        """(route, fill) for each missed keyed text: token ids here, in this process (an upstream model's:
        its text). With `lengths`, each text's token count is appended to it."""
        served = plan.served
        texts = [one.text for one in keyed]
        if served.encoder is None:  # computed upstream: the text itself goes
            ids = None
        else:
            ids = served.encoder.encode_batch(texts) if len(texts) > 1 else [served.encoder.encode(texts[0])]
            if lengths is not None:
                lengths.extend(len(one) for one in ids)
        embed_ids = served.embed_encoder.encode_batch(texts) if served.embed_encoder is not None else None
        spec, version, source = served.spec, served.version, served.feature_source

        def fill(item, n: int, key: bytes, private: bool) -> None:
            item.model, item.version, item.tenant, item.key = spec.name, version, plan.tenant, key
            if ids is None:
                item.text = texts[n]
            else:
                item.ids = np.asarray(ids[n], dtype="<i4").tobytes()
            if embed_ids is not None:
                item.embed_ids = np.asarray(embed_ids[n], dtype="<i4").tobytes()
            item.store, item.cached_ok = plan.store and not private, plan.cached_ok and not private
            item.max_age_us, item.ttl_class = plan.max_age_us, plan.ttl_class
            item.fleet_looked = fleet_looked
            if source is not None:
                item.feature_key = feature_key(spec, source, plan.tenant, texts[n])
            if plan.semantic is not None:
                item.semantic.CopyFrom(plan.semantic)

        return [(served.route(one.key), functools.partial(fill, n=n, key=one.key, private=one.private))
                for n, one in enumerate(keyed)]

    async def infer(self, request: pb.InferRequest | bytes, time_remaining: float | None, tally=NO_TALLY) -> bytes:
        """The serialized InferResponse (answers leave as bytes: cachestore/wire.py) of a request or its
        serialized form."""
        planner = self.planner
        plan, keyed = planner.prepared(request) if isinstance(request, bytes) else planner.prepare(request)
        if self.hot is not None:
            self._seen(plan, keyed)
        if (hit := self._hit(plan, keyed)) is not None:
            tally.answered(plan, keyed, RESULT_EXACT)
            return hit
        return await self.after_l1(plan, keyed, time_remaining, tally)

    def exact(self, plan: Plan, keyed: Keyed, tally=NO_TALLY, kept: Container[tuple[bytes, int]] = ()
              ) -> tuple[bytes | None, bytes, int, float] | None:
        """infer's first step for a door that reshapes answers (the OpenAI and KServe doors): the text
        counted as infer counts it, and a fresh L1 entry as ResultCache.entry gives it (stored answer or
        None where `kept` names it, key, creation time, age), not composed into InferResponse bytes; None
        when L1 has none."""
        if self.hot is not None:
            self._seen(plan, keyed)
        if plan.cached_ok and not keyed.private and (cache := self.l1()) is not None:
            entry = cache.entry(keyed.key, plan.max_age_us, kept)
            if entry is not None:
                self.counters["hit_exact"] += 1
                tally.answered(plan, keyed, RESULT_EXACT)
                return entry
        return None

    async def infer_entry(self, raw: bytes, time_remaining: float | None, tally=NO_TALLY,
                          kept: Container[tuple[bytes, int]] = ()) -> tuple[bytes | None, bytes, int, float] | bytes:
        """infer of a serialized InferRequest for a door that reshapes answers: an exact hit as exact()
        gives it (a tuple), any other answer as infer's bytes."""
        plan, keyed = self.planner.prepared(raw)
        return self.exact(plan, keyed, tally, kept) or await self.after_l1(plan, keyed, time_remaining, tally)

    async def after_l1(self, plan: Plan, keyed: Keyed, time_remaining: float | None, tally=NO_TALLY) -> bytes:
        """The serialized InferResponse of a text L1 did not answer: from the fleet tier, a stored
        feature, or its worker."""
        tally.missed(0, self._why_missed(plan, keyed.private))
        looked = self.fleet is not None and self.fleet.usable
        if looked and (hit := await self._fleet_hit(plan, keyed)) is not None:
            tally.answered(plan, keyed, RESULT_FLEET)
            return hit
        if plan.mode == ONLY_IF_CACHED:
            self.counters["not_cached"] += 1
            raise NotCached("no fresh cached entry for this input (cache.mode is ONLY_IF_CACHED)")
        if plan.served.head is not None and plan.cached_ok:  # a stored feature: answered here
            [answer] = self._feature_answers(plan, [keyed])
            if answer is not None:
                tally.answered(plan, keyed, FEATURE)
                return answer
        try:
            self.workers.admit(plan.served.spec.name, plan.served.version, (plan.served.route(keyed.key),),
                               time_remaining)
            self.counters["forwarded"] += 1
            items = self._items(plan, [keyed], looked, tally.lengths)
            [result] = await self.workers.compute(items, time_remaining)
        except STALE_IF as exc:
            [stale] = self._stale(plan, [keyed], exc)
            tally.answered(plan, keyed, RESULT_EXACT)
            return stale
        tally.tokenized(plan, [keyed])
        tally.answered(plan, keyed, result.source, rejected=result.semantic_rejected)
        return _answer(result)

    async def infer_batch(self, request: pb.InferBatchRequest, time_remaining: float | None, tally=NO_TALLY) -> bytes:
        """The serialized InferBatchResponse."""
        plan = self.planner.plan(request)
        limit = self.config.server.max_batch_texts
        if not request.texts:
            raise InvalidArgument("texts is empty; send at least one text")
        if len(request.texts) > limit:
            raise InvalidArgument(f"texts has {len(request.texts)} items; at most {limit} per call (server.max_batch_texts)")
        keyed: list[Keyed] = []
        answers, missed = [], []
        for n, text in enumerate(request.texts):
            try:
                one = self.planner.keyed(request.tenant, plan.served, text)
            except InvalidArgument as exc:
                raise InvalidArgument(f"texts[{n}]: {exc}") from None
            keyed.append(one)
            answers.append(self._hit(plan, one))
            if answers[-1] is None:
                missed.append(n)
                tally.missed(n, self._why_missed(plan, one.private))
        if self.hot is not None:
            for one in keyed:
                self._seen(plan, one)
        self.counters["batch_calls"] += 1
        self.counters["batch_texts"] += len(keyed)
        here: dict[int, int] = {}  # texts L1 missed, answered here all the same: their sources
        looked = bool(missed) and self.fleet is not None and self.fleet.usable
        if looked:  # one pipeline for all of them
            found = await asyncio.gather(*(self._fleet_hit(plan, keyed[n]) for n in missed))
            missed = self._answered_here(answers, missed, found, here, RESULT_FLEET)
        if missed and plan.mode == ONLY_IF_CACHED:
            self.counters["not_cached"] += len(missed)
            raise NotCached(f"texts[{missed[0]}]: no fresh cached entry ({len(missed)} of {len(keyed)} texts have "
                            "none; cache.mode is ONLY_IF_CACHED)")
        if missed and plan.served.head is not None and plan.cached_ok:  # stored features: answered here
            found = self._feature_answers(plan, [keyed[n] for n in missed])
            missed = self._answered_here(answers, missed, found, here, FEATURE)
        results = []
        if missed:
            miss_keyed = [keyed[n] for n in missed]
            served = plan.served
            try:
                self.workers.admit(served.spec.name, served.version, [served.route(one.key) for one in miss_keyed],
                                   time_remaining)
                self.counters["forwarded"] += len(missed)
                if len(missed) > TOKENIZE_INLINE_MAX:  # a long batch tokenizes off the event loop
                    items = await asyncio.to_thread(self._items, plan, miss_keyed, looked, tally.lengths)
                else:
                    items = self._items(plan, miss_keyed, looked, tally.lengths)
                results = await self.workers.compute(items, time_remaining)
            except STALE_IF as exc:  # (every missed text is answered stale, or the call fails)
                results = []
                missed = self._answered_here(answers, missed, self._stale(plan, miss_keyed, exc), here, RESULT_EXACT)
            else:
                tally.tokenized(plan, miss_keyed)
        tally.answered_batch(plan, keyed, dict(zip(missed, results)), here)
        results_in_order = iter(results)
        return wire.batch_response([_answer(next(results_in_order)) if answer is None else answer for answer in answers])

    def _stale(self, plan: Plan, keyed: list[Keyed], failure: Exception) -> list[bytes]:
        """Answers of texts the model could not compute (`failure`) from entries expired at most the model's
        cache.stale_if_error_s ago, marked stale; `failure` itself unless every text has one."""
        stale_us = plan.served.spec.stale_if_error_s * 1_000_000
        cache = self.l1() if stale_us and plan.cached_ok else None
        if cache is None or any(one.private for one in keyed):
            raise failure
        found = []
        for one in keyed:
            entry = cache.entry(one.key, plan.max_age_us + stale_us)
            if entry is None:
                raise failure
            stored, _, _, age_s = entry
            info = pb.CacheInfo(source=pb.CacheInfo.RESULT_EXACT, age_s=age_s, stale=True)
            found.append(stored + pb.InferResponse(cache=info).SerializeToString())  # (merged: cachestore/wire.py)
        self.counters["stale_served"] += len(found)
        log.warning("%s: %d text(s) answered from expired entries: %s", plan.served.spec.name, len(found), failure)
        return found

    @staticmethod
    def _answered_here(answers: list, missed: list[int], found: list, here: dict[int, int], source: int) -> list[int]:
        """Takes the answers `found` for the `missed` texts (None: not found) from `source`; returns
        the texts still missed."""
        for n, answer in zip(missed, found):
            if answer is not None:
                answers[n], here[n] = answer, source
        return [n for n in missed if answers[n] is None]
