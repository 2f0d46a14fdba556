"""Closed-loop load generator: `concurrency` callers, each sending its next request when the last returns."""

from __future__ import annotations

import asyncio
import functools
import itertools
import os
import queue
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np

from harness.servers import REPO
from infercache.v1 import infercache_pb2 as pb
from infercache.v1 import infercache_pb2_grpc


def minilm_only(root: Path, extra_config: str = "") -> Path:
    """A repository of the shipped minilm alone (its config, plus `extra_config`; weights linked)."""
    (root / "minilm").mkdir(parents=True)
    config = (REPO / "models" / "minilm" / "config.yaml").read_text() + extra_config
    (root / "minilm" / "config.yaml").write_text(config)
    (root / "minilm" / "1").symlink_to(REPO / "models" / "minilm" / "1")
    return root


@dataclass
class LoadResult:
    requests: int
    errors: int
    seconds: float
    latencies_ms: np.ndarray
    sources: dict[str, int]

    @property
    def throughput(self) -> float:
        return self.requests / self.seconds

    def summary(self) -> dict:
        lat = self.latencies_ms
        return {
            "requests": self.requests, "errors": self.errors, "seconds": round(self.seconds, 3),
            "throughput_rps": round(self.throughput, 1),
            "p50_ms": round(float(np.percentile(lat, 50)), 3) if len(lat) else None,
            "p99_ms": round(float(np.percentile(lat, 99)), 3) if len(lat) else None,
            "sources": self.sources,
        }


async def _connected(address: str, count: int) -> list:
    """`count` (at least one) channels of their own, each its own connection (a local subchannel pool:
    SO_REUSEPORT spreads connections, not channels, over the server's processes), all ready."""
    channels = [grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(max(1, count))]
    for channel in channels:
        await channel.channel_ready()
    return channels


async def run_load(address: str, requests: list[pb.InferRequest], *, concurrency: int, total: int,
                   channels: int = 16, timeout: float = 30.0, metadata: tuple | None = None) -> LoadResult:
    """Sends `total` requests cycling through `requests`. Many channels (connections), so that
    SO_REUSEPORT's hashing spreads them evenly over the server's processes: with 4 connections on 2
    processes one process often gets 3, and the run measures that imbalance instead of the server."""
    opened = await _connected(address, min(channels, concurrency))
    calls = [functools.partial(infercache_pb2_grpc.InferenceCacheStub(c).Infer, timeout=timeout, metadata=metadata)
             for c in opened]
    try:
        return await _closed_loop(calls, requests, concurrency, total,
                                  lambda response: pb.CacheInfo.Source.Name(response.cache.source))
    finally:
        for channel in opened:
            await channel.close()


async def _closed_loop(calls: list, requests: list, concurrency: int, total: int, source_of=None) -> LoadResult:
    """`concurrency` callers over `calls` (one each, round robin), `total` requests cycling through
    `requests`; `source_of(answer)`: the name an answer is counted under (None: not counted)."""
    pending = iter(itertools.islice(itertools.cycle(requests), total))
    latencies: list[float] = []
    sources: dict[str, int] = {}
    errors = 0

    async def caller(call) -> None:
        nonlocal errors
        for request in pending:
            started = time.perf_counter()
            try:
                answer = await call(request)
            except grpc.aio.AioRpcError:
                errors += 1
                continue
            latencies.append((time.perf_counter() - started) * 1000)
            if source_of is not None:
                name = source_of(answer)
                sources[name] = sources.get(name, 0) + 1

    started = time.perf_counter()
    await asyncio.gather(*(caller(calls[i % len(calls)]) for i in range(concurrency)))
    return LoadResult(len(latencies), errors, time.perf_counter() - started, np.array(latencies), sources)


def warm(address: str, requests: list[pb.InferRequest], metadata: tuple | None = None) -> None:
    """Sends each request once, then waits until the write-behind has committed every entry."""
    with grpc.insecure_channel(address) as channel:
        stub = infercache_pb2_grpc.InferenceCacheStub(channel)
        for request in requests:
            stub.Infer(request, timeout=30, metadata=metadata)
        deadline = time.monotonic() + 30
        for request in requests:
            cached = pb.InferRequest()
            cached.CopyFrom(request)
            cached.cache.mode = pb.CachePolicy.ONLY_IF_CACHED
            while True:
                try:
                    stub.Infer(cached, timeout=30, metadata=metadata)
                    break
                except grpc.RpcError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.01)


# ---- several load processes, raw bytes ----------------------------------------------------------------

CHANNELS_PER_PROCESS = 16
START_GATE_S = 120.0  # load processes start, import and connect within this
INFER = "/infercache.v1.InferenceCache/Infer"

@dataclass
class ProcessLoad:
    """What one call shape costs at a fixed number of callers, summed over load processes."""

    calls: int
    errors: int
    seconds: float
    latencies_ms: np.ndarray
    items_per_call: int
    error_codes: dict[str, int]
    load_cpu_s: float = 0.0          # CPU seconds of the load processes over the measured window
    host_cores_busy: float | None = None  # the whole host's busy cores meanwhile (/proc/stat), where known

    def summary(self) -> dict:
        lat = self.latencies_ms
        out = {
            "calls": self.calls, "errors": self.errors, "error_codes": self.error_codes,
            "seconds": round(self.seconds, 3),
            "calls_per_s": round(self.calls / self.seconds, 1),
            "items_per_s": round(self.calls * self.items_per_call / self.seconds, 1),
            "p50_ms": round(float(np.percentile(lat, 50)), 3) if len(lat) else None,
            "p99_ms": round(float(np.percentile(lat, 99)), 3) if len(lat) else None,
            "max_ms": round(float(lat.max()), 3) if len(lat) else None,
        }
        if self.load_cpu_s:
            out["load_generator_cores"] = round(self.load_cpu_s / self.seconds, 2)
        if self.host_cores_busy is not None:
            out["host_cores_busy"] = round(self.host_cores_busy, 2)
            if self.calls:  # what one call costs the whole host, load generator included
                out["host_cpu_us_per_call"] = round(self.host_cores_busy * 1e6 / (self.calls / self.seconds), 1)
        return out


def host_cpu() -> tuple[int, int] | None:
    """(busy, total) jiffies of all CPUs since boot (/proc/stat), None where unreadable."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields[:8]) - idle, sum(fields[:8])


def host_cores_busy(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1]) * (os.cpu_count() or 1)


async def _raw_callers(address: str, method: str, payloads: list[bytes], concurrency: int, seconds: float,
                       warmup_s: float, timeout: float, start: int) -> tuple[int, int, list[float], dict, float, float | None]:
    """Callers sending pre-serialized requests and taking raw response bytes: the generator itself does
    no protobuf work, so it is not what a run measures. One connection per caller up to
    CHANNELS_PER_PROCESS: SO_REUSEPORT hashes connections onto the server's processes, and with few of
    them some frontends get several and others none (measured on an H200 host: 32 connections over 16
    frontends left the busiest frontend saturated while the mean was half busy)."""
    channels, calls = await _raw_calls(address, method, concurrency)
    latencies: list[float] = []
    codes: dict[str, int] = {}
    counter = itertools.count(start)
    loop = asyncio.get_running_loop()
    measure_from = loop.time() + warmup_s
    stop_at = measure_from + seconds

    async def caller(call) -> None:
        while (now := loop.time()) < stop_at:
            payload = payloads[next(counter) % len(payloads)]
            started = time.perf_counter()
            try:
                await call(payload, timeout=timeout)
            except grpc.aio.AioRpcError as exc:
                if now >= measure_from:
                    codes[exc.code().name] = codes.get(exc.code().name, 0) + 1
                continue
            if now >= measure_from:
                latencies.append((time.perf_counter() - started) * 1000)

    async def window() -> tuple[float, float | None]:
        """This process's CPU seconds and the host's busy cores over the measured window."""
        await asyncio.sleep(max(0.0, measure_from - loop.time()))
        cpu, host = time.process_time(), host_cpu()
        await asyncio.sleep(max(0.0, stop_at - loop.time()))
        return time.process_time() - cpu, host_cores_busy(host, host_cpu())

    measuring = asyncio.ensure_future(window())
    await asyncio.gather(*(caller(calls[i % len(calls)]) for i in range(concurrency)))
    cpu_s, host_busy = await measuring
    for channel in channels:
        await channel.close()
    return len(latencies), sum(codes.values()), latencies, codes, cpu_s, host_busy


def _event_loop_runner():
    try:
        from uvloop import run  # the same event loop as the servers: a lighter load generator
    except ImportError:  # pragma: no cover
        run = asyncio.run
    return run


async def _raw_calls(address: str, method: str, concurrency: int) -> tuple[list, list]:
    """(channels, calls of `method` on each, bytes in and out) for `concurrency` callers: one connection
    per caller up to CHANNELS_PER_PROCESS."""
    channels = await _connected(address, min(CHANNELS_PER_PROCESS, concurrency))
    return channels, [c.unary_unary(method, request_serializer=None, response_deserializer=None) for c in channels]


async def run_raw_load(address: str, method: str, payloads: list[bytes], *, concurrency: int, total: int
                       ) -> LoadResult:
    """run_load with pre-serialized requests and raw response bytes (no protobuf work in the generator),
    `total` calls of `method` cycling through `payloads`. Sources are not read: warm() beforehand makes
    every call a hit."""
    channels, calls = await _raw_calls(address, method, concurrency)
    try:
        return await _closed_loop([functools.partial(call, timeout=30) for call in calls], payloads, concurrency,
                                  total)
    finally:
        for channel in channels:
            await channel.close()


def _load_process(args, out) -> None:
    address, method, payloads, concurrency, seconds, warmup_s, timeout, start = args
    calls, errors, latencies, codes, cpu_s, host_busy = _event_loop_runner()(
        _raw_callers(address, method, payloads, concurrency, seconds, warmup_s, timeout, start))
    out.put((calls, errors, np.array(latencies, dtype=np.float64).tobytes(), codes, cpu_s, host_busy))


def run_load_processes(address: str, method: str, payloads: list[bytes], *, processes: int, concurrency: int,
                       seconds: float, items_per_call: int = 1, warmup_s: float = 1.0,
                       timeout: float = 30.0) -> ProcessLoad:
    """`processes` load processes with `concurrency` callers each, for `seconds` after `warmup_s`;
    each process cycles through its own share of `payloads`, so no two callers send the same request
    until a share is used up."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    shares = [payloads[i::processes] or payloads for i in range(processes)]
    procs = [ctx.Process(target=_load_process, daemon=True,
                         args=((address, method, shares[i], concurrency, seconds, warmup_s, timeout, 0), out))
             for i in range(processes)]
    for proc in procs:
        proc.start()
    parts = [out.get(timeout=seconds + warmup_s + timeout + 120) for _ in procs]
    for proc in procs:
        proc.join(10)
    codes: dict[str, int] = {}
    for part in parts:
        for code, n in part[3].items():
            codes[code] = codes.get(code, 0) + n
    latencies = np.concatenate([np.frombuffer(p[2], dtype=np.float64) for p in parts])
    hosts = [p[5] for p in parts if p[5] is not None]  # every process saw the same host: their mean
    return ProcessLoad(sum(p[0] for p in parts), sum(p[1] for p in parts), seconds, latencies, items_per_call, codes,
                       sum(p[4] for p in parts), statistics.mean(hosts) if hosts else None)


# ---- each request once, raw bytes --------------------------------------------------------------------

async def _each_once(address: str, payloads: list[bytes], concurrency: int, timeout: float, metadata, start_gate
                     ) -> tuple[float, float, list[float], list[bytes | None]]:
    """Sends every payload once from `concurrency` callers once `start_gate` opens: (first send, last
    answer) on the monotonic clock (shared by the host's processes), latencies, and each response's bytes
    (None for an error)."""
    channels, calls = await _raw_calls(address, INFER, concurrency)
    start_gate.wait(START_GATE_S)  # every load process connected: they start together (BrokenBarrierError if not)
    pending = iter(enumerate(payloads))
    responses: list[bytes | None] = [None] * len(payloads)
    latencies: list[float] = []

    async def caller(call) -> None:
        for i, payload in pending:
            sent = time.perf_counter()
            try:
                responses[i] = await call(payload, timeout=timeout, metadata=metadata)
            except grpc.aio.AioRpcError:
                continue
            latencies.append((time.perf_counter() - sent) * 1000)

    began = time.monotonic()
    await asyncio.gather(*(caller(calls[i % len(calls)]) for i in range(concurrency)))
    ended = time.monotonic()
    for channel in channels:
        await channel.close()
    return began, ended, latencies, responses


def _each_once_process(args, out) -> None:
    began, ended, latencies, responses = _event_loop_runner()(_each_once(*args))
    out.put((began, ended, np.array(latencies, dtype=np.float64).tobytes(), responses))


def run_each_once(address: str, requests: list[pb.InferRequest], *, concurrency: int, processes: int = 1,
                  timeout: float = 30.0, metadata: tuple | None = None) -> LoadResult:
    """Sends every request exactly once from `concurrency` callers spread over `processes` load processes
    (uvloop; requests serialized beforehand and responses parsed after the clock stops, so the load
    generator's protobuf work is not on the measured path). Sources are counted from the responses."""
    import multiprocessing

    processes = max(1, min(processes, concurrency))
    gate = multiprocessing.get_context("spawn").Barrier(processes)  # (after the clamp: a party short waits forever)
    payloads = [r.SerializeToString() for r in requests]
    callers = [concurrency // processes + (i < concurrency % processes) for i in range(processes)]
    # a load process that dies (an error outside gRPC's) fails the run
    parts = run_children(_each_once_process, [((address, payloads[i::processes], callers[i], timeout, metadata,
                                                gate),) for i in range(processes)],
                         START_GATE_S + timeout * len(payloads) / concurrency + 60)
    errors, sources = answered_sources(r for part in parts for r in part[3])
    seconds = max(p[1] for p in parts) - min(p[0] for p in parts)
    latencies = np.concatenate([np.frombuffer(p[2], dtype=np.float64) for p in parts])
    return LoadResult(len(latencies), errors, seconds, latencies, sources)


def run_children(target, arguments: list[tuple], timeout_s: float) -> list:
    """target(*args, out) in a spawned process for each args of `arguments`, each putting one result on
    `out`; the results, in no set order. A child that dies without one, or a run past `timeout_s`, kills
    the others and raises (a parent that only waited would wait forever)."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args, out), daemon=True) for args in arguments]
    for proc in procs:
        proc.start()
    results, deadline = [], time.monotonic() + timeout_s
    while len(results) < len(procs):
        try:
            results.append(out.get(timeout=1.0))
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                for proc in procs:
                    proc.kill()
                raise RuntimeError(f"child processes failed (exit codes {dead}) or ran past {timeout_s:.0f} s")
    for proc in procs:
        proc.join(10)
    return results


def answered_sources(responses) -> tuple[int, dict[str, int]]:
    """(errors, answers by CacheInfo source) of serialized InferResponses, None for a failed call."""
    sources: dict[str, int] = {}
    errors = 0
    for response in responses:
        if response is None:
            errors += 1
            continue
        name = pb.CacheInfo.Source.Name(pb.InferResponse.FromString(response).cache.source)
        sources[name] = sources.get(name, 0) + 1
    return errors, sources
