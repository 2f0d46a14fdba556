"""A frontend's Generate path, transport-free: the call's plan (server/frontend/prompts.py), then its
answer from L1 (a stored answer goes out at once, as one message), else from the key's worker, whose
frames are passed on as they come. Only deterministic requests (greedy, or sampled with a seed) are
looked up, stored and coalesced. Messages leave as bytes (server/shared/generated.py): a hit is the stored
answer plus its source, never parsed."""

from __future__ import annotations

import functools
import time
from collections import Counter

import numpy as np

from cachestore.results import now_us
from infercache.v1 import infercache_pb2 as pb
from server.frontend.metrics import FrontendMetrics
from server.frontend.plan import namespace_route
from server.frontend.prompts import GeneratePlan, Prompts
from server.frontend.read_cache import ReadCache
from server.frontend.workers import WorkerPool
from server.shared.errors import NotCached
from server.shared.generated import end_only, marked

Source = pb.CacheInfo.Source
RESULT_EXACT, MISS = int(Source.RESULT_EXACT), int(Source.MISS)


def _fill(item, *, plan: GeneratePlan) -> None:
    model = plan.model
    item.model, item.version, item.tenant, item.key = model.spec.name, model.version, plan.tenant, plan.key
    item.ids = np.asarray(plan.ids, dtype="<i4").tobytes()
    if plan.text:  # an upstream model's messages or prompt
        item.text = plan.text
    item.store, item.cached_ok = plan.store, plan.cached_ok
    item.max_age_us, item.ttl_class = plan.max_age_us, plan.ttl_class
    item.generate.CopyFrom(plan.params)
    item.public_prefix = plan.public_prefix
    if (question := plan.question) is not None:
        item.question_key, item.question_marks = question.key, question.marks
        item.embed_ids = np.asarray(question.embed_ids, dtype="<i4").tobytes()


class GenerateCalls:
    def __init__(self, prompts: Prompts, l1: ReadCache, workers: WorkerPool, counters: Counter,
                 metrics: FrontendMetrics | None = None) -> None:
        self.prompts = prompts
        self._l1 = l1
        self.workers = workers
        self.counters = counters
        self.metrics = metrics

    def _stored(self, plan: GeneratePlan) -> bytes | None:
        """A fresh stored answer, marked RESULT_EXACT with its age, or None."""
        if not plan.cached_ok or (cache := self._l1.get()) is None:
            return None
        now = now_us()
        record = cache.get(plan.key, now, plan.max_age_us)
        return None if record is None else marked(record.payload, RESULT_EXACT, record.age_s(now))

    async def plan(self, request: pb.GenerateRequest | bytes) -> GeneratePlan:
        return await (self.prompts.prepared(request) if isinstance(request, bytes) else self.prompts.plan(request))

    def hit(self, plan: GeneratePlan) -> bytes | None:
        """The whole answer from L1 as the call's one message, or None (ONLY_IF_CACHED: NotCached)."""
        started = time.perf_counter()
        if (found := self._stored(plan)) is not None:
            self.counters["generate_hits"] += 1
            if self.metrics is not None:
                self._observe(plan, RESULT_EXACT, started, None, pb.GenerateResponse.FromString(found))
            return found
        if plan.only_if_cached:
            self.counters["not_cached"] += 1
            raise NotCached("no fresh cached answer for this request (cache.mode is ONLY_IF_CACHED)")
        return None

    async def generate(self, plan: GeneratePlan, time_remaining: float | None):
        """A missed call's messages from its worker, serialized, as they come."""
        started = time.perf_counter()
        self.counters["generate_forwarded"] += 1
        first = last = None
        model = plan.model.spec.name
        # A question's namespace goes to one worker, where its index lives (server/worker/semantic/answer_matching.py).
        route = plan.model.route(plan.key) if plan.question is None else namespace_route(plan.question.key)
        async for frame in self.workers.stream(route, functools.partial(_fill, plan=plan),
                                               time_remaining):
            if frame.more:
                now = time.perf_counter()
                if last is not None and self.metrics is not None:
                    self.metrics.inter_token(model, now - last, len(frame.token_ids))
                first, last = first or now, now
                yield pb.GenerateResponse(text=frame.text, token_ids=frame.token_ids).SerializeToString()
            else:  # the whole answer: its last message alone where its text went out already
                if self.metrics is not None:
                    self._observe(plan, frame.source, started, first, pb.GenerateResponse.FromString(frame.response))
                yield end_only(frame.response) if first is not None else frame.response

    def _observe(self, plan: GeneratePlan, source: int, started: float, first: float | None,
                 answer: pb.GenerateResponse) -> None:
        now = time.perf_counter()
        spec, end = plan.model.spec, answer.end
        self.metrics.generated(spec.name, source, (first or now) - started, now - started, end.completion_tokens)
        if spec.upstream is not None and source != MISS:
            self.metrics.upstream_saved(spec.name, spec.upstream, end.prompt_tokens, end.completion_tokens)
