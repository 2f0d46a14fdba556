"""A local generative model version's scheduler: one task that owns the running batch (continuous
batching). Each step reads prompt chunks of generations that were admitted (within
`generate.prefill_tokens`, so a long prompt never stalls running streams for long) and advances every
running generation by a token; generations join and leave the batch at every step, and those that ended,
were cancelled by all their callers, or passed their deadline are retired. The decoder's work runs on the
scheduler's own thread, off the event loop. A pipelined decoder (a GPU, server/engines/torch_decoder.py)
is given step n+1 before step n is read, so the device does not wait for the host: a generation that ended
at step n has computed one token more, unused. A shadow regeneration (server/worker/semantic/regeneration.py) is a
generation of its own that nobody listens to and nothing stores: it starts only while its scheduler is
idle, and foreground work that arrives meanwhile (a generation, or a batch of any other model of the
worker) drops it before the next step (its check waits for the next idle moment).
"""

from __future__ import annotations

import asyncio
import heapq
import logging
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tokenizers import Tokenizer

from infercache.v1 import infercache_pb2 as pb
from infercache.v1 import worker_pb2
from server.engines.decoding import Chunk, Decoder, Step, StepOutcome, StepRow
from server.shared.errors import DeadlineExceeded, InferCacheError, Overloaded, WorkerUnavailable
from server.shared.generated import whole_answer
from server.shared.generation_spec import PromptFormat
from server.shared.models import TOKENIZER_FILE, ModelSpec
from server.worker.generation.answer_text import LENGTH
from server.worker.generation.request import Generation
from server.worker.semantic.shadow import Preempted

log = logging.getLogger("infercache.generation")


class GenerativeRuntime:
    """A generative model version in a worker: its decoder, tokenizer, prompt format and scheduler."""

    def __init__(self, spec: ModelSpec, version: str, decoder: Decoder, prefix=None) -> None:
        directory: Path = spec.version_dir(version)
        self.spec = spec
        self.version = version
        self.format = PromptFormat.read(directory)
        self.tokenizer = Tokenizer.from_file(str(directory / TOKENIZER_FILE))
        self.decoder = decoder
        self.prefix = prefix  # its PrefixCache (server/worker/prefix/prefix_cache.py), or None
        self.info = pb.EngineInfo(model=spec.name, version=version, runtime=decoder.runtime,
                                  precision=decoder.precision, device=decoder.device)

    def stat_group(self) -> tuple[str, dict]:
        return f"decoder.{self.spec.name}.{self.version}", self.decoder.counters()

    def flight(self, item: worker_pb2.ComputeItem, deadline: float | None) -> Generation:
        return Generation(item, self, deadline)

    def scheduler(self, finished, counters: Counter, metrics=lambda: None, busy=lambda: False) -> "Scheduler":
        return Scheduler(self, finished, counters, metrics, busy)



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
        """No generation waits or runs, and no step is owed (shadow checks may go: server/worker/semantic/shadow.py):
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

    def _work(self, step: Step, pending) -> tuple[object, StepOutcome | None]:
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
                step.rows.append(StepRow(generation.slot, len(prompt) + generation.planned - 1, generation.next_token,
                                     scores=generation.sampled))
                generation.planned += 1
                generation.next_token = None
                generation.awaiting = generation.sampled
                answering.append(generation)
            else:
                continue
            generation.last_step = number
        return step, chunked + answering

    def _read(self, entries: list[Generation | None], outcome: StepOutcome) -> None:
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
            generation.send(delta, ids)
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
        generation.fail(exc)
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
