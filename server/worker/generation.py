"""Generations in a worker: one flight per deterministic key (identical generations in flight run once;
a caller that joins late gets the text so far, then the rest), and per model version a scheduler, one
task that owns the running batch. Each of its steps admits a waiting generation while there is room
(reading its prompt), advances every running one by a token, and retires those that ended, were
cancelled by all their callers, or passed their deadline; the decoder's work runs on the scheduler's own
thread, off the event loop. A finished answer goes to every caller, then into L1 behind the reply (the
flight stays joinable until its entry is committed).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from cachestore.keys import namespace
from cachestore.results import ResultCache, now_us
from infercache.v1 import infercache_pb2 as pb
from infercache.v1 import worker_pb2
from server.shared.answers import answer_record
from server.shared.errors import DeadlineExceeded, InferCacheError, Overloaded, WorkerUnavailable
from server.shared.generated import marked, whole_answer
from server.shared.generation_spec import PromptFormat
from server.shared.models import TOKENIZER_FILE, ModelSpec
from server.worker.answer_text import LENGTH, AnswerText, Sampler
from server.worker.decoder import OrtDecoder

log = logging.getLogger("infercache.generation")

Source = pb.CacheInfo.Source


class Generation:
    """One generation and the callers it answers: (connection, item id) -> joined."""

    __slots__ = ("key", "item", "model", "listeners", "text", "sampler", "sequence", "sent", "answer",
                 "dropped", "deadline", "created_us", "store")

    def __init__(self, item: worker_pb2.ComputeItem, model: "GenerativeRuntime", deadline: float | None) -> None:
        params = item.generate
        self.key = item.key
        self.item = item
        self.model = model
        self.listeners: dict[tuple, bool] = {}
        self.text = AnswerText(model.tokenizer, model.format.end_ids, list(params.stop), params.max_new_tokens)
        self.sampler = Sampler(params.temperature, params.top_p, params.top_k,
                               params.seed if params.HasField("seed") else None)
        self.sequence = None                 # the decoder's state, once the prompt is read
        self.sent: list[tuple[str, list[int]]] = []  # deltas so far: a late joiner's replay
        self.answer: bytes | None = None     # once it ended: the whole answer (server/shared/generated.py)
        self.dropped = False                 # cancelled by all its callers, or past its deadline
        self.deadline = deadline
        self.created_us = now_us()
        self.store = item.store

    @property
    def prompt(self) -> np.ndarray:
        return np.frombuffer(self.item.ids, dtype="<i4")


class GenerativeRuntime:
    """A generative model version in a worker: its decoder, tokenizer, prompt format and scheduler."""

    def __init__(self, spec: ModelSpec, version: str, threads: int) -> None:
        directory: Path = spec.version_dir(version)
        self.spec = spec
        self.version = version
        self.format = PromptFormat.read(directory)
        self.tokenizer = Tokenizer.from_file(str(directory / TOKENIZER_FILE))
        self.decoder = OrtDecoder(directory, threads)
        self.info = pb.EngineInfo(model=spec.name, version=version, runtime="onnxruntime", precision="fp32",
                                  device="cpu")


class Scheduler:
    """The running batch of one model version. Its task is the only writer of `running` and `waiting`."""

    def __init__(self, runtime: GenerativeRuntime, finished, counters: Counter) -> None:
        self.runtime = runtime
        self.limit = runtime.spec.generation
        self._finished = finished            # (generation) -> None, on the loop, once it has its answer
        self.counters = counters
        self.waiting: deque[Generation] = deque()
        self.running: list[Generation] = []
        self._wake = asyncio.Event()
        self._thread = ThreadPoolExecutor(1, thread_name_prefix=f"generate-{runtime.spec.name}")
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"scheduler-{runtime.spec.name}")

    def admit(self, generation: Generation) -> None:
        if len(self.waiting) >= self.limit.max_waiting and len(self.running) >= self.limit.max_streams:
            raise Overloaded(f"{self.runtime.spec.name}: {len(self.running)} generations running and "
                             f"{len(self.waiting)} waiting (generate.max_waiting); retry later")
        self.waiting.append(generation)
        self._wake.set()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self.running and not self.waiting:
                self._wake.clear()
                await self._wake.wait()
            now = loop.time()
            self._retire(now)
            new = None
            while self.waiting and len(self.running) < self.limit.max_streams and new is None:
                candidate = self.waiting.popleft()
                if not candidate.dropped:
                    new = candidate
            stepping = [g for g in self.running if not g.dropped]
            if new is None and not stepping:
                continue
            try:
                deltas = await loop.run_in_executor(self._thread, self._step, new, stepping)
            except Exception as exc:  # noqa: BLE001 (a decoder failure fails these generations, not the worker)
                log.exception("generation step failed")
                for generation in ([new] if new else []) + stepping:
                    self._fail(generation, WorkerUnavailable(f"generation failed: {exc}"))
                self.running = [g for g in self.running if g not in stepping]
                continue
            if new is not None:
                self.running.append(new)
            for generation, delta, ids in deltas:
                self._emit(generation, delta, ids)
            self.counters["generate_steps"] += 1
            self.counters["tokens_generated"] += len(deltas)
            await asyncio.sleep(0)  # new items and cancels are read between steps

    def _step(self, new: Generation | None, running: list[Generation]) -> list[tuple[Generation, str, list[int]]]:
        """On the scheduler's thread: the new generation's prompt read and its first token, then one token
        for each running one. (generation, text to send, token) each."""
        out = []
        decoder = self.runtime.decoder
        context = self.limit.context_length
        if new is not None:
            new.sequence, logits = decoder.prefill(new.prompt.tolist())
            out.append(self._next(new, logits, context))
        for generation in running:
            logits = decoder.decode(generation.sequence, generation.text.ids[-1])
            out.append(self._next(generation, logits, context))
        return out

    @staticmethod
    def _next(generation: Generation, logits: np.ndarray, context: int) -> tuple[Generation, str, list[int]]:
        """The generation's next token: (generation, text to send, ids to send: none for an end token)."""
        token = generation.sampler(logits)
        text = generation.text
        delta = text.add(token)
        if text.finish is None and generation.sequence.length + 1 >= context:
            delta += text.end(LENGTH)  # the context is full
        return generation, delta, [] if token in text.end_ids else [token]

    def _emit(self, generation: Generation, delta: str, ids: list[int]) -> None:
        if generation.dropped:  # nobody waits (retired at the next step): nothing sent, nothing stored
            return
        text = generation.text
        if delta or ids:
            generation.sent.append((delta, ids))
            for replies, item_id in generation.listeners:
                replies.stream(item_id, delta, ids)
        if text.finish is not None:
            item = generation.item
            generation.answer = whole_answer(text.sent, text.ids, text.finish, len(item.ids) // 4, item.version, item.key)
            generation.sequence = None  # its past's memory goes now
            self.running.remove(generation)
            self._finished(generation)

    def _retire(self, now: float) -> None:
        """Drops what nobody waits for any more and what passed its deadline (failing its callers)."""
        for generation in [*self.running, *self.waiting]:
            if not generation.dropped and generation.deadline is not None and now >= generation.deadline:
                self._fail(generation, DeadlineExceeded("the deadline passed while the answer was generated"))
        for generation in self.running:
            if generation.dropped:
                generation.sequence = None  # its past's memory goes now
        self.running = [g for g in self.running if not g.dropped]

    def _fail(self, generation: Generation, exc: InferCacheError) -> None:
        generation.dropped = True
        generation.sequence = None
        for replies, item_id in list(generation.listeners):
            replies.waiting.pop(item_id, None)
            replies.fail(item_id, exc)
        generation.listeners.clear()
        self._finished(generation)

    async def close(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        self._thread.shutdown(wait=True)


class Generations:
    """The worker's generations: flights by key, a scheduler per generative model version, and their
    answers into L1. Event loop only."""

    def __init__(self, runtimes: dict[tuple[str, str], GenerativeRuntime], writer, counters: Counter) -> None:
        self.runtimes = runtimes
        self.writer = writer
        self.cache = ResultCache(writer.store) if writer is not None else None
        self.counters = counters
        self._flights: dict[bytes, Generation] = {}
        self._schedulers = {key: Scheduler(runtime, self._done, counters) for key, runtime in runtimes.items()}

    def submit(self, replies, item: worker_pb2.ComputeItem, deadline: float | None) -> None:
        runtime = self.runtimes.get((item.model, item.version))
        if runtime is None:
            raise WorkerUnavailable(f"model {item.model!r} version {item.version!r} is not loaded by this worker")
        shared = item.cached_ok or item.store  # deterministic: its key names its answer
        flight = self._flights.get(item.key) if shared else None
        if flight is not None and flight.dropped:
            flight = None
        if flight is None and item.cached_ok and self.cache is not None:
            now = now_us()
            record = self.cache.get(item.key, now, item.max_age_us if item.HasField("max_age_us") else None)
            if record is not None:  # committed after the frontend looked
                self.counters["late_hit"] += 1
                replies.finish(item.id, Source.RESULT_EXACT, marked(record.payload, Source.RESULT_EXACT,
                                                                    record.age_s(now)))
                return
        joined = flight is not None
        if flight is not None and flight.answer is not None and not item.cached_ok:
            joined, flight = False, None  # finished, and this caller wants a fresh answer
        if flight is None:
            flight = Generation(item, runtime, deadline)
            self._schedulers[(item.model, item.version)].admit(flight)  # Overloaded when full
            if shared:
                self._flights[item.key] = flight
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

    def cancel(self, replies, item_id: int, flight: Generation) -> None:
        """A caller went away: a generation nobody waits for is dropped at its scheduler's next step."""
        flight.listeners.pop((replies, item_id), None)
        if not flight.listeners and flight.answer is None:
            flight.dropped = True
            self.counters["generate_cancelled"] += 1
            self._forget(flight)

    def _done(self, flight: Generation) -> None:
        """A flight ended: its callers get the answer; it is stored, and forgotten once committed."""
        if flight.answer is None:  # failed or dropped
            self._forget(flight)
            return
        for (replies, item_id), joined in flight.listeners.items():
            replies.waiting.pop(item_id, None)
            source = Source.COALESCED if joined else Source.MISS
            replies.finish(item_id, source, marked(flight.answer, source))
        flight.listeners.clear()
        self.counters["generated"] += 1
        if flight.store and self.writer is not None:
            item = flight.item
            record = answer_record(flight.model.spec, flight.created_us, flight.answer)
            self.writer.put(flight.key, namespace(item.tenant, item.model, item.version), record,
                            on_done=partial(self._forget, flight))
        else:
            self._forget(flight)

    def _forget(self, flight: Generation) -> None:
        if self._flights.get(flight.key) is flight:
            del self._flights[flight.key]

    async def close(self) -> None:
        for scheduler in self._schedulers.values():
            await scheduler.close()
