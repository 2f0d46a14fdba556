"""A worker's generations: flights by key (identical generations in flight run once; a caller that
joins late gets the text so far, then the rest), a scheduler per model version (a local decoder's, or an
upstream's streams), the late hit from L1, semantic answers, and the answers into L1. A finished answer
goes to every caller, then into L1 behind the reply (the flight stays joinable until its entry is
committed)."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from functools import partial

from cachestore.keys import namespace
from cachestore.results import ResultCache, now_us
from infercache.v1 import infercache_pb2 as pb
from infercache.v1 import worker_pb2
from server.shared.answers import answer_record
from server.shared.errors import InferCacheError, WorkerUnavailable
from server.shared.generated import marked
from server.worker.flights import FlightRegistry
from server.worker.generation.request import GenerateFlight

log = logging.getLogger("infercache.generation")

Source = pb.CacheInfo.Source


class Generations:
    """The worker's generations: flights by key, a scheduler per generative model version, and their
    answers into L1. Event loop only."""

    def __init__(self, runtimes: dict, writer, cache: ResultCache | None, counters: Counter, metrics=lambda: None,
                 answers=None, busy=lambda: False, flights: FlightRegistry | None = None) -> None:
        """runtimes: (model, version) -> a local GenerativeRuntime (server/worker/generation/scheduler.py) or
        an upstream's (server/worker/upstream/generative.py): each has spec, version, info and prefix, makes
        its flights (flight()) and what computes them (scheduler()). cache: the worker's L1 reader
        (WorkerCore's: it follows the writer's store when a damaged one is replaced), for answers committed
        since the frontend looked. metrics(): the worker's telemetry.Recorder while /metrics is on, else
        None. answers: the worker's AnswerMatching (server/worker/semantic/answer_matching.py), for models with
        semantic answers. busy(): whether the worker's other models have work (shadow regenerations give way
        to it). flights: the worker's one FlightRegistry (server/worker/flights.py), WorkerCore's."""
        self.runtimes = runtimes
        self.answers = answers
        self.busy = busy
        self._tasks: set[asyncio.Task] = set()  # semantic lookups, and what a miss's answer adds to them
        self.writer = writer
        self.cache = cache
        self.counters = counters
        self.flights = flights if flights is not None else FlightRegistry(counters)
        self._schedulers = {key: runtime.scheduler(self._done, counters, metrics, busy)
                            for key, runtime in runtimes.items()}

    def submit(self, replies, item: worker_pb2.ComputeItem, deadline: float | None) -> None:
        runtime = self.runtimes.get((item.model, item.version))
        if runtime is None:
            raise WorkerUnavailable(f"model {item.model!r} version {item.version!r} is not loaded by this worker")
        flight = self.flights.joinable(item)
        if flight is None and item.cached_ok and self.cache is not None:
            now = now_us()
            record = self.cache.get(item.key, now, item.max_age_us if item.HasField("max_age_us") else None)
            if record is not None:  # committed after the frontend looked
                self.counters["late_hit"] += 1
                replies.finish(item.id, Source.RESULT_EXACT, marked(record.payload, Source.RESULT_EXACT,
                                                                    record.age_s(now)))
                return
        if (flight is None and item.question_key and self.answers is not None
                and self.answers.enabled(runtime.spec)):
            self.background(self._semantic(replies, item, deadline, runtime))
            return
        self._start(replies, item, deadline, runtime, flight)

    async def _semantic(self, replies, item: worker_pb2.ComputeItem, deadline: float | None,
                        runtime) -> None:
        """A question's semantic answer, else its generation (with the question's entry to store)."""
        try:
            found = await self.answers.lookup(runtime, item, deadline)
        except InferCacheError as exc:  # the deadline passed, or the embedder refused: the caller hears
            replies.fail(item.id, exc)
            return
        except Exception:  # noqa: BLE001 (a failed lookup is a miss)
            self.counters["answer_lookup_errors"] += 1
            log.exception("semantic answer lookup failed; generating")
            found = None
        if found is not None and found.answer is not None:
            replies.finish(item.id, Source.RESULT_SEMANTIC, found.answer)
            return
        try:
            self._start(replies, item, deadline, runtime, self.flights.joinable(item),
                        found.companion if found is not None else None)
        except InferCacheError as exc:
            replies.fail(item.id, exc)

    def _start(self, replies, item: worker_pb2.ComputeItem, deadline: float | None, runtime,
               flight: GenerateFlight | None, companion=None) -> None:
        """Joins `flight` (the one of the item's key that may answer it), or starts one."""
        joined = flight is not None
        if flight is None:
            flight = runtime.flight(item, deadline)
            flight.companion = companion
            scheduler = self._schedulers[(item.model, item.version)]
            scheduler.admit(flight)  # Overloaded when full
            for other in self._schedulers.values():  # the device is the foreground's: every regeneration
                if other is not scheduler:           # gives way (its own scheduler's did in admit)
                    other.preempt()
            if item.cached_ok or item.store:  # deterministic: its key names its answer
                self.flights.add(flight)
        flight.store = flight.store or item.store
        if joined:
            self.counters["generate_coalesced"] += 1
            if flight.answer is not None:  # ended: the whole answer at once
                replies.finish(item.id, Source.COALESCED, marked(flight.answer, Source.COALESCED))
                return
            for text, ids in flight.sent:  # the answer so far, then live
                replies.stream(item.id, text, ids)
        flight.listeners[(replies, item.id)] = joined
        replies.waiting[item.id] = flight

    @property
    def background_tasks(self) -> int:
        """Semantic lookups, and what misses' answers add to them (embeddings, outcomes), not done yet."""
        return len(self._tasks)

    def schedulers(self):
        """Every model version's scheduler (shadow checks wait for them to be idle too)."""
        return self._schedulers.values()

    def regenerate(self, item: worker_pb2.ComputeItem) -> asyncio.Future:
        """A shadow regeneration of `item` (server/worker/semantic/regeneration.py): its whole answer, or Preempted
        when foreground work came first (raised at once where its scheduler is busy). Stored nowhere,
        joined by nobody."""
        runtime = self.runtimes[(item.model, item.version)]
        flight = runtime.flight(item, None)
        flight.store = False
        flight.background = asyncio.get_running_loop().create_future()
        self._schedulers[(item.model, item.version)].admit(flight)
        return flight.background

    def erase(self, selector) -> int:
        """Invalidate: the prefix blocks `selector` names, dropped from every model version's memory and
        host memory (server/worker/prefix/prefix_cache.py erase); how many went."""
        return sum(runtime.prefix.erase(selector) for runtime in self.runtimes.values() if runtime.prefix is not None)

    def background(self, coroutine) -> asyncio.Task:
        """A task of this worker's generations (cancelled at close)."""
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _done(self, flight: GenerateFlight) -> None:
        """A flight ended: its callers get the answer; it is stored, and forgotten once committed."""
        if flight.background is not None:  # a shadow regeneration: its answer to the check alone
            if not flight.background.done():
                if flight.answer is None:
                    flight.background.set_exception(WorkerUnavailable("the regeneration failed"))
                else:
                    flight.background.set_result(flight.answer)
                    self.counters["regenerated"] += 1
            return
        if flight.answer is None:  # failed or dropped
            self.flights.forget(flight)
            return
        shared = len(flight.listeners) > 1
        for (replies, item_id), joined in flight.listeners.items():
            replies.waiting.pop(item_id, None)
            source = Source.COALESCED if joined else Source.MISS
            replies.finish(item_id, source, marked(flight.answer, source))
        flight.listeners.clear()
        self.counters["generated"] += 1
        store = flight.store and self.writer is not None
        if store:
            item = flight.item
            record = answer_record(flight.model.spec, flight.created_us, flight.answer, item.ttl_class)
            ns = namespace(item.tenant, item.model, item.version)
            self.writer.put(flight.key, ns, record, on_done=partial(self.flights.forget, flight), ttl_class=item.ttl_class,
                            shared=shared)
        else:
            self.flights.forget(flight)
        companion = flight.companion
        if companion is None:
            return
        put = partial(self._put_question, flight, shared) if store else None
        if companion.awaits_answer:  # answer equivalence: the answer's embedding first (an outcome, the entry)
            self.background(self.answers.answered(flight.model, companion, flight.answer, put))
        elif put is not None:
            put(companion.key, companion.payload, companion.entry)

    def _put_question(self, flight: GenerateFlight, shared: bool, key: bytes, payload: bytes, entry) -> None:
        """A question's entry (server/worker/semantic/answer_matching.py), pointing at the flight's answer."""
        item = flight.item
        question = answer_record(flight.model.spec, flight.created_us, payload, item.ttl_class)
        self.writer.put(key, namespace(item.tenant, item.model, item.version), question, semantic=entry,
                        ttl_class=item.ttl_class, shared=shared)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for scheduler in self._schedulers.values():
            await scheduler.close()
