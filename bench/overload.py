"""Overload section (`make bench ARGS="--sections overload"`): thousands of misses at once.

The case it measures: 3,000 concurrent misses of about 210 tokens, each with a deadline, against one
inference worker whose queue holds far more work than the deadline allows. Every call is sent at once
(no closed loop), to a server with the default frontends (one per CPU). Reported: how many got each status code, how long the refusals (RESOURCE_EXHAUSTED)
took against the admitted calls, how many admitted calls ran into their deadline, and where the
refusals were decided (the frontend, from the queue wait the worker tells it with each answer frame,
or the worker itself). Expected: no DEADLINE_EXCEEDED, no UNAVAILABLE, refusals well before the deadline.

The same client also floods, in the same run, a refusal floor: as many grpc.aio processes as the server
has frontends, refusing every call at once with RESOURCE_EXHAUSTED and doing nothing else. Its latencies
are the fastest refusals this machine's gRPC and this client can give the burst; the server's refusals
are read against them (on 2 cores the burst itself, not the server, takes much of the time).

And it floods a bare grpc.aio server with gRPC's default options (one process, every call sleeps 1 s or
half the deadline, no work): with a few thousand calls waiting for the application to take them up, gRPC
core cancels a random share (about 550 of 3,000 on a 2-core host). The frontends raise that limit
(server.max_pending_calls), so the server's row should show no CANCELLED.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import time
from collections import Counter
from pathlib import Path

import grpc
import numpy as np

from bench import echo
from bench.probes import cpu_during, frontend_pids
from bench.load import minilm_only
from bench.sections import Run
from harness.servers import ServerProcess, free_port
from infercache.v1 import infercache_pb2 as pb
from infercache.v1 import infercache_pb2_grpc
from server.config import Config
from server.frontend.process import server_options


def _ms(values: list[float]) -> dict:
    if not values:
        return {"count": 0}
    return {"count": len(values), "p50_ms": round(float(np.percentile(values, 50)), 1),
            "p99_ms": round(float(np.percentile(values, 99)), 1), "max_ms": round(max(values), 1)}


def _bare_server(port: int, sleep_s: float) -> None:
    """A grpc.aio server whose Infer sleeps and answers an empty response (the gRPC baseline)."""
    async def main():
        async def infer(request, context):
            await asyncio.sleep(sleep_s)
            return b""
        server = grpc.aio.server()
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
            "infercache.v1.InferenceCache", {"Infer": grpc.unary_unary_rpc_method_handler(infer)})])
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()
    asyncio.run(main())


def refusing_main(port: int, ready) -> None:
    """One process of the refusal floor: Infer answered RESOURCE_EXHAUSTED at once, with no work (gRPC
    options as the frontends', so that gRPC itself sheds none of the burst)."""
    async def refuse(request: bytes, context) -> bytes:
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "refused")

    handler = grpc.method_handlers_generic_handler("infercache.v1.InferenceCache", {
        "Infer": grpc.unary_unary_rpc_method_handler(refuse, request_deserializer=None, response_serializer=None)})
    echo.serve(port, ready, lambda server: server.add_generic_rpc_handlers((handler,)), server_options(Config()))


async def _flood(address: str, texts: list[str], deadline_s: float, channels: int = 8) -> list[tuple[str, float]]:
    opened = [grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
              for _ in range(channels)]
    stubs = [infercache_pb2_grpc.InferenceCacheStub(c) for c in opened]
    for channel in opened:
        await channel.channel_ready()

    async def call(n: int, text: str) -> tuple[str, float]:
        started = time.perf_counter()
        try:
            await stubs[n % channels].Infer(pb.InferRequest(model="minilm", text=text), timeout=deadline_s)
            code = "OK"
        except grpc.aio.AioRpcError as exc:
            code = exc.code().name
        return code, (time.perf_counter() - started) * 1000

    try:
        return await asyncio.gather(*(call(n, text) for n, text in enumerate(texts)))
    finally:
        for channel in opened:
            await channel.close()


def _flood_measured(address: str, texts: list[str], deadline_s: float, pids: list[int]
                    ) -> tuple[list[tuple[str, float]], float]:
    """_flood, and the CPU seconds the processes `pids` used meanwhile."""
    return cpu_during(pids, lambda: asyncio.run(_flood(address, texts, deadline_s)))


def bench_overload(workdir: Path, texts: list[str], scale: float, deadline_s: float = 10.0,
                   settings: tuple[str, ...] = ()) -> dict:
    """deadline_s: each call's; on a GPU host a short one (0.5 s) makes 3,000 misses an overload.
    settings: the server's --set items (e.g. engines.runtime=onnxruntime: a CPU-bound model on a GPU host)."""
    calls = max(300, int(3000 * scale))
    models = minilm_only(workdir / "models")
    (workdir / "server").mkdir()
    frontends = os.cpu_count() or 1  # the server's default: one per CPU
    server = ServerProcess(workdir / "server", models, frontends=frontends, settings=settings)
    try:
        # About 210 tokens each, all distinct: every call is a miss.
        long = [(f"#{n} " + " ".join(texts[(n + k) % len(texts)] for k in range(18)))[:1000] for n in range(calls)]
        frontends_at = frontend_pids(server)
        started = time.perf_counter()
        answers, frontends_cpu_s = _flood_measured(server.address, long, deadline_s, frontends_at)
        wall = time.perf_counter() - started
        stats = server.stats()
    finally:
        server.stop()
    port = free_port()
    bare = multiprocessing.get_context("spawn").Process(target=_bare_server, args=(port, min(1.0, deadline_s / 2)),
                                                        daemon=True)
    bare.start()
    try:
        bare_answers = asyncio.run(_flood(f"127.0.0.1:{port}", long, deadline_s))
    finally:
        bare.terminate()
    address, procs = echo.start(frontends, refusing_main)
    try:
        floor_answers, floor_cpu_s = _flood_measured(address, long, deadline_s, [proc.pid for proc in procs])
    finally:
        echo.stop(procs)
    codes = Counter(code for code, _ in answers)
    refused = _ms([ms for code, ms in answers if code == "RESOURCE_EXHAUSTED"])
    floor = _ms([ms for code, ms in floor_answers if code == "RESOURCE_EXHAUSTED"])
    worker = stats.worker.counters
    return {
        "calls": calls, "deadline_s": deadline_s, "frontends": frontends, "settings": list(settings),
        "wall_s": round(wall, 2), "codes": dict(codes),
        "bare_grpc_server_codes": dict(Counter(code for code, _ in bare_answers)),
        "refused": refused,
        "refusal_floor": {**floor, "codes": dict(Counter(code for code, _ in floor_answers))},
        "refused_vs_floor": {f"{q}_ratio": round(refused[f"{q}_ms"] / floor[f"{q}_ms"], 2)
                             for q in ("p50", "p99") if refused["count"] and floor["count"] and floor[f"{q}_ms"]},
        "admitted": _ms([ms for code, ms in answers if code == "OK"]),
        # Microseconds of CPU per call the frontends (the floor's processes) used while the client sent
        # the burst and took its answers (the admitted calls' work included): a refusal's cost beside
        # the floor's
        "cpu_us_per_call": {"frontends": round(frontends_cpu_s / calls * 1e6), "floor": round(floor_cpu_s / calls * 1e6)},
        # GetStats shows the answering frontend only: this is one frontend's refusals.
        "refused_by_one_frontend": stats.frontend.counters["frontend.rejected_wait"],
        "refused_by_worker": worker["batcher.minilm.1.rejected_wait"] + worker["batcher.minilm.1.rejected_full"],
        "worker_batcher": {k.split(".")[-1]: v for k, v in worker.items() if k.startswith("batcher.minilm.1.")},
        "mean_batch": round(worker["batcher.minilm.1.batched_requests"] / max(1, worker["batcher.minilm.1.batches"]), 1),
    }


def print_overload(report: dict) -> None:
    print(f"\noverload: {report['calls']} misses at once, {report['deadline_s']:g} s deadline, "
          f"{report['frontends']} frontends, wall {report['wall_s']} s")
    print(f"  codes: {report['codes']}; a bare grpc.aio server, same client: {report['bare_grpc_server_codes']}")
    for name in ("refused", "admitted"):
        part = report[name]
        if part["count"]:
            print(f"  {name:9s} {part['count']:5d}  p50 {part['p50_ms']:8.1f} ms  p99 {part['p99_ms']:8.1f} ms  "
                  f"max {part['max_ms']:8.1f} ms")
    floor = report["refusal_floor"]
    if floor["count"]:
        print(f"  refusal floor (a server refusing every call at once, {report['frontends']} processes): "
              f"p50 {floor['p50_ms']:8.1f} ms  p99 {floor['p99_ms']:8.1f} ms; the server's refusals "
              f"{report['refused_vs_floor']}")
    print(f"  CPU per call: the frontends {report['cpu_us_per_call']['frontends']} us, the floor's processes "
          f"{report['cpu_us_per_call']['floor']} us")
    print(f"  refused by one of the frontends: {report['refused_by_one_frontend']}, by the worker: "
          f"{report['refused_by_worker']} on arrival and {report['worker_batcher'].get('shed', 0)} shed from its "
          f"queue; mean batch {report['mean_batch']}")


def section(run: Run) -> None:
    print("benchmarking overload (misses at once against one worker) ...", flush=True)
    run.report["overload"] = bench_overload(run.workdir / "overload", run.texts, run.scale, run.args.overload_deadline,
                                            tuple(filter(None, run.args.overload_settings.split(","))))
    print_overload(run.report["overload"])
