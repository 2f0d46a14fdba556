"""Closed-loop HTTP/1.1 load: `concurrency` callers, each on a keep-alive connection of its own, sending
pre-built requests and reading whole responses (Content-Length framed) with no HTTP library on the
measured path, so the generator costs every server alike. Sources are read from x-infercache-source."""

from __future__ import annotations

import asyncio
import itertools
import time

import numpy as np

from bench.load import LoadResult

_SOURCE = b"\r\nx-infercache-source: "
_LENGTH = b"\r\ncontent-length: "


def post(path: str, body: bytes, headers: dict[str, str] | None = None) -> bytes:
    """A request as sent on the wire (HTTP/1.1, keep-alive)."""
    extra = "".join(f"{name}: {value}\r\n" for name, value in (headers or {}).items())
    return (f"POST {path} HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n{extra}\r\n").encode() + body


class _Caller(asyncio.Protocol):
    def __init__(self) -> None:
        self.buffer = b""
        self.waiting: asyncio.Future | None = None
        self.transport = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            return
        header = self.buffer[:end].lower()
        length, at = 0, header.find(_LENGTH)
        if at >= 0:
            stop = header.find(b"\r\n", at + 2)
            length = int(header[at + len(_LENGTH):stop if stop >= 0 else None])
        if len(self.buffer) < end + 4 + length:
            return
        response, self.buffer = self.buffer[:end + 4 + length], self.buffer[end + 4 + length:]
        if self.waiting is not None and not self.waiting.done():
            self.waiting.set_result(response)

    def connection_lost(self, exc) -> None:
        if self.waiting is not None and not self.waiting.done():
            self.waiting.set_exception(ConnectionError("server closed the connection"))

    async def call(self, request: bytes) -> bytes:
        self.waiting = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        return await self.waiting


def status_and_source(response: bytes) -> tuple[int, str]:
    status = int(response[9:12])
    at = response.lower().find(_SOURCE)
    source = response[at + len(_SOURCE):response.index(b"\r\n", at + 2)].decode() if at >= 0 else ""
    return status, source


async def run_http_load(host: str, port: int, requests: list[bytes], *, concurrency: int, total: int
                        ) -> LoadResult:
    """Sends `total` requests cycling through `requests`; an answer other than 200 is an error."""
    loop = asyncio.get_running_loop()
    callers = []
    for _ in range(concurrency):
        _, caller = await loop.create_connection(_Caller, host, port)
        callers.append(caller)
    source = iter(itertools.islice(itertools.cycle(requests), total))
    latencies: list[float] = []
    sources: dict[str, int] = {}
    errors = 0

    async def run(caller: _Caller) -> None:
        nonlocal errors
        for request in source:
            started = time.perf_counter()
            response = await caller.call(request)
            latencies.append((time.perf_counter() - started) * 1000)
            status, name = status_and_source(response)
            if status != 200:
                errors += 1
            sources[name] = sources.get(name, 0) + 1

    started = time.perf_counter()
    await asyncio.gather(*(run(caller) for caller in callers))
    seconds = time.perf_counter() - started
    for caller in callers:
        caller.transport.close()
    return LoadResult(len(latencies) - errors, errors, seconds, np.array(latencies), sources)


async def run_http_for(host: str, port: int, requests: list[bytes], *, concurrency: int, seconds: float,
                       timeout_s: float = 5.0) -> tuple[int, int]:
    """Callers on connections of their own send `requests` in turn until `seconds` pass, each answer
    awaited for at most `timeout_s` (a caller whose answer did not come opens a new connection);
    (answered 200, failed or unanswered)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    source = itertools.cycle(requests)
    counts = [0, 0]

    async def run() -> None:
        caller = None
        while loop.time() < deadline:
            try:
                if caller is None:
                    _, caller = await asyncio.wait_for(loop.create_connection(_Caller, host, port), timeout_s)
                response = await asyncio.wait_for(caller.call(next(source)), timeout_s)
            except (OSError, asyncio.TimeoutError):
                counts[1] += 1
                if caller is not None:
                    caller.transport.close()
                caller = None
                continue
            counts[status_and_source(response)[0] != 200] += 1
        if caller is not None:
            caller.transport.close()

    await asyncio.gather(*(run() for _ in range(concurrency)))
    return counts[0], counts[1]


def _load_process(host: str, port: int, requests: list[bytes], concurrency: int, gate, out) -> None:
    import uvloop

    async def run() -> tuple[float, LoadResult, float]:
        gate.wait(timeout=120)  # every process started: they send together
        started = time.monotonic()
        result = await run_http_load(host, port, requests, concurrency=concurrency, total=len(requests))
        return started, result, time.monotonic()

    started, result, ended = uvloop.run(run())
    out.put((started, ended, result.requests, result.errors, result.latencies_ms.tobytes()))


def run_http_processes(host: str, port: int, requests: list[bytes], *, processes: int, concurrency: int,
                       timeout_s: float = 900.0) -> LoadResult:
    """run_http_load from `processes` processes of `concurrency` callers each, every request sent once
    (each process its share); the run lasts from the first process's start to the last one's end."""
    import multiprocessing

    from bench.load import run_children

    gate = multiprocessing.get_context("spawn").Barrier(processes)
    parts = run_children(_load_process, [(host, port, requests[i::processes], concurrency, gate)
                                         for i in range(processes)], timeout_s)
    latencies = np.concatenate([np.frombuffer(p[4], dtype=np.float64) for p in parts])
    return LoadResult(sum(p[2] for p in parts), sum(p[3] for p in parts),
                      max(p[1] for p in parts) - min(p[0] for p in parts), latencies, {})
