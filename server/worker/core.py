"""What an inference worker does with each item a frontend sends: the transport-free core.

Items arrive already normalized, keyed and tokenized. For each, on the event loop and without
awaiting: join the identical computation in flight (coalescing), else answer from L1 if the entry was
committed since the frontend looked, else start one computation: straight into the model's batcher, or,
for a head model or a model with semantic matching, the `Matching.answer` coroutine (server/worker/semantic/matching.py) (the head's features from the
feature tier or the encoder; embed -> search -> match; else the model or head). When it finishes,
every waiter gets its answer through its frontend's connection, then the result is written behind.
A joiner shares the first item's deadline and policy (as before this worker core existed). A flight stays
joinable until its entry is committed, so a request that missed L1 meanwhile joins it instead of
computing the same thing again.

With a fleet tier (server/fleet/), a flight looks the key up in Redis (unless its frontend already did)
and, on a miss that will be stored, takes the key's lease: a result another pod computes is waited for
instead of computed again. A fleet answer is copied into L1 like a computed one (so is one a frontend
answered: an item that carries a record); a computed answer goes to the fleet behind the reply.

The event loop is the only writer of the flights and of `counters`.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from functools import partial

from cachestore import records, wire
from cachestore.errors import CorruptRecord
from cachestore.keys import NS_ID_BYTES, Selector, namespace, parse_hex_key
from cachestore.results import ResultCache, now_us
from cachestore.semantic_log import SemanticEntry
from infercache.v1 import infercache_pb2 as pb
from infercache.v1 import worker_pb2
from server.shared.answers import answer_record
from server.shared.errors import InferCacheError, ModelNotFound, WorkerUnavailable
from server.shared.models import ModelRepository
from server.shared.telemetry import Recorder
from server.worker.store.features import FeatureTier, feature_selector
from server.worker.flights import Flight, FlightRegistry, Outcome, Replies, Source
from server.worker.semantic.answer_matching import AnswerMatching
from server.worker.generation.generations import Generations
from server.worker.semantic.heads import HeadRuntime
from server.worker.semantic.matching import Matching
from server.worker.model_runtime import ModelRuntime
from server.worker.store.writer import WriterProcess

log = logging.getLogger("infercache.compute")

_MISS, _COALESCED = Source.MISS, Source.COALESCED  # per item, as plain ints (an enum wrapper's attribute costs ~1 us)


_COUNTED = {Source.MISS: "computed", Source.RESULT_SEMANTIC: "semantic_hits", Source.RESULT_FLEET: "fleet_hits",
            Source.FEATURE: "feature_answers"}


def _selector(request: pb.InvalidateRequest) -> Selector:
    return Selector(
        tenant=request.tenant if (request.tenant or request.match_empty_tenant) else None,
        model=request.model or None,
        version=request.version or None,
        key=parse_hex_key(request.key) if request.key else None,
    )


class WorkerCore:
    def __init__(self, repository: ModelRepository, runtimes: dict[tuple[str, str], ModelRuntime],
                 writer: WriterProcess | None, semantic=None, fleet=None, features: FeatureTier | None = None,
                 generative: dict | None = None, kv_store=None) -> None:
        self.repository = repository
        self.runtimes = runtimes
        self.writer = writer
        self.semantic = semantic
        self.fleet = fleet  # server/fleet/tier.py FleetTier, or None
        self.features = features  # L2 (server/worker/store/features.py); every head model has one
        self.kv_store = kv_store  # the prefix caches' disk tier (server/worker/prefix/prefix_disk.py), or None
        self.cache = ResultCache(writer.store) if writer is not None else None
        if writer is not None:  # a read that meets a damaged page has the writer look (and replace the store)
            self.cache.on_corrupt = writer.check
            writer.on_store.append(self.cache.use)
        self.counters: Counter[str] = Counter()
        self.metrics: Recorder | None = None  # /metrics on (server/worker/metrics.py)
        self.flights = FlightRegistry(self.counters)  # encoder items' and generations' alike
        self.matching = Matching(self)  # head and semantic models' misses, the calibrated rule's checks
        # Generative models (server/worker/generation/): their schedulers, their flights in the one registry.
        self.generations = Generations(generative, writer, self.cache, self.counters, lambda: self.metrics,
                                       AnswerMatching(self), self._encoders_busy, self.flights) if generative else None

    def _encoders_busy(self) -> bool:
        return any(not runtime.batcher.idle for runtime in self.runtimes.values())

    def batchers(self):
        """What computes in this worker, each with `idle` and `wait_idle` (shadow checks wait for all of
        it): every model's batcher and every generative model's scheduler."""
        yield from (runtime.batcher for runtime in self.runtimes.values())
        if self.generations is not None:
            yield from self.generations.schedulers()

    def runtime(self, model: str, version: str) -> ModelRuntime:
        runtime = self.runtimes.get((model, version))
        if runtime is None:
            self.repository.get(model).resolve_version(version)  # the precise NOT_FOUND message
            raise ModelNotFound(f"model {model!r} version {version!r} is not loaded by this worker")
        return runtime

    def serving(self, model: str) -> ModelRuntime:
        """The runtime of `model`'s serving version (an embedder or a judge the semantic tiers use)."""
        return self.runtime(model, self.repository.get(model).serving_version)

    # ---- items in ----------------------------------------------------------------------------------

    def submit_all(self, replies: Replies, items, now: float) -> None:
        """Takes a frame's items (deadlines relative to loop time `now`), in one L1 read transaction."""
        txn = None
        if self.cache is not None:
            try:
                txn = self.cache.store.begin(buffers=True)
            except Exception:  # the store is unreadable: each lookup tries on its own and misses
                pass
        try:
            for item in items:
                try:
                    self.submit(replies, item, now + item.timeout_s if item.timeout_s > 0 else None, txn)
                except Exception as exc:  # a bug must cost this item, not the rest of the frame
                    log.exception("item %d failed", item.id)
                    replies.fail(item.id, exc)
        finally:
            if txn is not None:
                txn.abort()

    def submit(self, replies: Replies, item: worker_pb2.ComputeItem, deadline: float | None, txn=None) -> None:
        """Takes one item; its answer (or error) reaches `replies` later, or at once."""
        if item.answered_record:
            self._copy(item)
            return
        if item.HasField("generate"):
            try:
                if self.generations is None:
                    self.repository.get(item.model).resolve_version(item.version)
                    raise ModelNotFound(f"model {item.model!r} version {item.version!r} is not loaded by this worker")
                self.generations.submit(replies, item, deadline)
            except InferCacheError as exc:
                replies.fail(item.id, exc)
            return
        try:
            flight = self.flights.joinable(item)  # (None where it wants a fresher answer than one may give)
            joined = flight is not None
            if flight is None:
                runtime = self.runtime(item.model, item.version)
                if item.cached_ok and self.cache is not None:
                    max_age = item.max_age_us if item.HasField("max_age_us") else None
                    if (cached := self.cache.lookup(item.key, max_age, txn)) is not None:
                        self.counters["late_hit"] += 1  # committed after the frontend looked
                        replies.ok(item.id, Source.RESULT_EXACT, cached)
                        return
                flight = self._start(runtime, item, deadline)
        except InferCacheError as exc:
            replies.fail(item.id, exc)
            return
        flight.store = flight.store or item.store
        if flight.outcome is not None:  # finished, entry not committed yet
            self.counters["coalesced"] += 1
            self._reply(replies, item.id, flight.outcome, joined=True)
            return
        flight.waiters[(replies, item.id)] = joined
        replies.waiting[item.id] = flight

    def _copy(self, item: worker_pb2.ComputeItem) -> None:
        """A record a frontend answered from (a fleet hit, a FEATURE answer) into L1, and a FEATURE
        answer into the fleet tier as this worker's own answers go; no answer."""
        if self.writer is None:
            return
        try:
            record = records.decode(item.answered_record, item.key)
        except CorruptRecord:
            self.counters["copies_unreadable"] += 1
            return
        ns = namespace(item.tenant, item.model, item.version)
        self.writer.put(item.key, ns, record, ttl_class=item.ttl_class)
        if item.answered_from == Source.FEATURE and self.fleet is not None:
            self.fleet.put(item.key, ns, record, release=False)
        self.counters["copies"] += 1

    def cancel(self, replies: Replies, item_id: int) -> None:
        """The item's caller went away; the computation is dropped when nobody else waits for it."""
        self.flights.leave(replies, item_id)

    def _start(self, runtime: ModelRuntime, item: worker_pb2.ComputeItem, deadline: float | None) -> Flight:
        flight = Flight(item.key, runtime, item)
        if self.fleet is not None and self.fleet.usable:
            flight.future = asyncio.get_running_loop().create_task(self._through_fleet(flight, deadline))
        else:
            flight.future = self._compute(runtime, item, deadline)
        flight.future.add_done_callback(lambda future: self._finished(flight, future))
        self.flights.add(flight)
        return flight

    def _compute(self, runtime: ModelRuntime, item: worker_pb2.ComputeItem, deadline: float | None) -> asyncio.Future:
        if isinstance(runtime, HeadRuntime) or (runtime.spec.semantic is not None and self.semantic is not None):
            return asyncio.get_running_loop().create_task(self.matching.answer(runtime, item, deadline))
        return runtime.batcher.enqueue(runtime.input_of(item), deadline)  # Overloaded when full

    async def _through_fleet(self, flight: Flight, deadline: float | None):
        """The fleet's record of the flight's key, another pod's result once it lands, or a computation."""
        fleet, item = self.fleet, flight.item
        ns = namespace(item.tenant, item.model, item.version)
        max_age = item.max_age_us if item.HasField("max_age_us") else None
        if not item.cached_ok:  # BYPASS: neither a stored answer nor another pod's
            return await self._compute(flight.runtime, item, deadline)
        if not item.fleet_looked and (record := await fleet.get(flight.key, ns, max_age)) is not None:
            return self._fleet_outcome(record)
        if item.store:  # only a result that will be shared is worth a lease
            flight.leased = True  # from here on, whatever ends the flight releases it (a cancel included)
            record, claimed = await fleet.claim(flight.key, ns, max_age)
            if record is not None:
                flight.leased = False
                return self._fleet_outcome(record)
            if claimed is False:
                bound = fleet.settings.lease_wait_s
                if deadline is not None:  # half of what is left: the rest is for computing after all
                    bound = min(bound, (deadline - asyncio.get_running_loop().time()) / 2)
                record, claimed = await fleet.wait(flight.key, ns, max_age, bound)
                if record is not None:
                    flight.leased = False
                    return self._fleet_outcome(record)
            flight.leased = claimed is not False  # None: the claim's answer was lost, it may have been taken
        return await self._compute(flight.runtime, item, deadline)

    @staticmethod
    def _fleet_outcome(record: records.Record) -> Outcome:
        payload = record.payload + wire.cache_info(Source.RESULT_FLEET, record.age_s(now_us()))
        return Outcome(payload, Source.RESULT_FLEET, matched=record)

    # ---- answers out -------------------------------------------------------------------------------

    def _finished(self, flight: Flight, future: asyncio.Future) -> None:
        if future.cancelled():  # nobody waits (see cancel); a waiter left over must still hear
            exc: BaseException | None = WorkerUnavailable("the computation was cancelled; retry")
        else:
            exc = future.exception()
        if exc is not None:
            self.flights.forget(flight)
            self._release(flight)
            for (replies, item_id) in flight.waiters:
                replies.waiting.pop(item_id, None)
                replies.fail(item_id, exc)
            return
        result = future.result()
        outcome = result if isinstance(result, Outcome) else Outcome(flight.runtime.payload(result, flight.key))
        flight.outcome = outcome
        flight.future = None  # (with the engine's outputs: a flight waiting for its commit keeps only its answer)
        joined = 0
        for (replies, item_id), was_joined in flight.waiters.items():
            joined += was_joined
            self._reply(replies, item_id, outcome, was_joined)
        flight.waiters.clear()
        self.counters[_COUNTED[outcome.source]] += 1
        self.counters["coalesced"] += joined
        if flight.store and self.writer is not None:
            # Behind the answers: their frames, scheduled as they were given, are written first.
            asyncio.get_running_loop().call_soon(self._store_behind, flight, outcome, joined > 0)
        else:
            self.flights.forget(flight)
            self._release(flight)

    def _release(self, flight: Flight) -> None:
        if flight.leased:
            flight.leased = False
            self.fleet.release(flight.key, namespace(flight.item.tenant, flight.item.model, flight.item.version))

    def _reply(self, replies: Replies, item_id: int, outcome: Outcome, joined: bool) -> None:
        replies.waiting.pop(item_id, None)
        source = _COALESCED if joined and outcome.source == _MISS else outcome.source
        replies.ok(item_id, source, outcome.payload, outcome.rejected)

    def _store_behind(self, flight: Flight, outcome: Outcome, shared: bool) -> None:
        self._store(flight, outcome, shared)
        flight.item = None  # (nor the request: the collector sees fewer objects per flight in flight)

    def _store(self, flight: Flight, outcome: Outcome, shared: bool) -> None:
        item = flight.item
        ns = namespace(item.tenant, item.model, item.version)
        done = partial(self.flights.forget, flight)  # told on the loop once the entry is committed (or dropped)
        if outcome.matched is not None:
            # A copy of the record it came from (a near-duplicate's, the fleet's): the same text next
            # time is a frontend RESULT_EXACT.
            self.writer.put(flight.key, ns, outcome.matched, on_done=done, ttl_class=item.ttl_class, shared=shared)
            self._release(flight)
            return
        record = answer_record(flight.runtime.spec, flight.created_us, outcome.stored or outcome.payload,
                               item.ttl_class)
        entry = None
        if outcome.embedding is not None:
            entry = SemanticEntry(flight.key[:NS_ID_BYTES], outcome.label, outcome.embedding)
        self.writer.put(flight.key, ns, record, on_done=done, semantic=entry, ttl_class=item.ttl_class,
                        shared=shared)
        if self.fleet is not None:
            self.fleet.put(flight.key, ns, record, release=flight.leased)
            flight.leased = False

    # ---- the rest of the API -----------------------------------------------------------------------

    async def invalidate(self, request: pb.InvalidateRequest) -> int:
        """Entries removed from L1 (with their semantic rows) and prefix blocks removed from this worker's
        memory and host memory and from the host's block store; the fleet tier's go too."""
        if request.features:
            return await self._invalidate_features(request)
        selector = _selector(request)
        blocks = await self._invalidate_prefixes(selector)
        if self.writer is None:
            raise WorkerUnavailable(f"removed {blocks} prefix blocks, but the result store is unavailable on this "
                                    "host: its entries were not removed; retry")
        removed = blocks + await asyncio.wrap_future(self.writer.invalidate(selector))
        if self.fleet is not None:
            from server.fleet.link import FleetUnavailable  # only with a fleet tier: redis-py is loaded then

            try:
                await self.fleet.invalidate(selector)
            except FleetUnavailable as exc:
                raise WorkerUnavailable(
                    f"removed {removed} entries on this host, but the fleet tier (Redis) did not answer ({exc}): "
                    "other pods may serve them until it does; retry") from None
        return removed

    async def _invalidate_prefixes(self, selector: Selector) -> int:
        """Prefix blocks: from every generative model version's memory tiers, then from the host's block
        store (after the blocks this worker queued for it; the first worker to get there counts them). An
        invalidation of one entry (a key, a text) names an answer, never a prefix block: none are erased."""
        if selector.key is not None:
            return 0
        removed = self.generations.erase(selector) if self.generations is not None else 0
        if self.kv_store is not None:
            try:
                removed += await asyncio.wrap_future(self.kv_store.erase(selector))
            except Exception as exc:  # noqa: BLE001 (the store's failure, whatever LMDB raised)
                raise WorkerUnavailable(f"removed {removed} prefix blocks from memory, but the prefix block store "
                                        f"did not erase its blocks ({exc}); retry") from None
        return removed

    async def _invalidate_features(self, request: pb.InvalidateRequest) -> int:
        """Encoder outputs of a tenant / encoder model / version: from the host's feature store (every
        worker shares it: the first to get there counts what it held) and this worker's memory."""
        if self.features is None:
            return 0
        return await self.features.invalidate(feature_selector(_selector(request)))

    def queue_waits(self):
        """(model, version, seconds to answer a new item) of each model version with a queue (admission
        in the frontends: worker.proto QueueWait)."""
        for (model, version), runtime in self.runtimes.items():
            if seconds := runtime.batcher.told_wait():
                yield model, version, seconds

    def stat_groups(self) -> list[tuple[str, dict]]:
        groups: list[tuple[str, dict]] = [("worker", self.counters)]
        for (model, version), runtime in self.runtimes.items():
            batcher = runtime.batcher
            gauges = Counter(queue_depth=batcher.depth, batch_us=int(batcher.batch_s * 1e6))
            groups.append((f"batcher.{model}.{version}", batcher.counters + gauges))
            if engine_counters := runtime.engine.counters():
                groups.append((f"engine.{model}.{version}", engine_counters))
        if self.writer is not None:
            groups.append(("writer", self.writer.counters))
        if self.semantic is not None:
            groups.append(("semantic", {**self.semantic.counters, **self.matching.shadow.stats()}))
            for (model, version), calibration in self.matching.calibrations.items():
                groups.append((f"semantic.{model}.{version}", calibration.stats()))
        if self.features is not None:
            groups.append(("features", self.features.stats()))
            if self.features.writer is not None:
                groups.append(("features.writer", self.features.writer.counters))
        if self.generations is not None:
            groups.append(("generate", {"background_tasks": self.generations.background_tasks}))
            for (model, version), runtime in self.generations.runtimes.items():
                name, counters = runtime.stat_group()
                if counters:
                    groups.append((name, counters))
                if runtime.prefix is not None:
                    held = {f"{tier}_bytes": held for tier, held in runtime.prefix.gauges().items()}
                    groups.append((f"prefix.{model}.{version}", {**runtime.prefix.counters, **held}))
        if self.kv_store is not None:
            groups.append(("kv", self.kv_store.counters))
        if self.fleet is not None:
            gauges = {"ready": int(self.fleet.ready), "breaker_open": int(self.fleet.link.open),
                      "pending_writes": len(self.fleet.pending)}
            groups.append(("fleet", {**self.fleet.counters, **gauges}))
        return groups

    async def close(self) -> None:
        if self.matching.shadow is not None:  # (first: its regenerations end as checks, not as failures)
            await self.matching.shadow.close()
        if self.generations is not None:
            await self.generations.close()
        for runtime in self.runtimes.values():
            await runtime.batcher.close()
        await asyncio.gather(*self.flights.pending(), return_exceptions=True)
        if self.fleet is not None:
            await self.fleet.close()
