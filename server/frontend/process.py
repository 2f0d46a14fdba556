"""Frontend process: the public gRPC API.

Several frontends listen on one port (SO_REUSEPORT) and do the per-request CPU work in parallel:
validate, normalize, derive the key, read L1, and tokenize what missed. A fresh hit is answered here;
misses go to the inference workers in micro-batches of token ids (server/frontend/workers.py), so the
workers only batch, launch and write behind. Frontends never write the store. This module starts and
stops the process: the core (core.py, admin.py) behind its doors (servicer.py, the native gRPC API;
kserve.py, the KServe v2 gRPC protocol on the same port; openai_api.py over http1.py, the OpenAI-compatible
HTTP door on server.http_port), health, reflection, token reloads, publishing (publishing.py) and the drain.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections import Counter
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from server.config import Config
from server.frontend.core import FrontendCore
from server.frontend.kserve import KServeServicer, add_kserve
from server.frontend.kserve import SERVICE_NAME as KSERVE_SERVICE
from server.frontend.hot_keys import HotKeys
from server.frontend.metrics import FrontendMetrics
from server.frontend.publishing import Published
from server.frontend.servicer import SERVICE_NAME, FrontendServicer, add_servicer
from server.frontend.workers import WorkerPool
from server.shared import process, telemetry
from server.shared.auth import Gate, TokenFileError, read_in_force
from server.shared.models import ModelRepository

log = logging.getLogger("infercache.frontend")


# gRPC reads requests up to this many times server.max_request_bytes, which the handlers refuse past the
# setting with INVALID_ARGUMENT naming it (gRPC's own refusal, RESOURCE_EXHAUSTED, is what clients retry as
# load shedding); further past it gRPC refuses the bytes unread, with its own code, and no more is buffered.
MESSAGE_GUARD = 2


def server_options(config: Config) -> list[tuple[str, int]]:
    """The public server's gRPC options. gRPC core holds calls that arrive before the application asks for
    them (grpc.aio asks one at a time) and, past 1,000 such calls, cancels a random share of new ones, up
    to all past 3,000: a burst of a few thousand calls got CANCELLED for requests no client cancelled.
    Raised to server.max_pending_calls (soft and hard limit alike), overload is left to admission
    control, which answers RESOURCE_EXHAUSTED. Request sizes: MESSAGE_GUARD."""
    pending = config.server.max_pending_calls
    return [("grpc.so_reuseport", 1), ("grpc.server.max_pending_requests", pending),
            ("grpc.server.max_pending_requests_hard_limit", pending),
            ("grpc.max_receive_message_length", MESSAGE_GUARD * config.server.max_request_bytes)]


async def reload_tokens(gate: Gate, path: Path) -> None:
    """At start and on SIGHUP (sent by the supervisor once it changed it): the token set in force, which
    the supervisor alone writes (server/supervisor.py). One that cannot be read keeps the tokens this
    frontend has."""
    try:
        gate.tokens = await asyncio.to_thread(read_in_force, path)
        log.debug("token set in force read: %d token(s)", len(gate.tokens))
    except TokenFileError as exc:
        log.error("token set in force not read, this frontend keeps its tokens: %s", exc)


def listen(server: grpc.aio.Server, address: str, tls: tuple[bytes, bytes, bytes | None] | None) -> int:
    """The public port: plaintext, TLS, or mutual TLS when a client CA is given (clients without a
    certificate it signed fail the handshake). The port number, 0 when it cannot listen."""
    if tls is None:
        return server.add_insecure_port(address)
    cert, key, client_ca = tls
    credentials = grpc.ssl_server_credentials([(key, cert)], root_certificates=client_ca,
                                              require_client_auth=client_ca is not None)
    return server.add_secure_port(address, credentials)


QUIET_S = 0.25  # a drain's quiet spell: no call begun for this long


async def _quiesce(doors: list, limit_s: float) -> None:
    """A drain's first step: serve on until no call has begun at any door for QUIET_S (or limit_s passed).
    gRPC's stop cancels the calls its transport already holds but the server has not taken up yet
    (CANCELLED, grpc/grpc#41785), and a loaded frontend can hold a burst of them; each one taken up here is
    answered."""
    loop = asyncio.get_running_loop()
    until, seen = loop.time() + limit_s, -1
    while (begun := sum(door.calls for door in doors)) != seen and loop.time() < until:
        seen = begun
        await asyncio.sleep(min(QUIET_S, max(0.0, until - loop.time())))


async def _serve(config: Config, index: int, socket_paths: list[Path], ready, stop: asyncio.Event,
                 metrics_dir: Path | None = None, tokens_path: Path | None = None) -> None:
    repository = ModelRepository.of(config)
    counters: Counter[str] = Counter()
    workers = WorkerPool(socket_paths, wait_s=config.server.worker_wait_s,
                         default_timeout_s=config.server.worker_timeout_s, counters=counters,
                         max_queue_wait_s=config.server.max_queue_wait_s)
    fleet = None
    if config.fleet.redis:  # redis-py is imported only then
        from server.fleet import tier

        fleet = tier.start(config, filter_dir=socket_paths[0].parent, filter_role="reader")
    metrics = FrontendMetrics(repository.models) if config.server.metrics_port else None
    hot = HotKeys(config.server.hot_keys) if config.server.hot_keys else None
    core = FrontendCore(config, repository, workers, counters, fleet, metrics, hot)
    core.prepare_models()
    core.l1()
    publisher = None
    if metrics_dir is not None and (metrics is not None or hot is not None):
        published = Published(core, metrics_dir, index)
        core.hot_published = published.hot_keys
        publisher = telemetry.Publisher(published.path, published.snapshot, published.refresh)
    server = grpc.aio.server(options=server_options(config))
    gate = Gate(config.secrets.tokens)
    servicer = FrontendServicer(core, gate)
    add_servicer(servicer, server)
    doors: list = [servicer]
    services = [SERVICE_NAME]
    if config.server.kserve:
        kserve = KServeServicer(core, gate)
        add_kserve(kserve, server, config.server.max_request_bytes)
        doors.append(kserve)
        services.append(KSERVE_SERVICE)
    http = None
    if config.server.http_port:  # httptools and orjson are imported only then
        from server.frontend import http1
        from server.frontend.openai_api import OpenAIDoor
        from server.frontend.openai_wire import SINGLE_HEADERS

        limits = http1.Limits(config.server.max_request_bytes, config.server.http_header_timeout_s,
                              config.server.http_request_timeout_s, config.server.http_max_client_connections,
                              SINGLE_HEADERS)
        http = http1.HttpServer(OpenAIDoor(core, gate).handle, limits)
        doors.append(http)
    if tokens_path is not None:
        loop, reloads = asyncio.get_running_loop(), set()  # tasks referenced until done

        def on_sighup() -> None:
            task = loop.create_task(reload_tokens(gate, tokens_path))
            reloads.add(task)
            task.add_done_callback(reloads.discard)
        loop.add_signal_handler(signal.SIGHUP, on_sighup)
        # After the handler is in place: a change made while this process started reaches it either way.
        await reload_tokens(gate, tokens_path)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((*services, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    address = f"{config.server.host}:{config.server.port}"
    try:
        port = listen(server, address, config.secrets.tls)
    except RuntimeError:  # (grpcio raises where the port cannot be bound; older releases returned 0)
        port = 0
    if port == 0:
        raise SystemExit(f"frontend {index}: cannot listen on {address}")
    await server.start()
    if http is not None:
        tls = http1.tls_context(*config.secrets.tls) if config.secrets.tls is not None else None
        try:
            await http.start(config.server.host, config.server.http_port, tls)
        except OSError as exc:
            raise SystemExit(f"frontend {index}: cannot listen on {config.server.host}:{config.server.http_port} "
                             f"(server.http_port): {exc}") from None

    async def serving_once_worker_is_up() -> None:
        # Hits are answered from the start; health says SERVING, and the supervisor hears this frontend
        # is ready, once misses can be computed too: its connection to every worker is open (a worker
        # opens its socket only after loading and warming up every engine). Reporting ready before
        # that let a client that started at "ready" meet a frontend still in its reconnect backoff.
        await workers.all_up()
        for service in ("", SERVICE_NAME):
            await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
        process.settle_gc()
        ready.send(("frontend", index, os.getpid()))

    for service in ("", SERVICE_NAME):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
    health_task = asyncio.get_running_loop().create_task(serving_once_worker_is_up())
    log.info("frontend %d listening on %s%s (pid %d)", index, address,
             f", HTTP on port {config.server.http_port}" if http is not None else "", os.getpid())
    await stop.wait()
    log.info("draining")
    health_task.cancel()
    await health_servicer.enter_graceful_shutdown()
    started = time.monotonic()
    await _quiesce(doors, config.server.drain_s / 2)
    left = max(0.0, config.server.drain_s - (time.monotonic() - started))
    await asyncio.gather(server.stop(left), *([http.stop(left)] if http is not None else []))
    await workers.close()
    if fleet is not None:
        await fleet.close()
    if publisher is not None:
        await publisher.close()  # the last figures
    log.info("frontend stopped")


def main(config: Config, index: int, socket_paths: list[str], ready, metrics_dir: str | None = None,
         tokens_path: Path | None = None) -> None:
    """Entry point of a spawned frontend process."""
    # The frontends are the parallelism: each tokenizes on its own thread, not on a pool per process.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # a reload that arrives before the loop's handler is not an exit
    process.setup_logging(config.server.log_level, f"frontend-{index}")
    process.run(lambda stop: _serve(config, index, [Path(p) for p in socket_paths], ready, stop,
                                    Path(metrics_dir) if metrics_dir else None, tokens_path))
