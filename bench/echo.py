"""The baseline: a bare grpc.aio server answering Infer with a fixed response of the same size.

Same API, same client, same number of processes (SO_REUSEPORT) and event loop as the frontends, and
nothing else: the hit path's cost over this is what infercache adds.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os

import grpc
import numpy as np

from infercache.v1 import infercache_pb2 as pb
from harness.servers import free_port
from infercache.v1 import infercache_pb2_grpc
from server.shared import process


class Echo(infercache_pb2_grpc.InferenceCacheServicer):
    def __init__(self) -> None:
        vector = np.random.default_rng(0).standard_normal(384).astype(np.float32)
        self.response = pb.InferResponse(
            outputs=[pb.Tensor(name="embedding", dtype="float32", shape=[384], data=vector.tobytes())],
            cache=pb.CacheInfo(model_version="1", key="00" * 24),
        )

    async def Infer(self, request, context):
        return self.response


def serve(port: int, ready, register, options: list | None = None) -> None:
    """One server process on `port` (SO_REUSEPORT: several share it); register(server) adds its handlers;
    `options`: gRPC's, SO_REUSEPORT alone by default."""
    async def serving(stop: asyncio.Event) -> None:
        server = grpc.aio.server(options=options or [("grpc.so_reuseport", 1)])
        register(server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        ready.put(os.getpid())
        await stop.wait()
        await server.stop(1)

    process.run(serving)


def main(port: int, ready) -> None:
    serve(port, ready, lambda server: infercache_pb2_grpc.add_InferenceCacheServicer_to_server(Echo(), server))


def raw_main(port: int, ready, method: str, payload: bytes) -> None:
    """The floor of gRPC itself: `method` answered with fixed bytes, no protobuf parsing or serializing."""
    async def answer(request: bytes, context) -> bytes:
        return payload

    service, name = method.strip("/").split("/")
    handler = grpc.method_handlers_generic_handler(service, {
        name: grpc.unary_unary_rpc_method_handler(answer, request_deserializer=None, response_serializer=None),
    })
    serve(port, ready, lambda server: server.add_generic_rpc_handlers((handler,)))


def http_main(port: int, ready, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    """The floor of the HTTP door's stack (server/frontend/http1.py): every request answered with fixed
    bytes and headers, no JSON or cache work."""
    from server.frontend.http1 import HttpServer, Limits, Response

    async def answer(request) -> Response:
        return Response(200, body, headers)

    async def serving(stop: asyncio.Event) -> None:
        server = HttpServer(answer, Limits(4 << 20))
        await server.start("127.0.0.1", port)
        ready.put(os.getpid())
        await stop.wait()
        await server.stop(1)

    process.run(serving)


def start(processes: int, target=main, *args) -> tuple[str, list]:
    """`processes` spawned servers sharing one free port; (address, processes) once all are listening."""
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(port, ready, *args), daemon=True) for _ in range(processes)]
    for proc in procs:
        proc.start()
    for _ in procs:
        ready.get(timeout=60)
    return f"127.0.0.1:{port}", procs


def stop(procs) -> None:
    for proc in procs:
        proc.terminate()
        proc.join(10)
