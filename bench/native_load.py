"""The benchmarks' C++ programs (bench/native/), built on first use: the load generator (loadgen.cc), run
as a child process here, and the native gRPC floor (floor.cc) of the peers section.

Where the benchmark host shares its cores with the server (a 2-core host), the Python generator's
own CPU per call (about 0.8 ms there, as much as the server's frontends) is taken from the server; this
one costs a small fraction of that. It needs gRPC's C++ library and headers (Debian: libgrpc++-dev,
which `make bench` installs when it runs as root); without them `loadgen()` says why and returns None,
and a benchmark falls back to the Python generator, saying so in its results.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import struct
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from bench.load import CHANNELS_PER_PROCESS, INFER, LoadResult, answered_sources
from harness.servers import REPO
from infercache.v1 import infercache_pb2 as pb

NATIVE = Path(__file__).with_name("native")  # C++ sources: loadgen.cc, floor.cc
BUILD = REPO / "build" / "bench"

_built: dict[str, Path | None] = {}


def loadgen() -> Path | None:
    """The built generator (rebuilt when its source changes), or None where it cannot be built."""
    return native("loadgen")


def native(name: str) -> Path | None:
    """bench/native/NAME.cc built (again when its source changes), or None where it cannot be built."""
    if name not in _built:
        source = NATIVE / f"{name}.cc"
        digest = hashlib.blake2b(source.read_bytes(), digest_size=8).hexdigest()
        binary = BUILD / f"{name}-{digest}"
        _built[name] = binary if binary.exists() else _build(source, binary)
    return _built[name]


def _build(source: Path, binary: Path) -> Path | None:
    compiler = shutil.which("g++") or shutil.which("c++")
    flags = subprocess.run(["pkg-config", "--cflags", "--libs", "grpc++"], capture_output=True, text=True) \
        if shutil.which("pkg-config") else None
    if compiler is None or flags is None or flags.returncode != 0:
        print(f"  ({source.name} needs g++ and gRPC's C++ library: apt-get install g++ pkg-config libgrpc++-dev)",
              flush=True)
        return None
    binary.parent.mkdir(parents=True, exist_ok=True)
    partial = binary.with_name(f"{binary.name}.{os.getpid()}.partial")  # two builds at once: each its own
    print(f"  building {source.name} ...", flush=True)
    built = subprocess.run([compiler, "-O2", "-std=c++17", str(source), *flags.stdout.split(), "-o", str(partial)],
                           capture_output=True, text=True)
    if built.returncode != 0:
        print(f"  ({source.name} did not build:\n{built.stderr[-2000:]})", flush=True)
        return None
    partial.rename(binary)
    return binary


def run_each_once_native(binary: Path, address: str, requests: list[pb.InferRequest], *, concurrency: int,
                         timeout: float = 30.0) -> LoadResult:
    """bench/load.py run_each_once through the C++ generator: every request once from `concurrency`
    callers; sources counted from the responses."""
    with tempfile.TemporaryDirectory(prefix="loadgen-") as tmp:
        requests_file, answers_file = Path(tmp) / "requests", Path(tmp) / "answers"
        with requests_file.open("wb") as f:
            for request in requests:
                payload = request.SerializeToString()
                f.write(struct.pack("<I", len(payload)) + payload)
        limit = 60 + timeout * max(1, len(requests) / concurrency)
        channels = min(CHANNELS_PER_PROCESS, concurrency)  # one connection each, as the Python generator's
        subprocess.run([str(binary), address, INFER, str(concurrency), str(channels), str(timeout), str(requests_file),
                        str(answers_file)], check=True, timeout=limit)
        data = answers_file.read_bytes()
    began, ended = struct.unpack_from("<dd", data)
    offset, latencies, responses = 16, [], []
    for _ in requests:
        code, latency_ms, length = struct.unpack_from("<idI", data, offset)
        offset += 16
        response, offset = data[offset:offset + length], offset + length
        responses.append(response if code == 0 else None)
        if code == 0:
            latencies.append(latency_ms)
    errors, sources = answered_sources(responses)
    return LoadResult(len(latencies), errors, ended - began, np.array(latencies), sources)


def start_floor(binary: Path, answer: bytes, workdir: Path) -> tuple[str, subprocess.Popen]:
    """bench/native/floor.cc answering every call with `answer`: (address, process) once it listens."""
    from harness.servers import free_port

    workdir.mkdir(parents=True, exist_ok=True)
    answer_file = workdir / "floor-answer"
    answer_file.write_bytes(answer)
    port = free_port()
    proc = subprocess.Popen([str(binary), str(port), str(answer_file)], stdout=subprocess.PIPE, text=True)
    if proc.stdout.readline().strip() != "ready":
        proc.kill()
        raise RuntimeError(f"the native floor did not start (exit status {proc.wait(10)})")
    return f"127.0.0.1:{port}", proc
