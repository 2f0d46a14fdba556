"""Generations in a worker: one flight per deterministic key (identical generations in flight run once;
a caller that joins late gets the text so far, then the rest), and per model version a scheduler, one
task that owns the running batch (continuous batching). Each step reads prompt chunks of generations
that were admitted (within `generate.prefill_tokens`, so a long prompt never stalls running streams for
long) and advances every running generation by a token; generations join and leave the batch at every
step, and those that ended, were cancelled by all their callers, or passed their deadline are retired.
The decoder's work runs on the scheduler's own thread, off the event loop. A pipelined decoder (a GPU,
server/engines/torch_decoder.py) is given step n+1 before step n is read, so the device does not wait
for the host: a generation that ended at step n has computed one token more, unused. A finished answer
goes to every caller, then into L1 behind the reply (the flight stays joinable until its entry is
committed). A shadow regeneration (server/worker/regeneration.py) is a generation of its own that nobody
listens to and nothing stores: it starts only while its scheduler is idle, and foreground work that
arrives meanwhile (a generation, or a batch of any other model of the worker) drops it before the next
step (its check waits for the next idle moment).
"""

from __future__ import annotations

import asyncio
import heapq
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
from server.engines.decoding import Chunk, Decoder, Outcome, Row, Step
from server.shared.answers import answer_record
from server.shared.errors import DeadlineExceeded, InferCacheError, Overloaded, WorkerUnavailable
from server.shared.generated import marked, whole_answer
from server.shared.generation_spec import PromptFormat
from server.shared.models import TOKENIZER_FILE, ModelSpec
from server.worker.answer_text import LENGTH, AnswerText, Sampler
from server.worker.shadow import Preempted

log = logging.getLogger("infercache.generation")

Source = pb.CacheInfo.Source


class Generation:
    """One generation and the callers it answers: (connection, item id) -> joined."""

    __slots__ = ("key", "item", "model", "listeners", "text", "sampler", "sent", "answer", "dropped", "deadline",
                 "created_us", "store", "prompt", "limit", "slot", "fed", "planned", "received", "next_token",
                 "awaiting", "last_step", "looked_up", "loading", "loaded", "block_keys", "kept", "reused_from",
                 "erasures", "seated_at", "companion", "background")

    def __init__(self, item: worker_pb2.ComputeItem, model: "GenerativeRuntime", deadline: float | None) -> None:
        params = item.generate
        self.key = item.key
        self.item = item
        self.model = model
        self.listeners: dict[tuple, bool] = {}
        self.text = AnswerText(model.tokenizer, model.format.end_ids, list(params.stop), params.max_new_tokens)
        self.sampler = Sampler(params.temperature, params.top_p, params.top_k,
                               params.seed if params.HasField("seed") else None)
        self.sent: list[tuple[str, list[int]]] = []  # deltas so far: a late joiner's replay
        self.answer: bytes | None = None     # once it ended: the whole answer (server/shared/generated.py)
        self.dropped = False                 # cancelled by all its callers, or past its deadline
        self.deadline = deadline
        self.created_us = now_us()
        self.store = item.store
        self.prompt = np.frombuffer(item.ids, dtype="<i4").tolist()
        # The answer's most tokens: what was asked, and what the context leaves (prompt + answer <= context).
        self.limit = min(params.max_new_tokens, model.spec.generation.context_length - len(self.prompt))
        # The scheduler's bookkeeping: the slot it holds in the decoder, prompt tokens given to steps,
        # answer tokens that launched steps will produce, those read, the token to give the next row
        # (sampled: chosen here; greedy: None, the decoder's own), whether a launched step's answer is
        # awaited before it (sampled), and the last step that used the slot.
        self.slot: int | None = None
        self.fed = 0
        self.planned = 0
        self.received = 0
        self.next_token: int | None = None
        self.awaiting = False
        self.last_step = 0
        # The prefix cache's (server/worker/prefix_cache.py): whether its prompt was looked up, blocks being
        # read from disk for it and those read, its block keys, blocks kept so far, the tier it reused from,
        # the cache's erasures when it was looked up.
        self.looked_up = False
        self.loading = False
        self.loaded: dict | None = None
        self.block_keys: list[bytes] = []
        self.kept = 0
        self.reused_from = "none"
        self.erasures = 0
        self.seated_at = 0.0
        # Semantic answers (server/worker/answer_matching.py): the question's entry, stored beside the answer.
        self.companion = None
        # A shadow regeneration: the future its whole answer goes to (None: a foreground generation).
        self.background: asyncio.Future | None = None

    @property
    def sampled(self) -> bool:
        return self.sampler.rng is not None


class GenerativeRuntime:
    """A generative model version in a worker: its decoder, tokenizer, prompt format and scheduler."""

    def __init__(self, spec: ModelSpec, version: str, decoder: Decoder, prefix=None) -> None:
        directory: Path = spec.version_dir(version)
        self.spec = spec
        self.version = version
        self.format = PromptFormat.read(directory)
        self.tokenizer = Tokenizer.from_file(str(directory / TOKENIZER_FILE))
        self.decoder = decoder
        self.prefix = prefix  # its PrefixCache (server/worker/prefix_cache.py), or None
        self.info = pb.EngineInfo(model=spec.name, version=version, runtime=decoder.runtime,
                                  precision=decoder.precision, device=decoder.device)


class Scheduler:
    """The running batch of one model version. Its task is the only writer of `running`, `waiting`, the
    free slots and the generations' step bookkeeping."""

    def __init__(self, runtime: GenerativeRuntime, finished, counters: Counter, metrics=lambda: None,
                 busy=lambda: False) -> None:
        """busy(): whether another model of the worker has work (a regeneration gives way to it)."""
        self.runtime = runtime
        self._busy = busy
        self.decoder = runtime.decoder
        self.prefix = runtime.prefix
        self._metrics = metrics              # () -> the worker's telemetry.Recorder, or None
        self.limit = runtime.spec.generation
        self._finished = finished            # (generation) -> None, on the loop, once it has its answer
        self.counters = counters
        self.waiting: deque[Generation] = deque()
        self.running: list[Generation] = []  # holding a slot: reading their prompt, or answering
        self._free = list(range(min(self.decoder.slots, self.limit.max_streams)))  # a heap: lowest first
        self._releasing: list[Generation] = []  # ended; their slots are free once their last step is read
        self._finishing: list[Generation] = []  # ended; the next step keeps their blocks (prefix cache)
        self._launched = 0                   # steps launched, and read
        self._collected = 0
        self._pending: tuple[object, list] | None = None  # a launched step not read yet, and its generations
        self._wake = asyncio.Event()
        self._became_idle = asyncio.Event()
        self._thread = ThreadPoolExecutor(1, thread_name_prefix=f"generate-{runtime.spec.name}")
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"scheduler-{runtime.spec.name}")

    def wake(self) -> None:
        self._wake.set()

    @property
    def idle(self) -> bool:
        """No generation waits or runs, and no step is owed (shadow checks may go: server/worker/shadow.py):
        the blocks of generations that ended are kept by a step of their own, not by the first step of the
        next work (whose prompt may start with them: a conversation's next turn)."""
        return not self.running and not self.waiting and self._pending is None and not self._finishing

    async def wait_idle(self) -> None:
        """Returns once the scheduler is idle (woken when it becomes so, not by polling)."""
        while not self.idle:
            self._became_idle.clear()
            await self._became_idle.wait()

    def admit(self, generation: Generation) -> None:
        if generation.background is None:  # foreground: a regeneration running or waiting gives way
            self.preempt()
        elif not self.idle:
            raise Preempted("the scheduler is busy")
        if len(self.waiting) >= self.limit.max_waiting and not self._free:
            raise Overloaded(f"{self.runtime.spec.name}: {len(self.running)} generations running and "
                             f"{len(self.waiting)} waiting (generate.max_waiting); retry later")
        self.waiting.append(generation)
        self._wake.set()

    def preempt(self) -> None:
        """Drops every regeneration, running or waiting (left at the next step; a slot is freed once no
        launched step uses it): foreground work arrived, here or at another model version's scheduler."""
        for other in (*self.running, *self.waiting):
            if other.background is not None and not other.dropped:
                other.dropped = True
                self.counters["regenerations_preempted"] += 1
                if not other.background.done():
                    other.background.set_exception(Preempted("foreground work arrived"))

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if self.idle:
                self._became_idle.set()
                self._wake.clear()
                await self._wake.wait()
            if any(g.background is not None for g in (*self.running, *self.waiting)) and self._busy():
                self.preempt()  # another model's foreground batch: the device is theirs
            self._retire(loop.time())
            self._seat()
            step, entries = self._plan()
            if not step and self._pending is None:
                if self.idle:  # (the last generations were retired just now: shadow checks may go)
                    self._became_idle.set()
                self._wake.clear()  # nothing to compute: a new generation, or blocks read from disk, wake it
                await self._wake.wait()
                continue
            pending = self._pending
            try:
                handle, outcome = await loop.run_in_executor(self._thread, self._work, step, pending)
            except Exception as exc:  # noqa: BLE001 (a decoder failure fails these generations, not the worker)
                log.exception("generation step failed")
                self._fail_all(WorkerUnavailable(f"generation failed: {exc}"))
                continue
            if step:
                self._launched += 1
            if self.decoder.pipelined:
                self._pending = (handle, entries) if step else None
                if pending is not None:
                    self._read(pending[1], outcome)
            elif step:
                self._read(entries, outcome)
            await asyncio.sleep(0)  # new items and cancels are read between steps

    def _work(self, step: Step, pending) -> tuple[object, Outcome | None]:
        """On the scheduler's thread: launches `step`; answers the step read now (the pending one when the
        decoder is pipelined, else this one)."""
        decoder = self.decoder
        handle = decoder.launch(step) if step else None
        if not decoder.pipelined:
            return handle, decoder.collect(handle) if step else None
        return handle, decoder.collect(pending[0]) if pending is not None else None

    def _seat(self) -> None:
        """Waiting generations take free slots, in arrival order."""
        while self.waiting and self._free:
            generation = self.waiting.popleft()
            if generation.dropped:
                continue
            generation.slot = heapq.heappop(self._free)
            generation.seated_at = asyncio.get_running_loop().time()
            self.running.append(generation)

    def _plan(self) -> tuple[Step, list[Generation | None]]:
        """The next step: prompt chunks within the budget, in arrival order, and a row for every answering
        generation whose next input is known (a sampled one waits for the token the launched step gives
        it). Its generations, in the step's order (None for a chunk that does not end its prompt).
        Every running generation is in it, in the launched step, or waits for prefix blocks read from disk
        (which wake the scheduler), so an empty plan with nothing launched leaves nothing to do until then."""
        step = Step()
        chunked: list[Generation | None] = []
        answering: list[Generation] = []
        budget = self.limit.prefill_tokens
        number = self._launched + 1
        prefix = self.prefix
        if prefix is not None:
            prefix.planning()
        for generation in self._finishing:  # what they computed, prompt and answer, for later prompts
            text = generation.text
            prefix.keep(generation, generation.prompt + text.ids, len(generation.prompt) + generation.received - 1, step)
            generation.last_step = number
        self._finishing.clear()
        for generation in self.running:
            prompt = generation.prompt
            if not generation.looked_up:
                if prefix is not None:
                    restores = prefix.lookup(generation, self.wake)
                    if restores is None:
                        continue  # its blocks are being read from disk
                    step.restores += restores
                generation.looked_up = True
            if generation.fed < len(prompt):
                if budget <= 0:
                    continue
                n = min(budget, len(prompt) - generation.fed)
                last = generation.fed + n == len(prompt)
                step.chunks.append(Chunk(generation.slot, prompt[generation.fed:generation.fed + n], generation.fed,
                                         last, scores=last and generation.sampled))
                budget -= n
                generation.fed += n
                if last:
                    generation.planned = 1
                    generation.awaiting = generation.sampled
                    if prefix is not None:
                        prefix.keep(generation, prompt, len(prompt), step)
                chunked.append(generation if last else None)
            elif generation.planned < generation.limit and not generation.awaiting:
                step.rows.append(Row(generation.slot, len(prompt) + generation.planned - 1, generation.next_token,
                                     scores=generation.sampled))
                generation.planned += 1
                generation.next_token = None
                generation.awaiting = generation.sampled
                answering.append(generation)
            else:
                continue
            generation.last_step = number
        return step, chunked + answering

    def _read(self, entries: list[Generation | None], outcome: Outcome) -> None:
        """A step's outcome: each generation's next token, sent; then the slots no step uses any more."""
        self._collected += 1
        emitted = 0
        if outcome.exports:
            self.prefix.exported(outcome.exports)
        for index, generation in enumerate(entries):
            if generation is None or generation.dropped or generation.text.finish is not None:
                continue  # a prompt chunk, or the token computed after the end (pipelined): unused
            if generation.sampled:
                token = generation.sampler(outcome.scores[index])
                generation.next_token = token
                generation.awaiting = False
            else:
                token = outcome.tokens[index]
            generation.received += 1
            foreground = generation.background is None  # (a regeneration is not the callers' traffic)
            if generation.received == 1 and foreground and (recorder := self._metrics()) is not None:
                recorder.observe(("infercache_generate_prefill_seconds", self.runtime.spec.name, generation.reused_from),
                                 asyncio.get_running_loop().time() - generation.seated_at)
            delta, ids = self._next(generation, token)
            self._emit(generation, delta, ids)
            emitted += foreground
        self.counters["generate_steps"] += 1
        self.counters["tokens_generated"] += emitted
        self._release()

    @staticmethod
    def _next(generation: Generation, token: int) -> tuple[str, list[int]]:
        """The generation's next token: (text to send, ids to send: none for an end token)."""
        text = generation.text
        delta = text.add(token)
        if text.finish is None and generation.received >= generation.limit:
            delta += text.end(LENGTH)  # the context is full
        return delta, [] if token in text.end_ids else [token]

    def _emit(self, generation: Generation, delta: str, ids: list[int]) -> None:
        text = generation.text
        if delta or ids:
            generation.sent.append((delta, ids))
            for replies, item_id in generation.listeners:
                replies.stream(item_id, delta, ids)
        if text.finish is not None:
            item = generation.item
            generation.answer = whole_answer(text.sent, text.ids, text.finish, len(item.ids) // 4, item.version, item.key)
            if self.prefix is not None:
                self._finishing.append(generation)
                generation.last_step = self._launched + 1  # its slot is read by the next step
            self._leave(generation)
            self._finished(generation)

    def _leave(self, generation: Generation) -> None:
        """Out of the running batch; its slot is freed once no launched step uses it."""
        self.running.remove(generation)
        if generation.slot is not None:
            self._releasing.append(generation)

    def _release(self) -> None:
        done = [g for g in self._releasing if g.last_step <= self._collected]
        if not done:
            return
        self._releasing = [g for g in self._releasing if g not in done]
        for generation in done:
            self.decoder.release(generation.slot)
            heapq.heappush(self._free, generation.slot)
            generation.slot = None

    def _retire(self, now: float) -> None:
        """Drops what nobody waits for any more and what passed its deadline (failing its callers)."""
        for generation in [*self.running, *self.waiting]:
            if not generation.dropped and generation.deadline is not None and now >= generation.deadline:
                self._fail(generation, DeadlineExceeded("the deadline passed while the answer was generated"))
        for generation in [g for g in self.running if g.dropped]:
            self._leave(generation)
        self._release()

    def _fail(self, generation: Generation, exc: InferCacheError) -> None:
        generation.dropped = True
        for replies, item_id in list(generation.listeners):
            replies.waiting.pop(item_id, None)
            replies.fail(item_id, exc)
        generation.listeners.clear()
        self._finished(generation)

    def _fail_all(self, exc: InferCacheError) -> None:
        """After a failed step: every generation holding a slot fails, and every slot is free again."""
        for generation in list(self.running):
            if not generation.dropped:
                self._fail(generation, exc)
            self._leave(generation)
        self._pending = None
        self._finishing.clear()
        if self.prefix is not None:
            self.prefix.steps_lost()
        self._collected = self._launched  # what the failed steps launched is never read
        for generation in self._releasing:
            generation.last_step = min(generation.last_step, self._collected)
        self._release()

    async def close(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        self._thread.shutdown(wait=True)
        if self.prefix is not None:
            self.prefix.close()
        self.decoder.close()


class Generations:
    """The worker's generations: flights by key, a scheduler per generative model version, and their
    answers into L1. Event loop only."""

    def __init__(self, runtimes: dict[tuple[str, str], GenerativeRuntime], writer, cache: ResultCache | None,
                 counters: Counter, metrics=lambda: None, answers=None, busy=lambda: False) -> None:
        """cache: the worker's L1 reader (WorkerCore's: it follows the writer's store when a damaged one is
        replaced), for answers committed since the frontend looked. metrics(): the worker's
        telemetry.Recorder while /metrics is on, else None. answers: the worker's AnswerMatching
        (server/worker/answer_matching.py), for models with semantic answers. busy(): whether the worker's
        other models have work (shadow regenerations give way to it)."""
        self.runtimes = runtimes
        self.answers = answers
        self.busy = busy
        self._tasks: set[asyncio.Task] = set()  # semantic lookups, and what a miss's answer adds to them
        self.writer = writer
        self.cache = cache
        self.counters = counters
        self._flights: dict[bytes, Generation] = {}
        self._schedulers = {key: Scheduler(runtime, self._done, counters, metrics, busy)
                            for key, runtime in runtimes.items()}

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
        if (flight is None and item.question_key and self.answers is not None
                and self.answers.enabled(runtime.spec)):
            self.background(self._semantic(replies, item, deadline, runtime))
            return
        self._start(replies, item, deadline, runtime, flight, shared)

    async def _semantic(self, replies, item: worker_pb2.ComputeItem, deadline: float | None,
                        runtime: GenerativeRuntime) -> None:
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
        shared = item.cached_ok or item.store
        flight = self._flights.get(item.key) if shared else None
        if flight is not None and flight.dropped:
            flight = None
        try:
            self._start(replies, item, deadline, runtime, flight, shared,
                        found.companion if found is not None else None)
        except InferCacheError as exc:
            replies.fail(item.id, exc)

    def _start(self, replies, item: worker_pb2.ComputeItem, deadline: float | None, runtime: GenerativeRuntime,
               flight: Generation | None, shared: bool, companion=None) -> None:
        """Joins the flight of the item's key, or starts one."""
        joined = flight is not None
        if flight is not None and flight.answer is not None and not item.cached_ok:
            joined, flight = False, None  # finished, and this caller wants a fresh answer
        if flight is None:
            flight = Generation(item, runtime, deadline)
            flight.companion = companion
            scheduler = self._schedulers[(item.model, item.version)]
            scheduler.admit(flight)  # Overloaded when full
            for other in self._schedulers.values():  # the device is the foreground's: every regeneration
                if other is not scheduler:           # gives way (its own scheduler's did in admit)
                    other.preempt()
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

    @property
    def background_tasks(self) -> int:
        """Semantic lookups, and what misses' answers add to them (embeddings, outcomes), not done yet."""
        return len(self._tasks)

    def schedulers(self):
        """Every model version's scheduler (shadow checks wait for them to be idle too)."""
        return self._schedulers.values()

    def regenerate(self, item: worker_pb2.ComputeItem) -> asyncio.Future:
        """A shadow regeneration of `item` (server/worker/regeneration.py): its whole answer, or Preempted
        when foreground work came first (raised at once where its scheduler is busy). Stored nowhere,
        joined by nobody."""
        runtime = self.runtimes[(item.model, item.version)]
        flight = Generation(item, runtime, None)
        flight.store = False
        flight.background = asyncio.get_running_loop().create_future()
        self._schedulers[(item.model, item.version)].admit(flight)
        return flight.background

    def erase(self, selector) -> int:
        """Invalidate: the prefix blocks `selector` names, dropped from every model version's memory and
        host memory (server/worker/prefix_cache.py erase); how many went."""
        return sum(runtime.prefix.erase(selector) for runtime in self.runtimes.values() if runtime.prefix is not None)

    def background(self, coroutine) -> asyncio.Task:
        """A task of this worker's generations (cancelled at close)."""
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def cancel(self, replies, item_id: int, flight: Generation) -> None:
        """A caller went away: a generation nobody waits for is dropped at its scheduler's next step."""
        flight.listeners.pop((replies, item_id), None)
        if not flight.listeners and flight.answer is None:
            flight.dropped = True
            self.counters["generate_cancelled"] += 1
            self._forget(flight)

    def _done(self, flight: Generation) -> None:
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
            self._forget(flight)
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
            self.writer.put(flight.key, ns, record, on_done=partial(self._forget, flight), ttl_class=item.ttl_class,
                            shared=shared)
        else:
            self._forget(flight)
        companion = flight.companion
        if companion is None:
            return
        put = partial(self._put_question, flight, shared) if store else None
        if companion.awaits_answer:  # answer equivalence: the answer's embedding first (an outcome, the entry)
            self.background(self.answers.answered(flight.model, companion, flight.answer, put))
        elif put is not None:
            put(companion.key, companion.payload, companion.entry)

    def _put_question(self, flight: Generation, shared: bool, key: bytes, payload: bytes, entry) -> None:
        """A question's entry (server/worker/answer_matching.py), pointing at the flight's answer."""
        item = flight.item
        question = answer_record(flight.model.spec, flight.created_us, payload, item.ttl_class)
        self.writer.put(key, namespace(item.tenant, item.model, item.version), question, semantic=entry,
                        ttl_class=item.ttl_class, shared=shared)

    def _forget(self, flight: Generation) -> None:
        if self._flights.get(flight.key) is flight:
            del self._flights[flight.key]

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for scheduler in self._schedulers.values():
            await scheduler.close()
