"""A frontend's Generate path, transport-free: the call's plan (server/frontend/prompts.py), then its
answer from L1 (a stored answer streams at once, in one message), else from the key's worker, whose
frames are passed on as they come. Only deterministic requests (greedy, or sampled with a seed) are
looked up, stored and coalesced."""

from __future__ import annotations

import functools
import time
from collections import Counter

import numpy as np

from cachestore.results import now_us
from infercache.v1 import infercache_pb2 as pb
from infercache.v1 import worker_pb2
from server.frontend.metrics import FrontendMetrics
from server.frontend.prompts import GeneratePlan, Prompts
from server.frontend.read_cache import ReadCache
from server.frontend.workers import WorkerPool
from server.shared.errors import NotCached

Source = pb.CacheInfo.Source


def end_message(answer: worker_pb2.GeneratedAnswer, source: int, version: str, key: bytes, age_s: float = 0.0
                ) -> pb.GenerateResponse:
    """The last message of a stream: how the answer ended, its token counts and where it came from."""
    return pb.GenerateResponse(end=pb.GenerationEnd(
        finish_reason=answer.finish_reason, prompt_tokens=answer.prompt_tokens,
        completion_tokens=len(answer.token_ids),
        cache=pb.CacheInfo(source=source, age_s=age_s, model_version=version, key=key.hex())))


def _fill(item, *, plan: GeneratePlan) -> None:
    model = plan.model
    item.model, item.version, item.tenant, item.key = model.spec.name, model.version, plan.tenant, plan.key
    item.ids = np.asarray(plan.ids, dtype="<i4").tobytes()
    item.store, item.cached_ok = plan.store, plan.cached_ok
    item.max_age_us = plan.max_age_us
    item.generate.CopyFrom(plan.params)


class GenerateCalls:
    def __init__(self, prompts: Prompts, l1: ReadCache, workers: WorkerPool, counters: Counter,
                 metrics: FrontendMetrics | None = None) -> None:
        self.prompts = prompts
        self._l1 = l1
        self.workers = workers
        self.counters = counters
        self.metrics = metrics

    def _stored(self, plan: GeneratePlan) -> tuple[worker_pb2.GeneratedAnswer, float] | None:
        """A fresh stored answer and its age, or None."""
        if not plan.cached_ok or (cache := self._l1.get()) is None:
            return None
        now = now_us()
        record = cache.get(plan.key, now, plan.max_age_us)
        if record is None:
            return None
        try:
            answer = worker_pb2.GeneratedAnswer.FromString(record.payload)
        except Exception:  # noqa: BLE001 (a record that does not parse is a miss)
            self.counters["generate_unreadable"] += 1
            return None
        return answer, record.age_s(now)

    async def generate(self, request: pb.GenerateRequest, time_remaining: float | None):
        """The call's GenerateResponse messages, as they come."""
        started = time.perf_counter()
        plan = self.prompts.plan(request)
        version = plan.model.version
        found = self._stored(plan)
        if found is not None:
            answer, age_s = found
            self.counters["generate_hits"] += 1
            self._observe(plan, Source.RESULT_EXACT, started, started, len(answer.token_ids))
            yield pb.GenerateResponse(text=answer.text, token_ids=answer.token_ids)
            yield end_message(answer, Source.RESULT_EXACT, version, plan.key, age_s)
            return
        if plan.only_if_cached:
            self.counters["not_cached"] += 1
            raise NotCached("no fresh cached answer for this request (cache.mode is ONLY_IF_CACHED)")
        self.counters["generate_forwarded"] += 1
        first = None
        async for frame in self.workers.stream(plan.model.route(plan.key), functools.partial(_fill, plan=plan),
                                               time_remaining):
            if frame.more:
                first = first or time.perf_counter()
                yield pb.GenerateResponse(text=frame.text, token_ids=frame.token_ids)
            else:
                answer = frame.answer
                self._observe(plan, frame.source, started, first, len(answer.token_ids))
                age_s = max(0.0, (now_us() - answer.created_us) / 1e6) if frame.source != Source.MISS else 0.0
                yield end_message(answer, frame.source, version, plan.key, age_s)

    def _observe(self, plan: GeneratePlan, source: int, started: float, first: float | None, tokens: int) -> None:
        if self.metrics is not None:
            self.metrics.generated(plan.model.spec.name, source, (first or time.perf_counter()) - started,
                                   time.perf_counter() - started, tokens)
