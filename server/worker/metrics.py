"""A worker's Prometheus figures (server/shared/telemetry.py), read off the owners that keep them.

Batchers count launches by size, engine seconds and each bucket's recent seconds per text; the writers
count evictions and sweeps; the runtimes know how their engines were built and warmed up. At each
publish (on the event loop) these become the worker's snapshot, with the semantic searches' nearest
similarities that the core records, and the per-bucket times the frontends turn hits into model time
saved. Store figures come from worker 0 only (every worker shares the host's stores), read off the loop.
"""

from __future__ import annotations

import asyncio

from server.worker.core import WorkerCore
from server.shared.devices import WorkerPlacement
from server.worker.semantic.heads import HeadRuntime
from server.shared.telemetry import MEANS_SEP, Recorder
from server.worker.startup import StartupProfile
from server.worker.upstream.generative import UpstreamGenerativeRuntime
from server.worker.upstream.runtime import UpstreamRuntime

# infercache_prefix_moves_total's move label -> the prefix cache's counter (server/worker/prefix/prefix_cache.py)
PREFIX_MOVES = {"kept": "prefix_blocks_kept", "demoted_host": "prefix_demoted_host",
                "demoted_disk": "prefix_demoted_disk", "evicted_memory": "prefix_evicted_memory",
                "evicted_host": "prefix_evicted_host", "read_disk": "prefix_disk_reads"}


class WorkerMetrics:
    def __init__(self, core: WorkerCore, placement: WorkerPlacement, startup: StartupProfile, base: Recorder) -> None:
        """core.metrics: what the core records as it serves (set by the caller)."""
        self.core = core
        self.placement = placement
        self.startup = startup
        self.base = base               # the predecessor's counters (a restarted worker continues them)
        self._store_gauges: list[tuple[tuple, float]] = []

    def _derived(self) -> Recorder:
        out = Recorder()
        for runtime in self.core.runtimes.values():
            model, batcher = runtime.spec.name, runtime.batcher
            for size, launches in batcher.sizes.items():
                out.observe(("infercache_batch_size", model), size, launches)
            out.inc(("infercache_compute_seconds_total", model), batcher.seconds)
            # 0 for an engine loaded from the store: the series exists, so increase() sees a build
            out.inc(("infercache_engines_built_total", model, runtime.info.runtime, runtime.info.device),
                    1 if runtime.built_s else 0)
        for pool in self._upstream_pools():
            out.add(pool.figures())
        for (model, _), calibration in self.core.matching.calibrations.items():  # this process's checks (the base has
            disagreed = calibration.disagreed - calibration.disagreed_at_start  # its predecessor's)
            out.inc(("infercache_semantic_verifications_total", model, "agreed"),
                    calibration.verified - calibration.verified_at_start - disagreed)
            out.inc(("infercache_semantic_verifications_total", model, "disagreed"), disagreed)
        for model, prefix in self._prefix_caches():
            c = prefix.counters
            out.inc(("infercache_prefix_tokens_total", model, "queried"), c["prefix_tokens_queried"])
            for tier in ("memory", "host", "disk"):
                out.inc(("infercache_prefix_tokens_total", model, tier), c[f"prefix_tokens_{tier}"])
            for move, counter in PREFIX_MOVES.items():
                out.inc(("infercache_prefix_moves_total", model, move), c[counter])
        for name, writer in self._writers():
            counters = writer.counters  # (made anew at each read: the process's figures and this side's)
            out.inc(("infercache_store_evictions_total", name), counters["evicted"])
            out.inc(("infercache_store_swept_total", name), counters["swept"])
            out.inc(("infercache_store_writes_dropped_total", name), counters["dropped_backlog"])
            out.inc(("infercache_store_writer_restarts_total", name), counters["restarts"])
            out.inc(("infercache_store_replaced_total", name), counters["replaced"])
        return out

    def _writers(self):
        """(store label, its write-behind) of each store this worker writes."""
        features = self.core.features.writer if self.core.features is not None else None
        return [(name, writer) for name, writer in (("results", self.core.writer), ("features", features),
                                                    ("kv", self.core.kv_store)) if writer is not None]

    def _upstream_pools(self):
        """The upstream pool of each model version computed upstream, encoder or generative."""
        generative = self.core.generations.runtimes.values() if self.core.generations is not None else ()
        for runtime in (*self.core.runtimes.values(), *generative):
            if isinstance(runtime, (UpstreamRuntime, UpstreamGenerativeRuntime)):
                yield runtime.pool

    def _prefix_caches(self):
        generations = self.core.generations
        return [] if generations is None else [(runtime.spec.name, runtime.prefix)
                                               for runtime in generations.runtimes.values() if runtime.prefix]

    def _gauges(self) -> list[tuple[tuple, float]]:
        gauges: dict[tuple, float] = {}
        for runtime in self.core.runtimes.values():
            info = runtime.info
            depth = ("infercache_queue_depth", info.model)
            gauges[depth] = gauges.get(depth, 0) + runtime.batcher.depth
            labels = (info.model, info.version, info.runtime, info.device, str(self.placement.index))
            gauges[("infercache_engine_build_seconds", *labels)] = runtime.built_s
            for phase, seconds in runtime.phases().items():
                gauges[("infercache_engine_warmup_seconds", *labels, phase)] = seconds
        for pool in self._upstream_pools():
            for url, taking in pool.in_rotation().items():
                gauges[("infercache_upstream_in_rotation", pool.model, url, str(self.placement.index))] = int(taking)
        for phase, seconds in self.startup.phases.items():
            gauges[("infercache_worker_start_seconds", str(self.placement.index), phase)] = seconds
        for name, writer in self._writers():
            gauges[("infercache_store_write_backlog", name)] = writer.counters["backlog"]
        for model, prefix in self._prefix_caches():
            for tier, held in prefix.gauges().items():
                key = ("infercache_prefix_bytes", model, tier, str(self.placement.index))
                gauges[key] = gauges.get(key, 0) + held
        if self.core.semantic is not None:
            gauges[("infercache_semantic_index_entries",)] = self.core.semantic.entries()
        for (model, version), calibration in self.core.matching.calibrations.items():
            labels = (model, version, str(self.placement.index))
            if calibration.fidelity is not None:
                gauges[("infercache_semantic_fidelity", *labels)] = calibration.fidelity
            if calibration.threshold != float("inf"):
                gauges[("infercache_semantic_threshold", *labels)] = calibration.threshold
            for fitted in (False, True):
                if (reach := calibration.reach_for(fitted)) > 0:
                    gauges[("infercache_semantic_reach", *labels, str(fitted).lower())] = min(reach, 2.0)
        return [*gauges.items(), *self._store_gauges]

    def _means(self) -> dict[str, dict[int, float]]:
        """Recent engine seconds per text of each model version's buckets; a head's adds its encoder's."""
        out = {}
        for (model, version), runtime in self.core.runtimes.items():
            if isinstance(runtime, HeadRuntime):
                head = sum(runtime.batcher.text_s.values())
                times = {b: s + head for b, s in runtime.encoder_runtime.batcher.text_s.items()}
            else:
                times = dict(runtime.batcher.text_s)
            if times:
                out[f"{model}{MEANS_SEP}{version}"] = times
        return out

    def snapshot(self) -> dict:
        total = self.base.plus(self.core.metrics, self._derived())
        return total.snapshot(self._gauges(), means=self._means())

    async def refresh_store_gauges(self) -> None:
        """The stores' sizes (worker 0 only), read in a thread: a read transaction each."""
        if self.placement.index == 0:
            self._store_gauges = await asyncio.to_thread(self._read_store_gauges)

    def _read_store_gauges(self) -> list[tuple[tuple, float]]:
        out = []
        for name, writer in self._writers():
            try:
                stats = writer.store.stats()
            except Exception:  # a damaged or vanished store: its figures are left out, never the rest
                continue
            out += [(("infercache_store_entries", name), stats["entries"]),
                    (("infercache_store_bytes", name), stats["used_bytes"]),
                    (("infercache_store_budget_bytes", name), stats["budget_bytes"])]
            out += [(("infercache_store_class_entries", name, ttl_class), count)
                    for ttl_class, count in stats["entries_by_class"].items()]
        return out
