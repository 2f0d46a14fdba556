"""Supervisor: spawns the inference workers (one per GPU, or one on a CPU host) and the frontends,
restarts them, drains them on SIGTERM.

It opens no gRPC server, no LMDB environment and no CUDA context itself, and starts children with
`spawn`, so no child inherits such state through fork.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import signal
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Callable

from cachestore import integrity
from cachestore.env import DIR_MODE
from server.shared import devices, process
from server import children, mps, ports
from server.shared.auth import TokenFileError, read_tokens, write_in_force
from server.config import Config, feature_store_settings, kv_store_settings
from server.socket_dir import SocketDir, SocketDirBusy

log = logging.getLogger("infercache.supervisor")

STARTUP_TIMEOUT_S = 600.0
STABLE_AFTER_S = 30.0      # a child that lived this long resets its restart backoff
MAX_BACKOFF_S = 10.0


@dataclass
class _Child:
    role: str
    index: int
    target: object
    args: Callable[[Connection], tuple]  # its arguments, given the pipe it says it is ready on
    process: multiprocessing.process.BaseProcess | None = None
    ready: Connection | None = None      # the reading end of that pipe, until it was read or closed
    started: float = 0.0
    failures: int = 0
    restart_at: float | None = None
    pids: list[int] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"


class Supervisor:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.ctx = multiprocessing.get_context("spawn")
        # Each child says it is ready on a pipe of its own: no multiprocessing queue, whose named
        # semaphores a supervisor killed with kill -9 (and its resource tracker with it) left in /dev/shm.
        try:
            self.socket_dir = SocketDir(config.server.socket_dir)  # (a dead supervisor's temporary one goes)
        except SocketDirBusy as exc:
            raise SystemExit(f"infercache: {exc}") from None
        socket_dir = self.socket_dir.path
        # Decided here, before any child exists, without importing torch or touching CUDA.
        self.placements = devices.plan_workers(config.engines.runtime, config.server.workers, devices.visible_gpus(),
                                               config.server.workers_per_gpu)
        cpu_workers = sum(1 for p in self.placements if p.gpu is None)
        shared = any(p.sharing > 1 for p in self.placements)
        self.mps = mps.MpsDaemon(socket_dir) if mps.wanted(config.server.gpu_sharing, shared) else None
        sockets = [str(socket_dir / f"worker-{p.index}.sock") for p in self.placements]
        # The children's published figures (server/shared/telemetry.py): /metrics and hot keys. Emptied here:
        # counters start at zero with each run of the server.
        self.metrics_dir = socket_dir / "metrics"
        shutil.rmtree(self.metrics_dir, ignore_errors=True)
        self.metrics_dir.mkdir(mode=DIR_MODE)
        figures = str(self.metrics_dir)
        self.workers = [_Child("worker", p.index, children.worker,
                               lambda ready, p=p: (config, p, cpu_workers, sockets[p.index], ready, figures))
                        for p in self.placements]
        # The token set in force: this process's alone to change (SIGHUP), every frontend reads it.
        self.tokens_path = socket_dir / "tokens.json" if config.secrets.tokens is not None else None
        if self.tokens_path is not None:
            write_in_force(self.tokens_path, config.secrets.tokens)
        self.frontends = [
            _Child("frontend", i, children.frontend,
                   lambda ready, i=i: (config, i, sockets, ready, figures, self.tokens_path))
            for i in range(config.frontend_count)
        ]
        # This process's figures for /metrics: written by the main thread, read by the metrics thread.
        self.restarts = {"worker": 0, "frontend": 0}
        self.replaced = {"results": 0, "features": 0, "kv": 0}  # damaged stores set aside at start (workers count theirs)
        self.live = {"worker": 0, "frontend": 0}
        self._metrics_server = None
        self._held_ports: list = []  # server/ports.py: the public ports, held while the server runs
        self._stopping = False
        self._reload = False

    def _start(self, child: _Child) -> None:
        if child.ready is not None:
            child.ready.close()
        child.ready, theirs = self.ctx.Pipe(duplex=False)
        child.process = self.ctx.Process(target=child.target, args=child.args(theirs), name=child.name)
        child.process.start()
        theirs.close()  # (the child's copy alone: the pipe ends when the child does)
        child.started = time.monotonic()
        child.restart_at = None

    @staticmethod
    def _heard(child: _Child) -> bool:
        """Whether the child said it is ready (call when its pipe is readable); a pipe that ended, the
        child gone without a word, is closed."""
        try:
            child.ready.recv()
            return True
        except (EOFError, OSError):
            return False
        finally:
            child.ready.close()
            child.ready = None

    def _await_ready(self, children: list[_Child]) -> None:
        """Blocks until each child reported ready; exits if one dies first (a startup error, not a crash)."""
        waiting = list(children)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while waiting and not self._stopping:
            wait([c.ready for c in waiting if c.ready is not None], timeout=0.2)
            waiting = [c for c in waiting if not (c.ready is not None and c.ready.poll() and self._heard(c))]
            for child in waiting:
                if not child.process.is_alive():
                    raise SystemExit(f"infercache: {child.name} exited during startup (code {child.process.exitcode}); see its log above")
            if time.monotonic() > deadline:
                raise SystemExit(f"infercache: startup took longer than {STARTUP_TIMEOUT_S:.0f} s")

    def run(self) -> int:
        try:
            return self._run()
        finally:  # (also when it could not start: SystemExit)
            ports.release(self._held_ports)
            self.socket_dir.release()

    def _claim_ports(self) -> None:
        """Before any child starts: refuses a port something already listens on (another infercache's
        frontends would otherwise share it with this one's), and holds the frontends' ports (server/ports.py)."""
        server = self.config.server
        wanted = [ports.Port(server.host, server.port, "server.port", "--port")]
        if server.http_port:
            wanted.append(ports.Port(server.host, server.http_port, "server.http_port", "--set server.http_port=N"))
        if server.metrics_port:
            wanted.append(ports.Port(server.metrics_host, server.metrics_port, "server.metrics_port",
                                     "--metrics-port", hold=False))
        try:
            self._held_ports = ports.claim(wanted)
        except ports.PortUnavailable as exc:
            raise SystemExit(f"infercache: {exc}") from None

    def _check_stores(self) -> None:
        """Before any child maps the stores: a truncated data file would kill them with SIGBUS, so it is
        set aside. A store folder that is a file stops the start: there is nothing to set aside, and the
        workers could only serve without a store, every request a miss."""
        stores = (("cache.dir", Path(self.config.cache.dir), "result store", "results"),
                  ("l2.dir", feature_store_settings(self.config).path, "feature store", "features"),
                  ("kv.dir", kv_store_settings(self.config).path, "prefix block store", "kv"))
        for setting, path, what, label in stores:
            try:
                if integrity.quarantine_if_damaged(path, what) is not None:
                    self.replaced[label] += 1
            except integrity.NotADirectory as exc:
                raise SystemExit(f"infercache: {setting} {exc}: the {what} needs a directory there; move the "
                                 f"file away or set {setting} to another path") from None
            except OSError as exc:
                log.error("%s not checked: %s", what, exc)

    def _run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGHUP, self._on_reload)
        started = time.monotonic()
        self._claim_ports()
        self._check_stores()
        if self.config.server.metrics_port:
            from server import metrics_http  # prometheus_client: only when /metrics is on

            try:
                self._metrics_server = metrics_http.serve(self.config.server.metrics_host,
                                                          self.config.server.metrics_port, self.metrics_dir,
                                                          self._own_figures)
            except OSError as exc:
                raise SystemExit(f"infercache: cannot serve /metrics on {self.config.server.metrics_host}:"
                                 f"{self.config.server.metrics_port}: {exc}") from None
        self._start_mps()
        # All at once: frontends answer L1 hits without the worker, so a warm pod serves hits while the
        # worker is still loading its models; misses meanwhile wait for it (server.worker_wait_s).
        for child in (*self.workers, *self.frontends):
            self._start(child)
        try:
            self._await_ready([*self.workers, *self.frontends])
        except SystemExit:
            self._stop([*self.frontends, *self.workers])  # or exiting would wait for them forever
            self._stop_mps()
            raise
        server = self.config.server
        workers = ", ".join(f"{p.device} {p.runtime}" for p in self.placements)
        print(
            f"infercache: listening on {server.host}:{server.port} ({len(self.frontends)} frontends, "
            f"{len(self.workers)} worker{'s' if len(self.workers) > 1 else ''}: {workers}; models from "
            f"{server.models_dir}, cache in {self.config.cache.dir})",
            flush=True,
        )
        if server.http_port:
            scheme = "https" if self.config.secrets.tls is not None else "http"
            print(f"infercache: OpenAI-compatible HTTP on {scheme}://{server.host}:{server.http_port}/v1", flush=True)
        if self._metrics_server is not None:
            print(f"infercache: metrics on http://{server.metrics_host}:{server.metrics_port}/metrics", flush=True)
        print(f"infercache: ready in {time.monotonic() - started:.1f} s", flush=True)
        while not self._stopping:
            self._watch()
        return self._drain()

    def _start_mps(self) -> None:
        """The MPS daemon before the workers (server/mps.py); `auto` serves time-sliced without it."""
        if self.mps is None:
            return
        try:
            self.mps.start()
        except mps.MpsUnavailable as exc:
            if self.config.server.gpu_sharing == "mps":
                raise SystemExit(f"infercache: server.gpu_sharing is mps, but {exc}") from None
            log.warning("workers share their GPU time-sliced: %s", exc)
            self.mps = None

    def _restart_mps(self) -> None:
        """Before a worker starts again: the daemon, if it exited. If it cannot start again, workers that
        start from now on share their GPU time-sliced (and name it by its id again: server/worker/process.py)."""
        log.error("the CUDA MPS daemon has exited; starting it again")
        try:
            self.mps.start()
        except mps.MpsUnavailable as exc:
            log.error("CUDA MPS daemon not started (%s): workers that start from now on share their GPU "
                      "time-sliced", exc)
            for name in (mps.PIPE_ENV, mps.LOG_ENV):
                os.environ.pop(name, None)
            self.mps = None

    def _stop_mps(self) -> None:
        if self.mps is not None:
            self.mps.stop()

    def _on_signal(self, signum, frame) -> None:
        self._stopping = True

    def _on_reload(self, signum, frame) -> None:
        """SIGHUP: the token file again (_reload_tokens, on the main loop)."""
        self._reload = True

    def _reload_tokens(self) -> None:
        """Reads the token file; if it loads, makes it the set in force and tells the frontends, which read
        it (server/frontend/process.py); a frontend started later reads the same. A file that does not load keeps
        the tokens in force. Authentication cannot be turned on or off this way, only its tokens changed."""
        self._reload = False
        if self.tokens_path is None:
            log.info("SIGHUP: no security.tokens_file, nothing to reload")
            return
        try:
            tokens = read_tokens(self.config.security.tokens_file)
        except TokenFileError as exc:
            log.error("token file not reloaded, the previous tokens stay in force: %s", exc)
            return
        write_in_force(self.tokens_path, tokens)
        live = [c.process.pid for c in self.frontends if c.process is not None and c.process.is_alive()]
        for pid in live:
            os.kill(pid, signal.SIGHUP)
        log.info("token file reloaded: %d token(s); %d frontend(s) told", len(tokens), len(live))

    def _watch(self) -> None:
        if self._reload:
            self._reload_tokens()
        children = [*self.workers, *self.frontends]
        alive = [c for c in children if c.process is not None and c.process.is_alive()]
        self.live = {role: sum(c.role == role for c in alive) for role in self.live}
        wait([c.process.sentinel for c in alive] + [c.ready for c in children if c.ready is not None], timeout=0.2)
        for child in children:
            if child.ready is not None and child.ready.poll() and self._heard(child):
                log.warning("%s %d is back (pid %d)", child.role, child.index, child.process.pid)
        now = time.monotonic()
        for child in children:
            if self._stopping:
                return
            if child.restart_at is not None:
                if now >= child.restart_at:
                    if child.role == "worker" and self.mps is not None and not self.mps.alive:
                        self._restart_mps()
                    self._start(child)
                continue
            if child.process.is_alive():
                continue
            lived = now - child.started
            child.failures = 0 if lived > STABLE_AFTER_S else child.failures + 1
            self.restarts[child.role] += 1
            delay = min(MAX_BACKOFF_S, 0.1 * 2 ** child.failures) if child.failures else 0.0
            log.error("%s (pid %d) exited with code %s after %.1f s; restarting in %.1f s",
                      child.name, child.process.pid, child.process.exitcode, lived, delay)
            child.restart_at = now + delay

    def _own_figures(self) -> dict:
        """The supervisor's /metrics figures, as a snapshot (called on the metrics server's thread: it
        reads what the main thread keeps, and touches no child: is_alive() would reap it)."""
        return {"counters": [["infercache_process_restarts_total", [role], n] for role, n in self.restarts.items()]
                + [["infercache_store_replaced_total", [store], n] for store, n in self.replaced.items()],
                "gauges": [["infercache_processes", [role], n] for role, n in self.live.items()]}

    def _stop(self, children: list[_Child]) -> None:
        live = [c.process for c in children if c.process is not None and c.process.is_alive()]
        for proc in live:
            os.kill(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.config.server.drain_s + 5
        for proc in live:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                log.error("%s did not stop in time; killing it", proc.name)
                proc.kill()
                proc.join()

    def _drain(self) -> int:
        """Frontends first (they finish in-flight calls, which may still need the worker), then the worker."""
        log.info("draining")
        self._stop(self.frontends)
        self._stop(self.workers)
        self._stop_mps()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
        print("infercache: stopped", flush=True)
        return 0


def run(config: Config) -> int:
    process.setup_logging(config.server.log_level, "supervisor")
    return Supervisor(config).run()
