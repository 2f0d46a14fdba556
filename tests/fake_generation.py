"""A worker's generative side without a model: the real Generations, schedulers and prefix caches
(server/worker/generation/, server/worker/prefix/prefix_cache.py) over the fake decoder
(server/engines/fake_decoder.py), fed ComputeItems as a frontend sends them, answering into a
connection's sink as server/worker/process.py's would."""

from __future__ import annotations

import asyncio
import hashlib
from collections import Counter
from pathlib import Path

import numpy as np

from infercache.v1 import infercache_pb2 as pb
from infercache.v1 import worker_pb2
from server.engines.fake_decoder import END, FakeDecoder, fake_model
from server.worker.generation.generations import Generations
from server.worker.generation.scheduler import GenerativeRuntime
from server.worker.prefix.prefix_cache import PrefixCache

Source = pb.CacheInfo.Source


class Sink:
    """One connection's answers (server/worker/flights.py Replies): each item's deltas, then its end."""

    def __init__(self) -> None:
        self.waiting: dict = {}
        self.deltas: dict[int, list[tuple[str, list[int]]]] = {}
        self.ends: dict[int, asyncio.Future] = {}

    def _end(self, item_id: int) -> asyncio.Future:
        return self.ends.setdefault(item_id, asyncio.get_running_loop().create_future())

    def ok(self, item_id: int, source: int, payload: bytes, rejected: bool = False) -> None:
        self._end(item_id).set_result((source, payload))

    def fail(self, item_id: int, exc: BaseException) -> None:
        self._end(item_id).set_exception(exc)

    def stream(self, item_id: int, text: str, token_ids: list[int]) -> None:
        self.deltas.setdefault(item_id, []).append((text, token_ids))

    def finish(self, item_id: int, source: int, answer: bytes) -> None:
        self._end(item_id).set_result((source, answer))

    def streamed(self, item_id: int) -> list[int]:
        """The token ids streamed to the item so far."""
        return [i for _, ids in self.deltas.get(item_id, []) for i in ids]

    async def answer(self, item_id: int) -> tuple[str, pb.GenerateResponse]:
        """The item's end: (its source's name, its whole answer)."""
        source, answer = await self._end(item_id)
        return Source.Name(source), pb.GenerateResponse.FromString(answer)


class FakeWorker:
    """Generations of fake models, each named model's scheduler over its own FakeDecoder."""

    def __init__(self, root: Path, models: dict[str, str], *, vocab: int = 64, pipelined: bool = False,
                 token_bytes: int = 4, ends: bool = False, memory_blocks: int = 64,
                 host_blocks: int = 0, disk=None) -> None:
        """models: name -> YAML of its generate: and prefix_cache: sections. ends: whether the decoder
        answers the end token (else answers end by their length alone). A model with a prefix cache gets
        `memory_blocks` blocks of memory (default: its prefix_cache.host_mb), `host_blocks` of host memory
        and the block store `disk`."""
        self.specs = {name: fake_model(root, name, config, vocab) for name, config in models.items()}
        self.vocab, self.pipelined, self.token_bytes, self.ends = vocab, pipelined, token_bytes, ends
        self.memory_blocks, self.host_blocks, self.disk = memory_blocks, host_blocks, disk
        self.counters: Counter[str] = Counter()
        self.generations: Generations | None = None
        self.sink = Sink()
        self._ids = 0

    async def __aenter__(self) -> "FakeWorker":
        runtimes = {}
        for name, spec in self.specs.items():
            limits = spec.generation
            decoder = FakeDecoder(limits.max_streams, limits.context_length, self.vocab, token_bytes=self.token_bytes,
                                  pipelined=self.pipelined, end_ids=() if self.ends else (END,))
            prefix = None
            if spec.prefix.enabled:
                per = decoder.block_bytes(spec.prefix.block_tokens)
                prefix = PrefixCache(spec.prefix, decoder, name, "1", memory_bytes=self.memory_blocks * per,
                                     host_bytes=self.host_blocks * per, disk=self.disk)
            runtimes[(name, "1")] = GenerativeRuntime(spec, "1", decoder, prefix)
        self.generations = Generations(runtimes, None, None, self.counters)
        return self

    async def __aexit__(self, *exc) -> None:
        for runtime in self.generations.runtimes.values():
            runtime.decoder.resume()  # (a held step would hold the scheduler's close)
        await self.generations.close()

    def runtime(self, model: str) -> GenerativeRuntime:
        return self.generations.runtimes[(model, "1")]

    def decoder(self, model: str) -> FakeDecoder:
        return self.runtime(model).decoder

    def scheduler(self, model: str):
        return self.generations._schedulers[(model, "1")]

    def item(self, model: str, prompt: list[int], *, max_new_tokens: int = 8, tenant: str = "", store: bool = True,
             cached_ok: bool = True, public_prefix: int = 0, temperature: float = 0.0,
             seed: int | None = None) -> worker_pb2.ComputeItem:
        """A generation of `prompt`'s token ids, keyed as a frontend keys it (by what shapes the answer)."""
        self._ids += 1
        params = worker_pb2.GenerateParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=1.0)
        if seed is not None:
            params.seed = seed
        ids = np.asarray(prompt, dtype="<i4").tobytes()
        key = hashlib.blake2b(f"{tenant}\0{model}\0{max_new_tokens}\0{temperature}\0{seed}".encode() + ids,
                              digest_size=24).digest()
        return worker_pb2.ComputeItem(id=self._ids, model=model, version="1", tenant=tenant, key=key, ids=ids,
                                      store=store, cached_ok=cached_ok, generate=params, public_prefix=public_prefix)

    def submit(self, model: str, prompt: list[int], *, deadline: float | None = None, sink: Sink | None = None,
               **options) -> int:
        """item(model, prompt, **options) to the worker's generations; its id."""
        item = self.item(model, prompt, **options)
        self.generations.submit(sink or self.sink, item, deadline)
        return item.id

    async def ask(self, model: str, prompt: list[int], **options) -> pb.GenerateResponse:
        """One generation's whole answer, once its scheduler is idle."""
        _, answer = await self.sink.answer(self.submit(model, prompt, **options))
        scheduler = self.scheduler(model)
        await self.until(lambda: scheduler.idle, "the scheduler idle")
        return answer

    def cancel(self, item_id: int, sink: Sink | None = None) -> None:
        """The item's caller went away (as WorkerCore.cancel tells the flights)."""
        self.generations.flights.leave(sink or self.sink, item_id)

    @staticmethod
    async def until(condition, what: str, timeout: float = 30.0) -> None:
        """Lets the schedulers run until condition() holds."""
        deadline = asyncio.get_running_loop().time() + timeout
        while not condition():
            assert asyncio.get_running_loop().time() < deadline, f"never: {what}"
            await asyncio.sleep(0.001)


def prompt(seed: int, length: int, vocab: int = 64) -> list[int]:
    """Token ids of a prompt (never the end token), reproducible by seed."""
    return [int(i) for i in np.random.default_rng(seed).integers(1, vocab, length)]
