"""An upstream generative model in a worker (kind openai or infercache): its generations are streamed from the
upstream (OpenAI's chat or text completions route, or another infercache's Generate) instead of a local
decoder's steps. They are flights of the worker's Generations (server/worker/generation/) like any other:
identical ones in flight make one upstream call, a late joiner gets the text so far, the answer goes into
L1. Here UpstreamStreams takes a scheduler's place: each generation runs in a thread of its own (its
stream's reads block; the event loop's never do), at most upstream.max_in_flight at once; more wait for a
thread, up to generate.max_waiting, past which RESOURCE_EXHAUSTED. Pieces reach the callers as the upstream
streams them. A generation whose callers all left, or whose deadline passed, stops reading its stream. An
answer that broke off, failed, or ended for a reason other than stop or length is never stored."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

from infercache.v1 import infercache_pb2 as pb
from infercache.v1 import worker_pb2
from server.shared.errors import DeadlineExceeded, InferCacheError, Overloaded, UpstreamFailed, WorkerUnavailable
from server.shared.generated import FINISH_NAMES, whole_answer
from server.shared.models import ModelSpec
from server.worker.generation.request import GenerateFlight
from server.worker.semantic.shadow import Preempted
from server.worker.upstream.clients import client_for
from server.worker.upstream.credentials import Credential
from server.worker.upstream.errors import Abandoned
from server.worker.upstream.pool import UpstreamPool

log = logging.getLogger("infercache.upstream")

FINISHES = {name: reason for reason, name in FINISH_NAMES.items()}  # (an upstream names it as OpenAI does)
ROUTE_TURNS = 2  # a conversation's first turns (its system prompt, its first question) choose its server


class UpstreamGenerativeRuntime:
    """A generative model version computed upstream: what Generations needs of a runtime."""

    def __init__(self, spec: ModelSpec, version: str, credential: Credential | None) -> None:
        upstream = spec.upstream
        self.spec = spec
        self.version = version
        self.prefix = None  # (the upstream's own prefix cache holds its prompts)
        self.pool = UpstreamPool(spec.name, version, upstream,
                                 [client_for(upstream, url, spec.name, "", credential) for url in upstream.urls])
        self.info = pb.EngineInfo(model=spec.name, version=version, runtime=f"upstream-{upstream.kind}",
                                  precision="", device=", ".join(upstream.urls))

    def flight(self, item: worker_pb2.ComputeItem, deadline: float | None) -> GenerateFlight:
        return GenerateFlight(item, self, deadline)

    def scheduler(self, finished, counters: Counter, metrics=lambda: None, busy=lambda: False) -> "UpstreamStreams":
        return UpstreamStreams(self, finished, counters)

    def stat_group(self) -> tuple[str, dict]:
        return f"upstream.{self.spec.name}.{self.version}", dict(self.pool.counters)


def upstream_request(item: worker_pb2.ComputeItem) -> dict:
    """The item's messages or prompt and its settings, as OpenAI's API names them."""
    params = item.generate
    request = json.loads(item.text)
    request["max_tokens"] = params.max_new_tokens
    request["temperature"] = params.temperature
    if params.stop:
        request["stop"] = list(params.stop)
    if params.temperature > 0:  # (greedy: the rest does not change the answer)
        request["top_p"] = params.top_p
        if params.top_k:
            request["top_k"] = params.top_k
        if params.HasField("seed"):
            request["seed"] = params.seed
    return request


def route_of(request: dict) -> bytes:
    """What ranks a generation's servers: its conversation's first turns (or its prompt's start), so that
    the next turns of a conversation reach the server whose prefix cache holds its start."""
    start = request["messages"][:ROUTE_TURNS] if "messages" in request else request["prompt"][:2048]
    return hashlib.blake2b(json.dumps(start, ensure_ascii=False).encode(), digest_size=16).digest()


class UpstreamStreams:
    """The generations of one upstream model version in flight. Event loop only, but for each stream's
    reading thread, which hands its pieces to the loop."""

    def __init__(self, runtime: UpstreamGenerativeRuntime, finished, counters: Counter) -> None:
        self.runtime = runtime
        self._finished = finished  # (flight) -> None, on the loop, once it has its answer (or failed)
        self.counters = counters
        self._threads = runtime.spec.upstream.max_in_flight
        self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix=f"upstream-{runtime.spec.name}")
        self.running: set[GenerateFlight] = set()
        self._tasks: set[asyncio.Task] = set()
        self._became_idle = asyncio.Event()
        self._became_idle.set()

    @property
    def idle(self) -> bool:
        return not self.running

    async def wait_idle(self) -> None:
        while not self.idle:
            self._became_idle.clear()
            await self._became_idle.wait()

    def wake(self) -> None:
        pass

    def admit(self, flight: GenerateFlight) -> None:
        if flight.background is None:
            self.preempt()
        elif not self.idle:
            raise Preempted("the upstream is busy with foreground generations")
        if len(self.running) >= self._threads + self.runtime.spec.generation.max_waiting:
            raise Overloaded(f"{self.runtime.spec.name}: {len(self.running)} generations in flight to the upstream "
                             f"(upstream.max_in_flight and generate.max_waiting); retry later")
        self.running.add(flight)
        task = asyncio.get_running_loop().create_task(self._run(flight))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def preempt(self) -> None:
        """Drops every shadow regeneration in flight (its stream stops at its next piece)."""
        for flight in self.running:
            if flight.background is not None and not flight.dropped:
                flight.dropped = True
                self.counters["regenerations_preempted"] += 1
                if not flight.background.done():
                    flight.background.set_exception(Preempted("foreground work arrived"))

    async def _run(self, flight: GenerateFlight) -> None:
        loop = asyncio.get_running_loop()
        item = flight.item

        def on_piece(text: str) -> None:  # (on the stream's thread)
            if flight.dropped:
                raise Abandoned("nobody waits for this generation any more")
            loop.call_soon_threadsafe(self._piece, flight, text)

        request = upstream_request(item)
        call = loop.run_in_executor(self._pool, self.runtime.pool.generate, route_of(request), request, item.tenant,
                                    on_piece)
        try:
            if flight.deadline is None:
                finish, usage = await call
            else:
                finish, usage = await asyncio.wait_for(asyncio.shield(call), max(0.0, flight.deadline - loop.time()))
        except asyncio.TimeoutError:
            flight.dropped = True  # (its thread stops at the next piece)
            self._fail(flight, DeadlineExceeded("the deadline passed while the upstream generated the answer"))
        except Abandoned:
            self._fail(flight, UpstreamFailed("the generation was dropped"))
        except InferCacheError as exc:
            self._fail(flight, exc)
        except Exception as exc:  # noqa: BLE001 (a bug costs this generation, never its callers' wait)
            log.exception("upstream generation failed")
            self._fail(flight, WorkerUnavailable(f"the upstream generation failed: {type(exc).__name__}"))
        else:
            if flight.dropped:
                self._fail(flight, UpstreamFailed("the generation was dropped"))
            else:
                self._end(flight, "".join(text for text, _ in flight.sent), finish, usage)
        finally:
            self.running.discard(flight)
            if self.idle:
                self._became_idle.set()

    @staticmethod
    def _piece(flight: GenerateFlight, text: str) -> None:
        if not flight.dropped:
            flight.send(text, [])

    def _end(self, flight: GenerateFlight, text: str, finish: str, usage: dict) -> None:
        item = flight.item
        reason = FINISHES.get(finish)
        if reason is None:  # (content_filter, tool_calls, ...): answered as stop, never stored
            flight.store = False
            self.counters["upstream_unusual_finish"] += 1
        prompt_tokens, completion_tokens = (_count(usage.get(name)) for name in ("prompt_tokens", "completion_tokens"))
        flight.answer = whole_answer(text, [], reason or pb.GenerationEnd.STOP, prompt_tokens, item.version, item.key,
                                     completion_tokens)
        self.counters["tokens_generated"] += completion_tokens
        self._finished(flight)

    def _fail(self, flight: GenerateFlight, exc: InferCacheError) -> None:
        flight.fail(exc)
        self._finished(flight)

    async def close(self) -> None:
        for flight in self.running:
            flight.dropped = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.runtime.pool.close()


def _count(value) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 32 else 0
