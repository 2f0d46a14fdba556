"""Frontend process: the public gRPC API.

Several frontends listen on one port (SO_REUSEPORT) and do the per-request CPU work in parallel:
validate, normalize, derive the key, read L1. A fresh hit is answered here; everything else goes to
the inference worker over a unix socket. Frontends never write the store.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from collections import Counter
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from cachestore.env import Store
from cachestore.errors import StoreError
from cachestore.keys import entry_key, namespace_id, parse_hex_key
from cachestore.results import ResultCache
from infercache.v1 import infercache_pb2 as pb
from infercache.v1 import infercache_pb2_grpc, worker_pb2, worker_pb2_grpc
from server import metrics, process
from server.config import Config, store_settings
from server.errors import InvalidArgument, NotCached, WorkerUnavailable, from_worker_error, grpc_errors
from server.models import ModelRepository, ModelSpec
from server.normalize import Normalizer

log = logging.getLogger("infercache.frontend")

Mode = pb.CachePolicy.Mode
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["InferenceCache"].full_name
_ns_id = functools.lru_cache(maxsize=4096)(namespace_id)  # a blake2b per request saved on the hot path
STORE_RETRY_S = 1.0  # a fresh store appears once the worker has created it


class WorkerClient:
    """The frontend's channel to the inference worker. Fails fast with UNAVAILABLE while it is down."""

    def __init__(self, socket_path: Path, *, wait_s: float, default_timeout_s: float) -> None:
        self.channel = grpc.aio.insecure_channel(
            f"unix:{socket_path}",
            options=[
                # Reconnect quickly after a worker restart (gRPC's default backoff grows to minutes).
                ("grpc.initial_reconnect_backoff_ms", 50),
                ("grpc.min_reconnect_backoff_ms", 50),
                ("grpc.max_reconnect_backoff_ms", 500),
            ],
        )
        self.stub = worker_pb2_grpc.WorkerStub(self.channel)
        self.wait_s = wait_s
        self.default_timeout_s = default_timeout_s

    async def _connected(self, budget: float) -> None:
        if self.channel.get_state(try_to_connect=True) == grpc.ChannelConnectivity.READY:
            return
        try:
            await asyncio.wait_for(self.channel.channel_ready(), max(0.0, min(self.wait_s, budget)))
        except TimeoutError:
            raise WorkerUnavailable("inference worker is not reachable (restarting?); retry") from None

    async def call(self, method: str, request, time_remaining: float | None):
        timeout = self.default_timeout_s if time_remaining is None else min(time_remaining, self.default_timeout_s)
        # Keep a margin so the client hears UNAVAILABLE before its own deadline fires.
        await self._connected(timeout - 0.05 if time_remaining is not None else timeout)
        try:
            return await getattr(self.stub, method)(request, timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            raise from_worker_error(exc.code(), exc.details() or "") from None

    async def close(self) -> None:
        await self.channel.close()


class FrontendCore:
    """Transport-free request handling: validation, normalization, keys, L1, forwarding misses."""

    def __init__(self, config: Config, repository: ModelRepository, worker: WorkerClient) -> None:
        self.config = config
        self.repository = repository
        self.worker = worker
        self.normalize = Normalizer()
        self.counters: Counter[str] = Counter()
        self._cache: ResultCache | None = None
        self._cache_retry_at = 0.0
        self._cache_warn_at = 0.0

    def l1(self) -> ResultCache | None:
        """The result cache, opened on first use and re-tried while the store is unavailable."""
        if self._cache is None and time.monotonic() >= self._cache_retry_at:
            try:
                self._cache = ResultCache(Store(store_settings(self.config), readonly=True))
            except StoreError as exc:
                now = time.monotonic()
                self._cache_retry_at = now + STORE_RETRY_S
                if now >= self._cache_warn_at:  # a fresh store appears shortly; a broken one warns every 30 s
                    self._cache_warn_at = now + 30
                    log.warning("result cache unavailable, serving misses until it opens: %s", exc)
        return self._cache

    def _keyed(self, tenant: str, spec: ModelSpec, version: str, text: str) -> tuple[str, bytes]:
        """(normalized text, cache key) of a request's text; INVALID_ARGUMENT when unusable."""
        if len(text) > spec.max_text_chars:
            raise InvalidArgument(f"text has {len(text)} characters; this model accepts at most {spec.max_text_chars}")
        normalized = self.normalize(text)
        if not normalized:
            raise InvalidArgument("text is empty (or only punctuation and whitespace); send the text to run")
        return normalized, entry_key(_ns_id(tenant, spec.name, version), normalized)

    async def infer(self, request: pb.InferRequest, time_remaining: float | None) -> pb.InferResponse:
        if not request.model:
            raise InvalidArgument("model is required; ListModels shows the served models")
        spec = self.repository.get(request.model)
        version = spec.resolve_version(request.version)
        mode = request.cache.mode
        if mode not in Mode.values():
            raise InvalidArgument(f"cache.mode {mode} is not one of {sorted(Mode.keys())}")
        if request.semantic.HasField("min_similarity") and not 0.0 <= request.semantic.min_similarity <= 1.0:
            raise InvalidArgument(f"semantic.min_similarity must be within 0..1, got {request.semantic.min_similarity}")
        text, key = self._keyed(request.tenant, spec, version, request.text)
        cached_at_all = spec.ttl_s > 0

        cached_ok = mode != Mode.BYPASS and cached_at_all
        max_age = request.cache.max_age_s * 1_000_000 if request.cache.HasField("max_age_s") else None
        if cached_ok and (cache := self.l1()) is not None:
            response = cache.lookup(key, max_age)
            if response is not None:
                self.counters["hit_exact"] += 1
                return response
        if mode == Mode.ONLY_IF_CACHED:
            self.counters["not_cached"] += 1
            raise NotCached("no fresh cached entry for this input (cache.mode is ONLY_IF_CACHED)")
        self.counters["forwarded"] += 1
        compute = worker_pb2.ComputeRequest(
            model=spec.name, version=version, tenant=request.tenant, text=text, key=key,
            store=cached_at_all and mode != Mode.NO_STORE, cached_ok=cached_ok, max_age_us=max_age,
            semantic=request.semantic,
        )
        return await self.worker.call("Compute", compute, time_remaining)

    async def invalidate(self, request: pb.InvalidateRequest, time_remaining: float | None) -> pb.InvalidateResponse:
        if not (request.model or request.version or request.tenant or request.match_empty_tenant
                or request.text or request.key):
            raise InvalidArgument("set at least one of model, version, tenant, match_empty_tenant, text, key")
        if (request.version or request.text) and not request.model:
            raise InvalidArgument("version and text select within a model; set model too")
        forwarded = pb.InvalidateRequest()
        forwarded.CopyFrom(request)
        if request.key:
            try:
                parse_hex_key(request.key)
            except ValueError as exc:
                raise InvalidArgument(str(exc)) from None
        if request.text:
            spec = self.repository.get(request.model)
            version = spec.resolve_version(request.version)
            _, key = self._keyed(request.tenant, spec, version, request.text)
            if request.key and request.key != key.hex():
                raise InvalidArgument("text and key name different entries; set one of them")
            forwarded.key, forwarded.text = key.hex(), ""
        return await self.worker.call("Invalidate", forwarded, time_remaining)

    async def stats(self) -> pb.GetStatsResponse:
        response = pb.GetStatsResponse(frontend=metrics.process_stats("frontend", ("frontend", self.counters)))
        try:
            response.worker.CopyFrom(await self.worker.call("Stats", pb.GetStatsRequest(), 1.0))
        except WorkerUnavailable as exc:
            log.info("worker stats unavailable: %s", exc)
        cache = self.l1()
        if cache is not None:
            response.store.CopyFrom(pb.StoreStats(**cache.store.stats()))
        return response

    def list_models(self) -> pb.ListModelsResponse:
        return pb.ListModelsResponse(models=[
            pb.ModelInfo(
                name=m.name, serving_version=m.serving_version, versions=m.versions, task=m.task,
                outputs=m.outputs, max_text_chars=m.max_text_chars, buckets=m.buckets, ttl_s=m.ttl_s,
            )
            for m in self.repository.servable()
        ])


class FrontendServicer(infercache_pb2_grpc.InferenceCacheServicer):
    def __init__(self, core: FrontendCore) -> None:
        self.core = core

    @grpc_errors
    async def Infer(self, request, context):
        return await self.core.infer(request, context.time_remaining())

    @grpc_errors
    async def Invalidate(self, request, context):
        return await self.core.invalidate(request, context.time_remaining())

    @grpc_errors
    async def GetStats(self, request, context):
        return await self.core.stats()

    @grpc_errors
    async def ListModels(self, request, context):
        return self.core.list_models()


async def _serve(config: Config, index: int, socket_path: Path, ready, stop: asyncio.Event) -> None:
    repository = ModelRepository(Path(config.server.models_dir))
    worker = WorkerClient(socket_path, wait_s=config.server.worker_wait_s,
                          default_timeout_s=config.server.worker_timeout_s)
    core = FrontendCore(config, repository, worker)
    core.l1()
    server = grpc.aio.server(options=[("grpc.so_reuseport", 1)])
    infercache_pb2_grpc.add_InferenceCacheServicer_to_server(FrontendServicer(core), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    address = f"{config.server.host}:{config.server.port}"
    if server.add_insecure_port(address) == 0:
        raise SystemExit(f"frontend {index}: cannot listen on {address}")
    await server.start()

    async def serving_once_worker_is_up() -> None:
        # Hits are answered from the start; health says SERVING once misses can be computed too
        # (the worker opens its socket only after loading and warming up every engine).
        await worker.channel.channel_ready()
        for service in ("", SERVICE_NAME):
            await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)

    for service in ("", SERVICE_NAME):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
    health_task = asyncio.get_running_loop().create_task(serving_once_worker_is_up())
    ready.put(("frontend", index, os.getpid()))
    log.info("frontend %d listening on %s (pid %d)", index, address, os.getpid())
    await stop.wait()
    log.info("draining")
    health_task.cancel()
    await health_servicer.enter_graceful_shutdown()
    await server.stop(config.server.drain_s)
    await worker.close()
    log.info("frontend stopped")


def main(config: Config, index: int, socket_path: str, ready) -> None:
    """Entry point of a spawned frontend process."""
    process.setup_logging(config.server.log_level, f"frontend-{index}")
    process.run(lambda stop: _serve(config, index, Path(socket_path), ready, stop))
