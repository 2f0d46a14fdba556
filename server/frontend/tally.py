"""One call's /metrics bookkeeping, kept off the answer path's logic: the answer path tells a tally what
happened to each text (where its answer came from, why it missed, how long it tokenized), and the
servicer hands the call's sources to FrontendMetrics when the call ends. With /metrics off the answer
path gets NO_TALLY, which records nothing."""

from __future__ import annotations

import asyncio
import time
from typing import Callable

from server.frontend.metrics import FEATURE, MISS, RESULT_EXACT, RESULT_SEMANTIC, SAVING, FrontendMetrics
from server.frontend.plan import Keyed, Plan
from server.shared.admission import bucket_of
from server.shared.errors import status_of


class CallTally:
    __slots__ = ("metrics", "sources", "lengths", "_reasons")

    def __init__(self, metrics: FrontendMetrics) -> None:
        self.metrics = metrics
        self.sources: list[int] = []   # each answered text's source, in the call's order
        self.lengths: list[int] = []   # token counts of the texts this call tokenized, in order
        self._reasons: dict[int, str] = {}  # text index -> why L1 missed it

    def missed(self, n: int, reason: str) -> None:
        """Text `n` missed L1 for `reason` (reported if the worker computes it)."""
        self._reasons[n] = reason

    def answered(self, plan: Plan, keyed: Keyed, source: int, n: int = 0, rejected: bool = False) -> None:
        """Text `n` answered from `source`: a hit's model time saved, or a miss's reason."""
        self.sources.append(source)
        served = plan.served
        if source in SAVING:
            spared = served.feature_source[:2] if source == FEATURE and served.feature_source else None
            spent = served.embedder if source == RESULT_SEMANTIC else None
            self.metrics.hit(served.spec.name, served.version, len(keyed.text), spared, spent)
        elif source == MISS:
            self.metrics.missed(served.spec.name, "semantic_rejected" if rejected else self._reasons[n])

    def answered_batch(self, plan: Plan, keyed: list[Keyed], computed: dict, here: dict[int, int]) -> None:
        """A batch call's texts, in its order: `computed` maps a text to the worker's result, `here` to
        the source it was answered from in this frontend after L1 missed it (else L1 answered it)."""
        for n, one in enumerate(keyed):
            if (result := computed.get(n)) is not None:
                self.answered(plan, one, result.source, n, result.semantic_rejected)
            else:
                self.answered(plan, one, here.get(n, RESULT_EXACT), n)

    def tokenized(self, plan: Plan, keyed: list[Keyed]) -> None:
        """The texts sent to the workers, with their token counts (self.lengths): which bucket each
        length class of text falls in."""
        served = plan.served
        for one, tokens in zip(keyed, self.lengths):
            self.metrics.tokenized(served.spec.name, served.version, len(one.text), bucket_of(served.spec.buckets, tokens))


class _NoTally:
    """/metrics off: nothing recorded, nothing tokenized counted."""

    __slots__ = ()
    lengths = None

    def missed(self, n: int, reason: str) -> None:
        pass

    def answered(self, plan: Plan, keyed: Keyed, source: int, n: int = 0, rejected: bool = False) -> None:
        pass

    def answered_batch(self, plan: Plan, keyed: list[Keyed], computed: dict, here: dict[int, int]) -> None:
        pass

    def tokenized(self, plan: Plan, keyed: list[Keyed]) -> None:
        pass


NO_TALLY = _NoTally()


async def measured(core, call, request, texts: int, time_remaining: Callable[[], float | None]) -> bytes:
    """call(request, time_remaining(), tally) (FrontendCore.infer or infer_batch) with /metrics on, for
    any door: its texts by source and status code, and its latency."""
    metrics, started, tally = core.metrics, time.perf_counter(), CallTally(core.metrics)
    try:
        answer = await call(request, time_remaining(), tally)
    except BaseException as exc:
        if isinstance(exc, asyncio.CancelledError):  # gRPC cancels the handler at the client's deadline
            remaining = time_remaining()
            code = "DEADLINE_EXCEEDED" if remaining is not None and remaining <= 0 else "CANCELLED"
        else:
            code = status_of(exc)[0].name
        metrics.failed(metrics.model_label(core.planner.model_named(request)), texts, code,
                       time.perf_counter() - started)
        raise
    metrics.answered(core.planner.model_named(request), tally.sources, time.perf_counter() - started)
    return answer
