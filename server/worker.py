"""Inference worker: one per device (here: the CPU).

Frontends send it what missed L1, over gRPC on a unix socket. It joins identical in-flight requests
(coalescing), batches them per model, runs the engine off the event loop, replies, and then hands
the result to the write-behind thread. It is the only process that writes the store.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np

from cachestore import records
from cachestore.env import Store
from cachestore.errors import StoreError
from cachestore.keys import NS_ID_BYTES, Namespace, parse_hex_key
from cachestore.results import ResultCache, now_us
from cachestore.semantic import SemanticEntry
from cachestore.writer import Selector, WriteBehind
from infercache.v1 import infercache_pb2 as pb
from infercache.v1 import worker_pb2, worker_pb2_grpc
from server import metrics, process
from server.batcher import Batcher
from server.config import Config, store_settings
from server.engines.artifacts import load_engines, model_profiles
from server.engines.base import Engine
from server.errors import ModelNotFound, WorkerUnavailable, grpc_errors
from server.match_policy import Neighbor
from server.models import LABELS_FILE, TOKENIZER_FILE, ModelRepository, ModelSpec
from server.semantic import SemanticTier
from server.tokenization import TextEncoder, pad_batch

log = logging.getLogger("infercache.worker")

Source = pb.CacheInfo.Source


class ModelRuntime:
    """One loaded model version: tokenizer, engine (from the L3 store) and its batcher."""

    def __init__(self, spec: ModelSpec, version: str, engine: Engine, config: Config) -> None:
        self.spec = spec
        self.version = version
        self.encoder = TextEncoder(spec.version_dir(version) / TOKENIZER_FILE, spec.max_tokens)
        self.engine = engine
        labels_path = spec.version_dir(version) / LABELS_FILE
        self.labels: list[str] = json.loads(labels_path.read_text()) if spec.task == "classification" else []
        self.batcher = Batcher(
            self._run_batch, buckets=spec.buckets, max_batch=spec.max_batch_size,
            max_delay_s=spec.max_queue_delay_ms / 1000, max_queue=config.server.max_queue,
            name=f"{spec.name}-{version}",
        )

    def _run_batch(self, sequences: list[list[int]]) -> list[dict[str, np.ndarray]]:
        outputs = self.engine.run(pad_batch(sequences, max(len(s) for s in sequences)))
        return [{name: values[row] for name, values in outputs.items()} for row in range(len(sequences))]

    def response(self, outputs: dict[str, np.ndarray], key: bytes) -> pb.InferResponse:
        response = pb.InferResponse(outputs=to_tensors({name: outputs[name] for name in self.spec.outputs}),
                                    cache=pb.CacheInfo(model_version=self.version, key=key.hex()))
        if self.labels:
            scores = outputs["scores"]
            best = int(np.argmax(scores))
            response.classification.label = self.labels[best]
            response.classification.probability = float(scores[best])
        return response

    def output_dim(self, name: str) -> int:
        return int(self._run_batch([self.encoder.encode("dimension")])[0][name].shape[-1])

    def warmup(self) -> None:
        """One batch per profile before the worker reports ready (TensorRT initializes lazily)."""
        cls, sep = self.encoder.encode("")[:1] or [0], self.encoder.encode("")[-1:] or [0]
        for profile in model_profiles(self.spec):
            self._run_batch([cls + [sep[0]] * (profile.max_seq - 1)])


@dataclass(eq=False)
class _Flight:
    """One computation that identical concurrent requests share."""

    task: asyncio.Task
    waiters: int = 0
    stored: bool = False
    created_us: int = field(default_factory=now_us)


@dataclass(frozen=True)
class _Outcome:
    """What a flight produced: a computed response (with the query's embedding when the model matches
    semantically), or a cached near-duplicate's response and record."""

    response: pb.InferResponse
    embedding: np.ndarray | None = None
    matched: records.Record | None = None


def to_tensors(outputs: dict[str, np.ndarray]) -> list[pb.Tensor]:
    return [
        pb.Tensor(name=name, dtype=str(array.dtype), shape=array.shape, data=np.ascontiguousarray(array).tobytes())
        for name, array in outputs.items()
    ]


def _call_soon(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    """From another thread; a loop that already closed (shutdown) has nothing left to update."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        pass


class WorkerCore:
    """Transport-free worker logic; WorkerServicer is a thin gRPC shell over it."""

    def __init__(self, repository: ModelRepository, runtimes: dict[tuple[str, str], ModelRuntime],
                 writer: WriteBehind | None, semantic: SemanticTier | None = None) -> None:
        self.repository = repository
        self.runtimes = runtimes
        self.writer = writer
        self.semantic = semantic
        self.cache = ResultCache(writer.store) if writer is not None else None
        self.counters: Counter[str] = Counter()
        self._inflight: dict[bytes, _Flight] = {}

    def runtime(self, model: str, version: str) -> ModelRuntime:
        runtime = self.runtimes.get((model, version))
        if runtime is None:
            self.repository.get(model).resolve_version(version)  # the precise NOT_FOUND message
            raise ModelNotFound(f"model {model!r} version {version!r} is not loaded by this worker")
        return runtime

    async def compute(self, request: worker_pb2.ComputeRequest, deadline: float | None) -> pb.InferResponse:
        runtime = self.runtime(request.model, request.version)
        key = request.key
        flight = self._inflight.get(key)
        if flight is None and request.cached_ok and self.cache is not None:
            max_age = request.max_age_us if request.HasField("max_age_us") else None
            if (cached := self.cache.lookup(key, max_age)) is not None:
                self.counters["late_hit"] += 1  # committed after the frontend looked
                return cached
        joined = flight is not None
        if flight is None:
            task = asyncio.get_running_loop().create_task(self._run(runtime, request, deadline))
            flight = self._inflight[key] = _Flight(task)
            task.add_done_callback(lambda t, f=flight: self._forget_failed(t, f, key))
        flight.waiters += 1
        try:
            outcome: _Outcome = await asyncio.shield(flight.task)
        finally:
            flight.waiters -= 1
            if flight.waiters == 0 and not flight.task.done():
                flight.task.cancel()  # nobody wants it any more: the batcher drops it before the engine
        self.counters["coalesced" if joined else ("semantic_hits" if outcome.matched else "computed")] += 1
        if request.store and not flight.stored and self.writer is not None:
            # The flight stays joinable until its entry is committed: a request that missed L1 in the
            # meantime joins it instead of computing the same thing again.
            flight.stored = True
            self._store(request, runtime, flight, outcome)
        elif flight.waiters == 0 and not flight.stored:
            self._forget(flight, key)
        reply = pb.InferResponse()
        reply.CopyFrom(outcome.response)
        if not outcome.matched:
            reply.cache.source = Source.COALESCED if joined else Source.MISS
        return reply

    def _store(self, request, runtime: ModelRuntime, flight: _Flight, outcome: _Outcome) -> None:
        key, loop = request.key, asyncio.get_running_loop()
        ns = Namespace(request.tenant, request.model, request.version)
        done = lambda f=flight: _call_soon(loop, self._forget, f, key)  # noqa: E731
        if outcome.matched is not None:
            # An exact alias of the matched entry: the same text next time is a frontend RESULT_EXACT.
            self.writer.put(key, ns, outcome.matched, on_done=done)
            return
        stored = pb.InferResponse()
        stored.CopyFrom(outcome.response)
        del stored.cache.neighbors[:]
        ttl_us = runtime.spec.ttl_s * 1_000_000
        record = records.Record(flight.created_us, flight.created_us + ttl_us, stored.SerializeToString())
        entry = None
        if outcome.embedding is not None:
            entry = SemanticEntry(key[:NS_ID_BYTES], outcome.response.classification.label, outcome.embedding)
        self.writer.put(key, ns, record, on_done=done, semantic=entry)

    def _forget_failed(self, task: asyncio.Task, flight: _Flight, key: bytes) -> None:
        if task.cancelled() or task.exception() is not None:
            self._forget(flight, key)

    def _forget(self, flight: _Flight, key: bytes) -> None:
        if self._inflight.get(key) is flight:
            del self._inflight[key]

    async def _run(self, runtime: ModelRuntime, request, deadline: float | None) -> _Outcome:
        embedding, neighbors = None, []
        policy = runtime.spec.semantic
        overrides = request.semantic
        lookup = not overrides.HasField("enabled") or overrides.enabled
        if policy is not None and self.semantic is not None and (lookup or request.store):
            # Stored results join the index even when this request does not look it up.
            embedder = self.runtime(policy.embedder, self.repository.get(policy.embedder).serving_version)
            embedding = (await embedder.batcher.submit(embedder.encoder.encode(request.text), deadline))["embedding"]
        if embedding is not None and lookup:
            neighbors = await self.semantic.search(request.key[:NS_ID_BYTES], embedding, max(policy.k, 5))
            floor = overrides.min_similarity if overrides.HasField("min_similarity") else None
            chosen = policy.decide(neighbors, floor) if request.cached_ok else None
            matched = self._matched(chosen, request, neighbors) if chosen is not None else None
            if matched is not None:
                return matched
        outputs = await runtime.batcher.submit(runtime.encoder.encode(request.text), deadline)
        response = runtime.response(outputs, request.key)
        self._explain(response, request, neighbors)
        return _Outcome(response, embedding)

    def _matched(self, chosen: Neighbor, request, neighbors: list[Neighbor]) -> _Outcome | None:
        """The chosen neighbour's entry as a RESULT_SEMANTIC answer, if it is still fresh."""
        max_age = request.max_age_us if request.HasField("max_age_us") else None
        found = self.cache.answer(chosen.key, max_age, Source.RESULT_SEMANTIC) if self.cache is not None else None
        if found is None:
            return None  # expired or gone since it was indexed: compute instead
        record, response = found
        response.cache.similarity = chosen.similarity
        self._explain(response, request, neighbors)
        return _Outcome(response, matched=record)

    def _explain(self, response: pb.InferResponse, request, neighbors: list[Neighbor]) -> None:
        if request.semantic.explain:
            response.cache.neighbors.extend(
                pb.Neighbor(similarity=n.similarity, answer=n.answer) for n in neighbors
            )

    async def invalidate(self, request: pb.InvalidateRequest) -> int:
        if self.writer is None:
            raise WorkerUnavailable("the result store is unavailable on this host; nothing to invalidate")
        selector = Selector(
            tenant=request.tenant if (request.tenant or request.match_empty_tenant) else None,
            model=request.model or None,
            version=request.version or None,
            key=parse_hex_key(request.key) if request.key else None,
        )
        return await asyncio.wrap_future(self.writer.invalidate(selector))

    def stats(self) -> pb.ProcessStats:
        groups = [("worker", self.counters)]
        for (model, version), runtime in self.runtimes.items():
            batcher = runtime.batcher
            groups.append((f"batcher.{model}.{version}", batcher.counters + Counter(queue_depth=batcher.depth)))
        if self.writer is not None:
            groups.append(("writer", self.writer.counters))
        if self.semantic is not None:
            groups.append(("semantic", self.semantic.counters))
        return metrics.process_stats("worker", *groups)

    async def close(self) -> None:
        for runtime in self.runtimes.values():
            await runtime.batcher.close()
        await asyncio.gather(*(f.task for f in list(self._inflight.values())), return_exceptions=True)


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, core: WorkerCore) -> None:
        self.core = core

    @grpc_errors
    async def Compute(self, request, context):
        remaining = context.time_remaining()
        deadline = None if remaining is None else asyncio.get_running_loop().time() + remaining
        return await self.core.compute(request, deadline)

    @grpc_errors
    async def Invalidate(self, request, context):
        return pb.InvalidateResponse(removed=await self.core.invalidate(request))

    @grpc_errors
    async def Stats(self, request, context):
        return self.core.stats()


def _open_writer(config: Config) -> WriteBehind | None:
    try:
        store = Store(store_settings(config), readonly=False)
    except StoreError as exc:
        log.error("result store unavailable, serving without it: %s", exc)
        return None
    return WriteBehind(store, batch_max=config.cache.write_batch, sweep_interval_s=config.cache.sweep_interval_s)


def _semantic_tier(config: Config, repository: ModelRepository, runtimes: dict[tuple[str, str], ModelRuntime],
                   writer: WriteBehind | None) -> SemanticTier | None:
    """The semantic tier when a served model asks for it and its embedder is served too; its indexes
    are rebuilt in the background (requests are served meanwhile)."""
    policies = [spec.semantic for spec in repository.servable() if spec.semantic is not None]
    if not policies or writer is None:
        return None
    dims = set()
    for policy in policies:
        embedder = repository.models.get(policy.embedder)
        runtime = runtimes.get((policy.embedder, embedder.serving_version)) if embedder else None
        if runtime is None or "embedding" not in runtime.spec.outputs:
            log.error("semantic matching off: embedder model %r is not served (or has no 'embedding' output)",
                      policy.embedder)
            return None
        dims.add(runtime.output_dim("embedding"))
    if len(dims) != 1:
        log.error("semantic matching off: embedders of different dimensions %s", sorted(dims))
        return None
    tier = SemanticTier(writer.store, Path(config.cache.dir) / "semantic", dims.pop())
    writer.on_semantic = tier.apply
    tier.start()
    return tier


async def _serve(config: Config, socket_path: Path, ready, stop: asyncio.Event) -> None:
    repository = ModelRepository(Path(config.server.models_dir))
    engine_counters: Counter[str] = Counter()
    engines = await asyncio.to_thread(load_engines, config, repository, engine_counters)
    runtimes = {}
    for (name, version), engine in engines.items():
        runtimes[(name, version)] = runtime = ModelRuntime(repository.get(name), version, engine, config)
        await asyncio.to_thread(runtime.warmup)
    writer = await asyncio.to_thread(_open_writer, config)
    tier = _semantic_tier(config, repository, runtimes, writer)
    core = WorkerCore(repository, runtimes, writer, tier)
    core.counters.update(engine_counters)
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServicer_to_server(WorkerServicer(core), server)
    socket_path.unlink(missing_ok=True)  # left behind by a worker that was killed
    server.add_insecure_port(f"unix:{socket_path}")
    await server.start()
    ready.put(("worker", 0, os.getpid()))
    log.info("worker ready on unix:%s (pid %d)", socket_path, os.getpid())
    await stop.wait()
    log.info("draining")
    await server.stop(config.server.drain_s)
    await core.close()
    if writer is not None:
        await asyncio.to_thread(writer.close)  # the last writes reach the index before its snapshot
    if tier is not None:
        await tier.close()
    log.info("worker stopped")


def main(config: Config, socket_path: str, ready) -> None:
    """Entry point of the spawned worker process."""
    process.setup_logging(config.server.log_level, "worker")
    process.run(lambda stop: _serve(config, Path(socket_path), ready, stop))
