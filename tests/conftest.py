"""Shared fixtures: a model repository for tests and real server processes on free ports."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from infercache.client import Client
from infercache.v1 import infercache_pb2 as pb
from infercache.v1 import infercache_pb2_grpc

REPO = Path(__file__).resolve().parent.parent
MODEL_VERSION_DIR = REPO / "models" / "minilm" / "1"
SHORT_TTL_S = 2

SHORT_CONFIG = f"""
task: embedding
serving_version: "1"
input: {{max_text_chars: 200, max_tokens: 64}}
outputs: [embedding]
batching: {{buckets: [16, 64], max_batch_size: 8, max_queue_delay_ms: 2}}
cache: {{ttl_s: {SHORT_TTL_S}}}
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory) -> Path:
    """minilm (the shipped config) and shortlived (same weights, 2 s TTL, two versions)."""
    if not (MODEL_VERSION_DIR / "model.onnx").is_file():
        pytest.fail("default model missing: run `make model` (make test does it)")
    root = tmp_path_factory.mktemp("models")
    (root / "minilm").mkdir()
    (root / "minilm" / "config.yaml").write_text((REPO / "models" / "minilm" / "config.yaml").read_text())
    (root / "minilm" / "1").symlink_to(MODEL_VERSION_DIR)
    (root / "shortlived").mkdir()
    (root / "shortlived" / "config.yaml").write_text(SHORT_CONFIG)
    (root / "shortlived" / "1").symlink_to(MODEL_VERSION_DIR)
    (root / "shortlived" / "2").symlink_to(MODEL_VERSION_DIR)
    return root


class ServerProcess:
    """`python -m server serve` as a child process on a free port, with its log in a file."""

    def __init__(self, workdir: Path, models_dir: Path, *, frontends: int = 2, settings: tuple[str, ...] = (),
                 cache_dir: Path | None = None) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.cache_dir = cache_dir or workdir / "cache"
        self.log_path = workdir / "server.log"
        args = [
            sys.executable, "-m", "server", "serve", "--port", str(self.port), "--frontends", str(frontends),
            "--models-dir", str(models_dir), "--cache-dir", str(self.cache_dir),
            "--set", f"server.socket_dir={workdir / 'run'}", "--set", "cache.sweep_interval_s=1",
        ]
        for item in settings:
            args += ["--set", item]
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(args, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT)
        self._wait_ready()

    def _wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if "infercache: ready" in self.log_path.read_text():
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_text()}")
            time.sleep(0.05)
        raise TimeoutError(f"server not ready after {timeout} s:\n{self.log_text()}")

    def log_text(self) -> str:
        return self.log_path.read_text()

    def client(self) -> Client:
        return Client(self.address)

    def stub(self) -> tuple[grpc.Channel, infercache_pb2_grpc.InferenceCacheStub]:
        channel = grpc.insecure_channel(self.address)
        return channel, infercache_pb2_grpc.InferenceCacheStub(channel)

    def stats(self) -> pb.GetStatsResponse:
        with self.client() as client:
            return client.stats()

    def worker_pid(self) -> int:
        return self.stats().worker.pid

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


@pytest.fixture
def start_server(tmp_path, models_dir):
    """Factory for servers that a test owns (and may crash); all are stopped afterwards."""
    started: list[ServerProcess] = []

    def start(**kwargs) -> ServerProcess:
        workdir = tmp_path / f"server{len(started)}"
        workdir.mkdir()
        server = ServerProcess(workdir, models_dir, **kwargs)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="module")
def server(tmp_path_factory, models_dir):
    """One server shared by a test module (2 frontends). Tests use unique texts to stay independent."""
    srv = ServerProcess(tmp_path_factory.mktemp("server"), models_dir)
    yield srv
    code = srv.stop()
    assert code == 0, srv.log_text()


@pytest.fixture(scope="session")
def reference_encoder():
    """sentence-transformers' own encoder for the default model (the parity reference)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from sentence_transformers import SentenceTransformer

    from server.export_model import default_encoder_dir

    return SentenceTransformer(str(default_encoder_dir()), device="cpu")
