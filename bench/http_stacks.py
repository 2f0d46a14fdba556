"""Bare HTTP servers of the stacks the OpenAI door could have been built on, each answering every request
with the same fixed bytes: the door's own (asyncio and httptools, server/frontend/http1.py; bench/echo.py
http_main), aiohttp's low-level server on uvloop, and granian (a Rust server) running an RSGI app. The
doors section measures them with one client (bench/http_load.py): docs/architecture.md#the-doors says
what the choice rests on."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

from server.shared import process

BODY = os.environ.get("BENCH_HTTP_BODY", "").encode()  # granian's app reads its answer from the environment


def aiohttp_main(port: int, ready, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    from aiohttp import web

    fixed = {name.decode(): value.decode() for name, value in headers}

    async def answer(request: web.BaseRequest) -> web.Response:
        await request.read()
        return web.Response(body=body, headers=fixed, content_type="application/json")

    async def serving(stop: asyncio.Event) -> None:
        server = web.Server(answer)
        runner = web.ServerRunner(server, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", port, reuse_port=True)
        await site.start()
        ready.put(os.getpid())
        await stop.wait()
        await runner.cleanup()

    process.run(serving)


async def rsgi_app(scope, protocol) -> None:
    """granian's RSGI entry: the fixed answer (headers from BENCH_HTTP_HEADERS, name:value;...)."""
    await protocol()
    headers = [tuple(pair.split(":", 1)) for pair in os.environ.get("BENCH_HTTP_HEADERS", "").split(";") if pair]
    protocol.response_bytes(status=200, headers=[("content-type", "application/json"), *headers], body=BODY)


def start_granian(port: int, processes: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> subprocess.Popen:
    env = {**os.environ, "BENCH_HTTP_BODY": body.decode(),
           "BENCH_HTTP_HEADERS": ";".join(f"{n.decode()}:{v.decode()}" for n, v in headers)}
    proc = subprocess.Popen([sys.executable, "-m", "granian", "--interface", "rsgi", "--host", "127.0.0.1", "--port",
                             str(port), "--workers", str(processes), "--loop", "uvloop", "--no-ws",
                             "--log-level", "warning", "bench.http_stacks:rsgi_app"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import socket

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("granian did not start")
