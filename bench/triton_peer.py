"""PyTriton serving MiniLM (bench/triton_model.py) in its virtualenv, with Triton's response cache: the peer
of the peers section's hits part, and the KServe v2 upstream of tests/test_upstream_peers.py. Imports none
of KServe's messages (their proto package is tritonclient's too: a test process holds only one of the two)."""

from __future__ import annotations

import signal
import urllib.request
from pathlib import Path

from bench.peer_envs import PeerEnv, PeerServer
from server.shared.models import load_model
from harness.servers import REPO, free_port

CACHE_BYTES = 256 << 20


class TritonPeer(PeerServer):
    """PyTriton serving bench/triton_model.py in its virtualenv (it stops on SIGINT)."""

    def __init__(self, env: PeerEnv, workdir: Path) -> None:
        version_dir = REPO / "models" / "minilm" / "1"
        max_tokens = load_model(REPO / "models" / "minilm").max_tokens
        self.port, self.metrics_port = free_port(), free_port()
        self.address = f"127.0.0.1:{self.port}"
        super().__init__([str(env.python), str(REPO / "bench" / "triton_model.py"), str(version_dir), str(max_tokens),
                          str(self.port), str(free_port()), str(self.metrics_port), str(CACHE_BYTES)],
                         env.env, workdir, signal.SIGINT)
        self.wait_until(lambda: b"\nready\n" in b"\n" + self.log_path.read_bytes(), "Triton", 180)

    def cache_hits(self) -> int:
        """Triton's response-cache hits of the model."""
        return self.metric("nv_cache_num_hits_per_model")

    def metric(self, name: str) -> int:
        """A counter of the model from Triton's /metrics (nv_inference_request_success, ...)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as response:
            for line in response.read().decode().splitlines():
                if line.startswith(f'{name}{{model="minilm"'):
                    return int(float(line.rsplit(" ", 1)[1]))
        raise RuntimeError(f"Triton's /metrics has no {name} for minilm")
