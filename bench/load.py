"""Closed-loop load generator: `concurrency` callers, each sending its next request when the last returns."""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass

import grpc
import numpy as np

from infercache.v1 import infercache_pb2 as pb
from infercache.v1 import infercache_pb2_grpc


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


async def run_load(address: str, requests: list[pb.InferRequest], *, concurrency: int, total: int,
                   channels: int = 16, timeout: float = 30.0) -> LoadResult:
    """Sends `total` requests cycling through `requests`. Many channels (connections), so that
    SO_REUSEPORT's hashing spreads them evenly over the server's processes: with 4 connections on 2
    processes one process often gets 3, and the run measures that imbalance instead of the server."""
    opened = [grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
              for _ in range(max(1, min(channels, concurrency)))]
    stubs = [infercache_pb2_grpc.InferenceCacheStub(c) for c in opened]
    for channel in opened:
        await channel.channel_ready()
    source = iter(itertools.islice(itertools.cycle(requests), total))
    latencies: list[float] = []
    sources: dict[str, int] = {}
    errors = 0

    async def caller(stub) -> None:
        nonlocal errors
        for request in source:
            started = time.perf_counter()
            try:
                response = await stub.Infer(request, timeout=timeout)
            except grpc.aio.AioRpcError:
                errors += 1
                continue
            latencies.append((time.perf_counter() - started) * 1000)
            name = pb.CacheInfo.Source.Name(response.cache.source)
            sources[name] = sources.get(name, 0) + 1

    started = time.perf_counter()
    await asyncio.gather(*(caller(stubs[i % len(stubs)]) for i in range(concurrency)))
    seconds = time.perf_counter() - started
    for channel in opened:
        await channel.close()
    return LoadResult(len(latencies), errors, seconds, np.array(latencies), sources)
