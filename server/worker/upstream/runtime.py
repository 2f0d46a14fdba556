"""An upstream model in a worker: what WorkerCore needs of a model version (its batcher, its answers, its
EngineInfo), with batches sent to its upstream servers (server/worker/upstream/pool.py) instead of an engine.
Items carry their text (the frontend has no tokenizer of the model); the batcher cuts batches of up to
upstream.max_batch_texts, and runs up to upstream.max_in_flight of them at once, each a coroutine on the
worker's event loop (the calls wait on sockets, not in threads: server/worker/upstream/pool.py)."""

from __future__ import annotations

import numpy as np

from infercache.v1 import infercache_pb2 as pb
from server.config import Config
from server.engines.base import Engine
from server.shared.answers import Answers
from server.shared.models import ModelSpec
from server.worker.batcher import Batcher
from server.worker.model_runtime import ModelRuntime
from server.worker.upstream.clients import client_for
from server.worker.upstream.credentials import Credential
from server.worker.upstream.pool import TextRow, UpstreamPool


class _UpstreamEngine(Engine):
    """The pool's figures where a local engine's go (GetStats, /metrics); nothing runs here."""

    def __init__(self, pool: UpstreamPool, slots: int) -> None:
        self.pool = pool
        self.slots = slots

    def run(self, inputs):
        raise RuntimeError("an upstream model runs no local batches")

    def device_memory_bytes(self) -> int:
        return 0

    def counters(self) -> dict[str, int]:
        return dict(self.pool.counters)


class UpstreamRuntime(ModelRuntime):
    def __init__(self, spec: ModelSpec, version: str, config: Config, credential: Credential | None) -> None:
        upstream = spec.upstream
        self.spec = spec
        self.version = version
        self.nice = 0
        self.pool = UpstreamPool(spec.name, version, upstream,
                                 [client_for(upstream, url, spec.name, spec.outputs[0], credential)
                                  for url in upstream.urls])
        self.engine = _UpstreamEngine(self.pool, upstream.max_in_flight)
        self.info = pb.EngineInfo(model=spec.name, version=version, runtime=f"upstream-{upstream.kind}",
                                  precision="", device=", ".join(upstream.urls))
        self.built_s = self.load_s = self.warmup_s = 0.0
        self.encoder = None  # (no tokenizer: items carry their text)
        self.labels: list[str] = []
        self.answers = Answers(spec, version, self.labels)
        self.batcher = Batcher(
            self._run_batch, buckets=spec.buckets, max_batch=spec.max_batch_size,
            max_delay_s=spec.max_queue_delay_ms / 1000, max_queue=config.server.max_queue,
            concurrency=upstream.max_in_flight, name=f"{spec.name}-{version}", max_wait_s=config.server.max_queue_wait_s)

    def input_of(self, item) -> TextRow:
        return TextRow.of(item.text, item.key, item.tenant)

    def phases(self) -> dict[str, float]:
        return {}

    async def _run_batch(self, rows: list[TextRow]) -> list[dict[str, np.ndarray] | Exception]:
        name = self.spec.outputs[0]
        return [{name: found} if isinstance(found, np.ndarray) else found for found in await self.pool.embed(rows)]

    def output_dim(self, name: str) -> int:
        raise RuntimeError("an upstream model's output size is known once it answers")

    def warmup(self) -> None:
        """Nothing: the upstream may be down while this worker starts, and its first miss says so."""

    def close(self) -> None:
        self.pool.close()
