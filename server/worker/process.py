"""Inference worker process: one per device (each GPU, or the CPU).

Frontends reach it over two unix sockets of its own: items (one connection per frontend, length-prefixed
frames carrying micro-batches of tokenized items in and of answers out: server/worker/connections.py) and
gRPC for Invalidate and Stats. The core (server/worker/core.py) joins, batches and runs the items; this module is the
shell around it and the process start-up: pin the device, load every engine from the L3 store, warm
up, open the store, start the semantic tier.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import Counter
from pathlib import Path
from typing import Callable

import grpc
import numpy as np

from cachestore.env import FILE_MODE, StoreSettings
from cachestore.errors import StoreError
from infercache.v1 import infercache_pb2 as pb
from infercache.v1 import worker_pb2_grpc
from server.worker.semantic import calibration
from server.shared import process, telemetry
from server.shared.stats import process_stats
from server import mps
from server.worker.connections import Connection, Frontends
from server.worker.core import WorkerCore
from server.config import Config, feature_store_settings, kv_store_settings, store_settings
from server.shared.devices import WorkerPlacement
from server.engines.artifacts import get_runtime, load_engines
from server.shared.errors import grpc_errors
from server.shared.framing import items_socket
from server.worker.store.features import FeatureTier
from server.worker.generation.decoders import open_decoder, prefix_cache
from server.worker.generation.scheduler import GenerativeRuntime
from server.worker.semantic.heads import HeadRuntime
from server.worker.model_runtime import ModelRuntime
from server.shared.models import ModelConfigError, ModelRepository
from server.worker.metrics import WorkerMetrics
from server.worker.startup import StartupProfile
from server.worker.store.writer import WriterProcess

log = logging.getLogger("infercache.worker")


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, core: WorkerCore, placement: WorkerPlacement, startup: StartupProfile) -> None:
        self.core = core
        self.placement = placement
        self.startup = startup

    @grpc_errors
    async def Invalidate(self, request, context):
        return pb.InvalidateResponse(removed=await self.core.invalidate(request))

    @grpc_errors
    async def Stats(self, request, context):
        stats = process_stats("worker", *self.core.stat_groups())
        stats.index, stats.device = self.placement.index, self.placement.device
        stats.start_seconds.update(self.startup.phases)
        for runtime in self.core.runtimes.values():
            info = stats.engines.add()
            info.CopyFrom(runtime.info)
            info.warmup_seconds.update(runtime.phases())
        if self.core.generations is not None:
            stats.engines.extend(runtime.info for runtime in self.core.generations.runtimes.values())
        return stats


async def _open_writer(config: Config, role: str, on_lost: Callable[[], None], settings: StoreSettings | None = None,
                       what: str = "result store") -> WriterProcess | None:
    """The store's writer, in a process of its own (server/worker/store/writer.py); None when the store cannot
    be opened (served without it). A writer process that dies is started again at once; one given up
    (on_lost) stops this worker, which the supervisor restarts."""
    try:
        return await WriterProcess.start(
            settings or store_settings(config), batch_max=config.cache.write_batch,
            sweep_interval_s=config.cache.sweep_interval_s, max_ttl_s=config.cache.max_ttl_s, what=what,
            log_level=config.server.log_level, role=role, on_lost=on_lost,
            group_commit_s=config.cache.group_commit_ms / 1000)
    except StoreError as exc:
        log.error("%s unavailable, serving without it: %s", what, exc)
        return None


def _semantic_tier(config: Config, repository: ModelRepository, runtimes: dict[tuple[str, str], ModelRuntime],
                   writer: WriterProcess | None, index: int):
    """The semantic tier when a served model asks for it and its embedder is served too; its indexes
    are rebuilt in the background (requests are served meanwhile). hnswlib is imported only here."""
    policies = [spec.semantic for spec in repository.servable() if spec.semantic is not None]
    policies += [spec.answer_match.rule for spec in repository.servable() if spec.answer_match is not None]
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
    from server.worker.semantic.semantic_index import SemanticTier

    # Each worker keeps its own indexes (frontends route a semantic model's namespace to one worker).
    snapshots = Path(config.cache.dir) / "semantic" / f"worker-{index}"
    tier = SemanticTier(writer.store, snapshots, dims.pop())
    writer.on_semantic = tier.apply
    writer.on_store.append(tier.use_store)
    tier.start()
    return tier


_SAMPLES = ("how do i reset my card pin", "My transfer hasn't arrived yet, what should I do?",
            "Is there a fee for topping up by card?", "x", "What currencies can I hold in my account and "
            "exchange between, and at which rate do you exchange them on weekends?")


def _feature_memory(config: Config, placement: WorkerPlacement) -> tuple[str | None, int]:
    """Where the feature tier's memory level lives and its cap: this worker's share of l2.device_fraction
    of its GPU when torch can reach it (a TensorRT-only host has no torch: host memory then), else
    l2.memory_mb of host memory."""
    if placement.gpu is not None:
        try:
            import torch

            if torch.cuda.is_available():
                total = torch.cuda.get_device_properties(0).total_memory
                return "cuda", int(config.l2.device_fraction * total / placement.sharing)
        except ImportError:
            log.info("no torch on this GPU host: the feature tier's memory level is in host memory")
    return None, config.l2.memory_mb << 20


async def _heads(config: Config, repository: ModelRepository, runtimes: dict[tuple[str, str], ModelRuntime],
                 placement: WorkerPlacement, on_lost: Callable[[], None]
                 ) -> tuple[dict[tuple[str, str], HeadRuntime], FeatureTier | None]:
    """A runtime for every head version whose encoder this worker serves, and the feature tier they
    share (memory on the GPU when there is one, the LMDB store beside the result store). A head that
    cannot be served is logged and left out; the other models are served."""
    found = []  # (spec, version, ref, encoder runtime)
    samples: dict[tuple[str, str, str], np.ndarray] = {}  # encoder outputs heads read: some of their values
    for spec in repository.servable():
        for version in spec.versions:
            try:
                if (ref := spec.head(version)) is None:
                    continue
                encoder = runtimes.get((ref.encoder, ref.encoder_version))
                if encoder is None or ref.input not in encoder.spec.outputs:
                    raise ModelConfigError(f"its encoder {ref.encoder}/{ref.encoder_version} (output {ref.input!r}) "
                                           "is not served")
                source = (ref.encoder, ref.encoder_version, ref.input)
                if source not in samples:
                    rows = await asyncio.to_thread(encoder._run_batch, [encoder.encoder.encode(t) for t in _SAMPLES])
                    samples[source] = np.stack([np.asarray(row[ref.input]).reshape(-1) for row in rows])
                found.append((spec, version, ref, encoder))
            except (ModelConfigError, OSError, ValueError) as exc:
                log.error("%s version %s not served: %s", spec.name, version, exc)
    if not found:
        return {}, None
    device, memory = _feature_memory(config, placement)
    heads: dict[tuple[str, str], HeadRuntime] = {}
    for spec, version, ref, encoder in found:
        try:
            dim = samples[(ref.encoder, ref.encoder_version, ref.input)].shape[1]
            heads[(spec.name, version)] = HeadRuntime(spec, version, ref, encoder, dim, config, device)
        except (ModelConfigError, OSError, ValueError) as exc:
            log.error("%s version %s not served: %s", spec.name, version, exc)
    writer = None
    if config.l2.enabled:
        writer = await _open_writer(config, f"worker-{placement.index}-features", on_lost, feature_store_settings(config),
                                    "feature store (L2)")
    else:
        memory = 0
    ttl_s = min((t for t in (config.l2.ttl_s, config.cache.max_ttl_s) if t), default=0)
    index = (config.l2.memory_mb << 20) if config.l2.enabled else 0
    tier = FeatureTier(writer, ttl_s=ttl_s, memory_bytes=memory, index_bytes=index, device=device,
                       ttl_jitter=config.cache.ttl_jitter)
    for source, rows in samples.items():
        tier.add_encoder(source, rows)
    return heads, tier


def _fleet_tier(config: Config, writer: WriterProcess | None, index: int, socket_dir: Path):
    """The fleet tier when `fleet.redis` is set (redis-py is imported only then). Each worker purges
    other pods' invalidations through its own writer (which then refuses entries created before them);
    worker 0 keeps the generations the host's L1 reflects, and the pod's key filter (in the socket folder,
    server/fleet/key_filter.py)."""
    if not config.fleet.redis:
        return None
    from server.fleet import tier

    keeper = index == 0 and writer is not None
    return tier.start(config, purge=writer.invalidate if writer is not None else None,
                      state_path=Path(config.cache.dir) / "fleet-generations.json" if keeper else None,
                      filter_dir=socket_dir, filter_role="owner" if index == 0 else "publisher")


def _open_block_store(config: Config):
    """The prefix cache's disk tier (server/worker/prefix/prefix_disk.py); None (logged) when it cannot be opened:
    prefix caches then keep to memory."""
    from server.worker.prefix.prefix_disk import BlockStore

    try:
        return BlockStore(kv_store_settings(config), min((t for t in (config.kv.ttl_s, config.cache.max_ttl_s) if t),
                                                         default=0), queue_bytes=config.kv.write_queue_mb << 20)
    except StoreError as exc:
        log.error("prefix block store unavailable, prefix caches keep to memory: %s", exc)
        return None


def _generative(repository: ModelRepository, threads: int, gpu: bool, kv_store) -> dict[tuple[str, str], GenerativeRuntime]:
    """A runtime for every version of the served generative models (server/worker/generation/decoders.py picks
    each one's decoder), with its prefix cache; one that cannot be loaded is logged and left out."""
    found = {}
    for spec in repository.servable():
        if spec.task != "generate" or spec.upstream is not None:
            continue
        for version in spec.versions:
            started = time.monotonic()
            try:
                decoder = open_decoder(spec, version, threads, gpu)
                prefix = prefix_cache(spec, version, decoder, gpu, kv_store)
                found[(spec.name, version)] = GenerativeRuntime(spec, version, decoder, prefix)
            except Exception as exc:  # noqa: BLE001 (whatever a broken version's files raise)
                log.error("%s version %s not served: %s", spec.name, version, exc)
                continue
            log.info("loaded %s version %s (decoder on %s, %s, %s) in %.2f s", spec.name, version, decoder.runtime,
                     decoder.precision, decoder.device, time.monotonic() - started)
    return found


def _engine_threads(config: Config, cpu_workers: int) -> int:
    return config.server.engine_threads or max(1, (os.cpu_count() or 1) // max(1, cpu_workers))


def _phases_text(runtimes) -> str:
    """"minilm 1: load 0.46 s, warmup 0.37 s; ..." for the log."""
    return "; ".join(f"{r.spec.name} {r.version}: " + ", ".join(f"{phase} {seconds:.2f} s" for phase, seconds in
                                                                r.phases().items()) for r in runtimes)


async def _at_full_speed(startup: StartupProfile, encoders: list[ModelRuntime]) -> None:
    """Marks (and logs) when every engine runs at full speed (its CUDA graphs captured behind traffic)."""
    while any(runtime.engine.warm_since() is None for runtime in encoders):
        await asyncio.sleep(0.05)
    at = max([startup.started + startup.phases["ready"], *(r.engine.warm_since() or 0.0 for r in encoders)])
    log.info("at full speed %.2f s after its start (%s)", startup.mark("warm", at), _phases_text(encoders))


def _upstreams(config: Config, repository: ModelRepository) -> dict[tuple[str, str], object]:
    """A runtime for every servable version of a model computed upstream (its credential read now, once):
    an encoder's ModelRuntime, or a generative model's (Generations runs it); one whose credential cannot be
    read is logged and left out (the supervisor checks them at start)."""
    from server.worker.upstream.credentials import read_credential
    from server.worker.upstream.generative import UpstreamGenerativeRuntime
    from server.worker.upstream.runtime import UpstreamRuntime

    found = {}
    for spec in repository.servable():
        if spec.upstream is None:
            continue
        try:
            credential = read_credential(spec.name, spec.upstream)
        except ModelConfigError as exc:
            log.error("%s not served: %s", spec.name, exc)
            continue
        for version in spec.versions:
            found[(spec.name, version)] = (UpstreamGenerativeRuntime(spec, version, credential) if spec.task == "generate"
                                           else UpstreamRuntime(spec, version, config, credential))
    return found


async def _warm(runtime: ModelRuntime) -> None:
    started = time.monotonic()
    await asyncio.to_thread(runtime.warmup)
    runtime.warmup_s = time.monotonic() - started


def _publisher(core: WorkerCore, placement: WorkerPlacement, startup: StartupProfile,
               metrics_dir: Path | None) -> telemetry.Publisher | None:
    """What publishes this worker's /metrics figures, when /metrics is on."""
    if metrics_dir is None:
        return None
    path = telemetry.snapshot_path(metrics_dir, "worker", placement.index)
    core.metrics = telemetry.Recorder()  # the core records into it as it serves
    figures = WorkerMetrics(core, placement, startup, telemetry.predecessor(path))
    return telemetry.Publisher(path, figures.snapshot, figures.refresh_store_gauges)


async def _serve(config: Config, placement: WorkerPlacement, cpu_workers: int, socket_path: Path, ready,
                 stop: asyncio.Event, metrics_dir: Path | None, startup: StartupProfile) -> None:
    nice = config.server.cpu_worker_nice if placement.gpu is None else 0
    if nice:
        # On shared cores the engine's batches take the CPUs for milliseconds; a frontend's hit or
        # refusal needs them for microseconds and should not wait behind them. The engine's threads, the
        # work done off the loop (loading, warmups) and what that starts (ONNX Runtime's thread pools)
        # run `nice` steps nicer. The event loop (admission, refusals, answers), gRPC's threads, the
        # semantic index's thread (its searches answer lookups) and the writer processes (they answer
        # Invalidate) keep the frontends' priority.
        asyncio.get_running_loop().set_default_executor(process.nicer_executor(nice, name="worker-offloop"))
    # The writer process starts (and opens the store) while the engines load.
    writer_lost = asyncio.Event()  # a writer given up: this worker stops taking items at once

    def lose_writer() -> None:
        writer_lost.set()
        stop.set()
    writer_started = asyncio.ensure_future(_open_writer(config, f"worker-{placement.index}", lose_writer))
    repository = ModelRepository.of(config)
    engine_counters: Counter[str] = Counter()
    with startup.phase("runtime_import"):
        engine_runtime = await asyncio.to_thread(get_runtime, placement.runtime)
    with startup.phase("device_init"):
        await asyncio.to_thread(engine_runtime.open_device)
    engines = await asyncio.to_thread(load_engines, config, repository, engine_counters, engine_runtime,
                                      threads=_engine_threads(config, cpu_workers))
    runtimes = {}
    for (name, version), loaded in engines.items():
        runtimes[(name, version)] = runtime = ModelRuntime(repository.get(name), version, loaded, config, nice)
        await _warm(runtime)
        runtime.engine.warm_behind_traffic()  # CUDA graphs captured while the worker starts and serves
    encoders = list(runtimes.values())
    upstreams = _upstreams(config, repository)
    runtimes.update({key: runtime for key, runtime in upstreams.items() if runtime.spec.task != "generate"})
    writer = await writer_started
    heads, features = await _heads(config, repository, runtimes, placement, lose_writer)  # runs the warm encoders
    for runtime in heads.values():
        await _warm(runtime)
    runtimes.update(heads)
    tier = _semantic_tier(config, repository, runtimes, writer, placement.index)
    kv_store = None
    if any(spec.prefix is not None and spec.prefix.enabled and spec.prefix.disk for spec in repository.servable()):
        kv_store = await asyncio.to_thread(_open_block_store, config)
    generative = await asyncio.to_thread(_generative, repository, _engine_threads(config, cpu_workers),
                                        placement.gpu is not None, kv_store)
    generative.update({key: runtime for key, runtime in upstreams.items() if runtime.spec.task == "generate"})
    fleet = _fleet_tier(config, writer, placement.index, socket_path.parent)
    core = WorkerCore(repository, runtimes, writer, tier, fleet, features, generative, kv_store)
    core.counters.update(engine_counters)
    if tier is not None:  # what the calibrated rule learnt before a restart
        core.matching.calibrations.update(await asyncio.to_thread(
            calibration.load, calibration.path_for(tier.snapshot_dir), core.matching.calibrated_versions()))
    publisher = _publisher(core, placement, startup, metrics_dir if config.server.metrics_port else None)
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServicer_to_server(WorkerServicer(core, placement, startup), server)
    items_path = items_socket(socket_path)
    for path in (socket_path, items_path):
        path.unlink(missing_ok=True)  # left behind by a worker that was killed
    server.add_insecure_port(f"unix:{socket_path}")
    frontends = Frontends(core)
    items = await asyncio.get_running_loop().create_unix_server(
        lambda: Connection(core, frontends).protocol, path=str(items_path))
    await server.start()
    for path in (socket_path, items_path):  # the server's own user only (the folder is private too)
        path.chmod(FILE_MODE)
    process.settle_gc()
    ready.send(("worker", placement.index, os.getpid()))
    log.info("worker %d ready on unix:%s (pid %d, %s, %s) %.2f s after its start: %s", placement.index,
             socket_path, os.getpid(), placement.device, ", ".join(sorted({r.info.runtime for r in runtimes.values()})),
             startup.mark("ready"), "; ".join(filter(None, (startup.summary(), _phases_text(runtimes.values())))))
    warmed = asyncio.ensure_future(_at_full_speed(startup, encoders))
    await stop.wait()
    warmed.cancel()
    loop = asyncio.get_running_loop()
    if writer_lost.is_set():
        # Nothing answered from here on would be stored: no item is taken. Those in flight go back to
        # their frontends, which send them to another worker, or to this one once it is started again.
        log.error("stopping at once: a store writer was given up")
        items.close()
        for conn in list(frontends.open):
            conn.protocol.close()
    log.info("draining")
    # Frontends drain first: the supervisor stops them before the workers, and when the supervisor died
    # they noticed it as this worker did. Until their connections close, items may still arrive and are
    # answered; then what is still in flight finishes here.
    frontends_gone_by = loop.time() + config.server.drain_s
    while frontends.open and loop.time() < frontends_gone_by:
        await asyncio.sleep(0.05)
    items.close()
    await server.stop(config.server.drain_s)
    await core.close()
    if tier is not None:
        await asyncio.to_thread(calibration.save, core.matching.calibrations, calibration.path_for(tier.snapshot_dir))
    await asyncio.sleep(0)  # the last answers' writes
    for conn in list(frontends.open):
        conn.protocol.close()
    if writer is not None:
        await writer.close()  # the last writes reach the index before its snapshot
    if features is not None and features.writer is not None:
        await features.writer.close()
    if kv_store is not None:
        await asyncio.to_thread(kv_store.close)  # the blocks queued for it are written
    if tier is not None:
        await tier.close()
    if publisher is not None:
        await publisher.close()  # the last figures
    log.info("worker stopped")


def main(config: Config, placement: WorkerPlacement, cpu_workers: int, socket_path: str, ready,
         metrics_dir: str | None = None) -> None:
    """Entry point of a spawned worker process."""
    startup = StartupProfile()
    if placement.gpu is not None:
        # Before anything imports torch or CUDA: this process sees its own GPU only, as device 0. An MPS
        # server numbers the GPUs it sees (the supervisor's visible ones) from 0: its clients name theirs
        # by that position, not by the id (server/mps.py).
        through_mps = bool(os.environ.get(mps.PIPE_ENV))
        os.environ["CUDA_VISIBLE_DEVICES"] = str(placement.ordinal) if through_mps else placement.gpu
    process.setup_logging(config.server.log_level, f"worker-{placement.index}")
    process.run(lambda stop: _serve(config, placement, cpu_workers, Path(socket_path), ready, stop,
                                    Path(metrics_dir) if metrics_dir else None, startup))
