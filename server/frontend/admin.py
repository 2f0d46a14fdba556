"""The calls beside the answer path: Invalidate (every worker removes what it stores), GetStats (this
frontend's counters, and the workers' and the store's for an admin), GetHotKeys (over every frontend)
and ListModels. Transport-free, like server/frontend/core.py, whose state they read."""

from __future__ import annotations

import asyncio
import logging

from cachestore.keys import parse_hex_key
from infercache.v1 import infercache_pb2 as pb
from server.frontend import hot_keys
from server.frontend.core import FrontendCore
from server.frontend.plan import check_identifiers
from server.shared.errors import Disabled, InvalidArgument, WorkerUnavailable
from server.shared.stats import process_stats

log = logging.getLogger("infercache.frontend")

STATS_WAIT_S = 1.0  # GetStats and ListModels wait this long for workers whose connection is not open
HOT_KEYS_SHOWN = 20  # GetHotKeys without a limit


class AdminCalls:
    def __init__(self, core: FrontendCore) -> None:
        self.core = core

    async def invalidate(self, request: pb.InvalidateRequest, time_remaining: float | None) -> pb.InvalidateResponse:
        if not (request.model or request.version or request.tenant or request.match_empty_tenant
                or request.text or request.key):
            raise InvalidArgument("set at least one of model, version, tenant, match_empty_tenant, text, key")
        if (request.version or request.text) and not request.model:
            raise InvalidArgument("version and text select within a model; set model too")
        if request.features and (request.text or request.key):
            raise InvalidArgument("features are selected by tenant, encoder model and version; text and key "
                                  "name results")
        check_identifiers(request)
        forwarded = pb.InvalidateRequest()
        forwarded.CopyFrom(request)
        if request.key:
            try:
                parse_hex_key(request.key)
            except ValueError as exc:
                raise InvalidArgument(str(exc)) from None
        if request.model:  # NOT_FOUND, as Infer answers: a typo must not look like "nothing to remove"
            spec = self.core.repository.get(request.model)
            version = spec.resolve_version(request.version)
        if request.text:
            if spec.task == "generate":  # its keys cover the rendered prompt and every setting, not a text
                raise InvalidArgument(f"model {spec.name!r} generates text: invalidate an answer by its key "
                                      "(GenerationEnd.cache.key), or by model, version or tenant")
            planner = self.core.planner
            key = planner.keyed(request.tenant, planner.served(spec, version), request.text).key
            if request.key and request.key != key.hex():
                raise InvalidArgument("text and key name different entries; set one of them")
            forwarded.key, forwarded.text = key.hex(), ""
        # Every worker: each one's delete is ordered after the writes it has queued (a miss answered just
        # before is not committed yet), and each one's semantic index hears of what it removed.
        removed = await self.core.workers.call_all("Invalidate", forwarded, time_remaining)
        return pb.InvalidateResponse(removed=sum(r.removed for r in removed))

    async def _worker_stats(self) -> list[pb.ProcessStats]:
        workers = self.core.workers

        async def one(link):
            try:
                return await workers.call(link, "Stats", pb.GetStatsRequest(), 1.0)
            except WorkerUnavailable as exc:
                log.info("worker %d stats unavailable: %s", link.index, exc)
                return None
        # A connection opens a moment after its worker is ready (or is down while it restarts): wait a little.
        await workers.all_up(timeout=min(STATS_WAIT_S, self.core.config.server.worker_wait_s))
        found = await asyncio.gather(*(one(link) for link in workers.links if link.up))
        return [stats for stats in found if stats is not None]

    async def stats(self, full: bool = True) -> pb.GetStatsResponse:
        """full=False (a client token): the answering frontend's own counters only."""
        core = self.core
        groups = [("frontend", core.counters)]
        if core.l1_cache is not None:
            groups.append(("l1", core.l1_cache.counters))
        if core.features is not None and (feature_store := core.features.stats()):
            groups.append(("features", feature_store))
        if core.fleet is not None:
            groups.append(("fleet", {**core.fleet.counters, "ready": int(core.fleet.ready),
                                     "breaker_open": int(core.fleet.link.open)}))
        response = pb.GetStatsResponse(frontend=process_stats("frontend", *groups))
        if not full:
            return response
        workers = await self._worker_stats()
        response.workers.extend(workers)
        if workers:
            response.worker.CopyFrom(workers[0])
        cache = core.l1()
        if cache is not None:
            response.store.CopyFrom(pb.StoreStats(**cache.store.stats()))
        return response

    async def hot_keys(self, request: pb.GetHotKeysRequest) -> pb.GetHotKeysResponse:
        """The model's hottest keys over every frontend: this one's sketch as it is now, the others' as
        they last published it."""
        check_identifiers(request)
        if not request.model:
            raise InvalidArgument("model is required; ListModels shows the served models")
        core = self.core
        spec = core.repository.get(request.model)
        if core.hot is None:
            raise Disabled("hot keys are not tracked on this server (server.hot_keys is 0)")
        limit = min(request.limit or HOT_KEYS_SHOWN, core.hot.capacity)
        others = await asyncio.to_thread(core.hot_published) if core.hot_published is not None else []
        tops = [core.hot.top(spec.name)] + [published[spec.name] for published in others if spec.name in published]
        return pb.GetHotKeysResponse(keys=[
            pb.HotKey(key=key, count=count, error=error, version=version, tenant=tenant, text=text)
            for key, count, error, version, tenant, text in hot_keys.merge_tops(tops, limit)])

    async def list_models(self) -> pb.ListModelsResponse:
        engines: dict[str, list[pb.EngineInfo]] = {}
        for stats in await self._worker_stats():
            for info in stats.engines:
                engines.setdefault(info.model, []).append(pb.EngineInfo(
                    model=info.model, version=info.version, runtime=info.runtime, precision=info.precision,
                    device=info.device, worker=stats.index))
        max_batch_texts = self.core.config.server.max_batch_texts
        return pb.ListModelsResponse(models=[
            pb.ModelInfo(
                name=m.name, serving_version=m.serving_version, versions=m.versions, task=m.task,
                outputs=m.outputs, max_text_chars=m.max_text_chars, buckets=m.buckets, ttl_s=m.ttl_s,
                engines=engines.get(m.name, []), max_batch_texts=max_batch_texts,
                ttl_classes=dict(m.ttl_classes.pairs), default_ttl_class=m.ttl_classes.default,
            )
            for m in self.core.repository.servable()
        ])
