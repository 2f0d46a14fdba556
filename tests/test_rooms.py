"""Rooms by process: a frontend loads nothing of the workers' (server/worker/, the engines and their
runtimes, the write-behind, the L3 store), so its memory and start-up stay small; shared pieces live in
server/shared/."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.helpers import unique, wait_cached
from harness.servers import REPO

WORKER_ONLY = ("server.worker", "server.engines", "server.supervisor", "cachestore.writer", "cachestore.engine_store",
               "torch", "onnxruntime", "hnswlib")
# Native libraries a worker maps and a frontend must not (what /proc/PID/maps shows of a process).
WORKER_LIBRARIES = ("onnxruntime", "hnswlib", "libtorch")


def _loaded(entry: str) -> list[str]:
    """The modules a fresh interpreter holds after importing `entry`, as a spawned child imports its target."""
    code = f"import json, sys, {entry}; print(json.dumps(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_the_frontends_entry_imports_no_worker_only_module():
    loaded = _loaded("server.frontend.process")
    wrong = [m for m in loaded if m.startswith(WORKER_ONLY)]
    assert not wrong, f"the frontend imports worker-only modules: {wrong}"
    assert "server.shared.answers" in loaded and "server.frontend.core" in loaded


def test_the_workers_entry_imports_no_frontend_module():
    loaded = _loaded("server.worker.process")
    assert not [m for m in loaded if m.startswith("server.frontend")]


def test_a_serving_frontend_process_maps_no_worker_library(start_server):
    """A real server's frontend, after answering a miss and a hit: none of the worker's native libraries
    (ONNX Runtime, hnswlib, torch) is in its address space, while the worker's has ONNX Runtime."""
    server = start_server(frontends=1)
    text = unique("rooms by process")
    with server.client() as client:
        client.infer("minilm", text)
        wait_cached(client, "minilm", text)
        stats = client.stats()

    def libraries(pid: int) -> str:
        return Path(f"/proc/{pid}/maps").read_text()

    frontend = libraries(stats.frontend.pid)
    assert not [lib for lib in WORKER_LIBRARIES if lib in frontend]
    assert "onnxruntime" in libraries(stats.worker.pid)  # the check can see a library where there is one
