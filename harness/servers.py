"""Run a real infercache server as a child process (for integration tests and benchmarks), a model
repository of links for it, and what its workers report.

    server = ServerProcess(workdir, models_dir)
    with server.client() as client: ...
    assert server.stop() == 0
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc

from infercache.client import Client
from infercache.v1 import infercache_pb2 as pb
from infercache.v1 import infercache_pb2_grpc

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """`python -m server serve` on a free port, its output in workdir/server.log."""

    def __init__(self, workdir: Path, models_dir: Path, *, frontends: int = 2, settings: tuple[str, ...] = (),
                 cache_dir: Path | None = None, engines_dir: Path | None = None, wait: bool = True,
                 client_options: dict | None = None, port: int | None = None) -> None:
        """client_options: what `client()` passes to Client (a token, TLS material) for a secured server;
        port: the one to listen on (default a free one)."""
        self.workdir = workdir
        self.frontends = frontends
        self.client_options = client_options or {}
        self.port = port or free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.cache_dir = cache_dir or workdir / "cache"
        self.engines_dir = engines_dir or workdir / "engines"
        self.log_path = workdir / "server.log"
        args = [
            sys.executable, "-m", "server", "serve", "--port", str(self.port), "--frontends", str(frontends),
            "--models-dir", str(models_dir), "--cache-dir", str(self.cache_dir),
            "--engines-dir", str(self.engines_dir),
            "--set", f"server.socket_dir={workdir / 'run'}", "--set", "cache.sweep_interval_s=1",
            # One worker per GPU unless `settings` say otherwise (server.workers, or this again): a GPU
            # host would otherwise pick one per 4 CPUs, and tests read one worker's figures.
            "--set", "server.workers_per_gpu=1",
        ]
        for item in settings:
            args += ["--set", item]
        self.log = open(self.log_path, "w")
        self.started = time.monotonic()
        self.ready_after: float | None = None
        self.proc = subprocess.Popen(args, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT)
        if wait:
            try:
                self.wait_ready()
                if " torch-cuda" in self.log_text():  # a GPU worker: its graphs captured before anyone measures
                    self.wait_warm()
            except BaseException:
                self.stop(timeout=10)  # a server that did not come up must not outlive the caller
                raise

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Blocks until the server says it is ready; `ready_after` is then the seconds since launch."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if "infercache: ready" in self.log_path.read_text():
                self.ready_after = time.monotonic() - self.started
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_text()}")
            time.sleep(0.01)
        raise TimeoutError(f"server not ready after {timeout} s:\n{self.log_text()}")

    def wait_warm(self, timeout: float = 120.0) -> list[pb.ProcessStats]:
        """Blocks until every worker runs at full speed (GetStats: "warm", its CUDA graphs captured
        behind traffic; at once on a CPU); their stats."""
        deadline = time.monotonic() + timeout
        while True:
            workers = self.stats().workers
            if workers and all("warm" in w.start_seconds for w in workers):
                return list(workers)
            if time.monotonic() > deadline:
                raise TimeoutError(f"workers not at full speed after {timeout} s: {[dict(w.start_seconds) for w in workers]}")
            time.sleep(0.1)

    def log_text(self) -> str:
        return self.log_path.read_text()

    def client(self, **options) -> Client:
        return Client(self.address, **{**self.client_options, **options})

    def stub(self) -> tuple[grpc.Channel, infercache_pb2_grpc.InferenceCacheStub]:
        channel = grpc.insecure_channel(self.address)
        return channel, infercache_pb2_grpc.InferenceCacheStub(channel)

    def stats(self) -> pb.GetStatsResponse:
        with self.client() as client:
            return client.stats()

    def worker_pid(self) -> int:
        return self.stats().worker.pid

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop_later(self, timeout: float = 30.0) -> None:
        """SIGTERM without waiting for the exit (a test fixture's teardown, so that the next test starts while
        this server drains): reap() collects it, and kills it `timeout` seconds after this if it still runs."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        _collect_exited()
        _STOPPING[self] = time.monotonic() + timeout

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, then SIGKILL of the whole process group after `timeout`; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


_STOPPING: dict[ServerProcess, float] = {}  # signalled by stop_later, not yet collected: when it is killed
_EXITED: dict[ServerProcess, int] = {}      # collected since the last reap(): exit codes


def _collect_exited() -> None:
    """Collects the servers stop_later() signalled that have exited, and kills those past their time."""
    now = time.monotonic()
    for server, kill_at in list(_STOPPING.items()):
        if server.proc.poll() is not None or now >= kill_at:
            del _STOPPING[server]
            _EXITED[server] = server.stop(timeout=0.0)


def reap() -> dict[ServerProcess, int]:
    """Waits for every server stop_later() signalled (killed at its time): exit codes, since the last reap."""
    while _STOPPING:
        _collect_exited()
        time.sleep(0.05)
    codes = dict(_EXITED)
    _EXITED.clear()
    return codes


class UpstreamServer:
    """An infercache that other servers call as their upstream (the tests' and the bench's), one frontend,
    its HTTP door on, stopped and started again on the same ports with the same store; with `token`, tokens
    on (`token` a client's, `token`-admin an admin's)."""

    def __init__(self, workdir: Path, models: Path, engines_dir: Path, token: str | None = None) -> None:
        self.workdir, self.models, self.engines_dir, self.token = workdir, models, engines_dir, token
        self.grpc_port, self.http_port = free_port(), free_port()
        self.settings: tuple[str, ...] = (f"server.http_port={self.http_port}",)
        if token is not None:
            tokens = workdir / "tokens.yaml"
            tokens.write_text(f"- {{token: {token}, role: client}}\n- {{token: {token}-admin, role: admin}}\n")
            self.settings += (f"security.tokens_file={tokens}",)
        self.server: ServerProcess | None = None
        self.starts = 0

    def start(self) -> ServerProcess:
        self.starts += 1
        workdir = self.workdir / f"run{self.starts}"
        workdir.mkdir()
        self.server = ServerProcess(workdir, self.models, engines_dir=self.engines_dir, frontends=1,
                                    cache_dir=self.workdir / "cache", settings=self.settings,
                                    client_options={"token": self.token + "-admin"} if self.token else None,
                                    port=self.grpc_port)
        return self.server

    def asked(self, *counters: str) -> int:
        """The sum of its frontend's `counters` (frontend.hit_exact and frontend.forwarded: the texts it
        has been asked; frontend.generate_hits and frontend.generate_forwarded: the generations)."""
        found = self.server.stats().frontend.counters
        return sum(found[name] for name in counters)


def link_model(root: Path, name: str, config: str, versions: dict[str, Path]) -> Path:
    """A model in a test repository: `config` as its config.yaml, each version a link to existing files."""
    (root / name).mkdir(parents=True)
    (root / name / "config.yaml").write_text(config)
    for version, target in versions.items():
        (root / name / version).symlink_to(target)
    return root / name


def worker_counters(server) -> dict[str, int]:
    """Every worker's GetStats counters, summed by name."""
    counters: dict[str, int] = {}
    for worker in server.stats().workers:
        for name, value in worker.counters.items():
            counters[name] = counters.get(name, 0) + value
    return counters


def settled(server, counter: str, idle: tuple[str, ...] = ("writer.backlog",), timeout: float = 30.0,
            poll_s: float = 0.1) -> int:
    """Every worker's `counter` (summed) once background work has settled: each counter in `idle` is 0
    and `counter` holds between two reads `poll_s` apart."""
    deadline, last = time.monotonic() + timeout, None
    while True:
        counters = worker_counters(server)
        now = counters.get(counter, 0)
        if now == last and not any(counters.get(name, 0) for name in idle):
            return now
        assert time.monotonic() < deadline, f"the workers did not settle within {timeout:g} s ({counter}, {idle})"
        last = now
        time.sleep(poll_s)
