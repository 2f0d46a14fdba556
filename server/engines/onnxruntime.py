"""ONNX Runtime on CPU: the default runtime, runs on any machine.

Its L3 artifact is the optimized model (graph fusions and constant folding done once, at build time,
through `SessionOptions.optimized_model_filepath`); serving loads it with graph optimization off. The
optimizations depend on the CPU's instruction set, so the device tag carries a hash of it.
"""

from __future__ import annotations

import hashlib
import os
import platform
import threading
from pathlib import Path

import numpy as np
import onnxruntime as ort

from server.engines.base import Engine, Profile, Runtime

_ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
              "avx512_bf16", "avx_vnni", "amx_bf16", "amx_int8", "asimd", "sve")


def cpu_tag() -> tuple[str, dict]:
    flags: set[str] = set()
    model = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("flags", "Features") and not flags:
                flags = set(value.split())
            elif key.strip() == "model name" and not model:
                model = value.strip()
    except OSError:
        pass
    isa = sorted(flags.intersection(_ISA_FLAGS))
    digest = hashlib.blake2b(" ".join(isa).encode(), digest_size=4).hexdigest()
    return f"cpu-{platform.machine()}-{digest}", {"cpu": model, "isa": isa}


def session_options(threads: int, level: ort.GraphOptimizationLevel) -> ort.SessionOptions:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads or os.cpu_count() or 1
    options.inter_op_num_threads = 1
    options.graph_optimization_level = level
    # Idle intra-op threads would otherwise spin for a while after every run, taking the cores
    # that the frontends' and the worker's event loops need between batches.
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return options


class OrtEngine(Engine):
    """Two batches at once: while one is between runs (cut, padded, answered in Python), the other
    computes. A batch that runs alone (low load) gets all of `threads`: its latency. One that starts
    while another runs goes to a second session of the same model with `shared_threads` (the cores
    shared out; one such session per slot where that is more than one thread): split over threads, a batch's operators cost more CPU in all (on a 2-core host, a
    Banking77 text in batches of like lengths: 11.5-12.9 ms on 2 threads, 9.2-10.3 ms on 1), and at
    full load that decides the throughput. Before, on 2 cores (Banking77 misses at 32 callers,
    bench/l2.py's setup, an earlier session): 2 threads x 2 slots 277-296 misses/s, 2 threads x 1 slot
    233-262; 1 thread x 2 slots 304-346, but a lone miss then took 9-10 ms instead of 5.5-6.5. Each
    shared session holds its own copy of the weights (host memory: about 100 MB for minilm)."""

    slots = 2
    any_length = True

    def __init__(self, model_path: Path, *, threads: int = 0, shared_threads: int = 0,
                 level: ort.GraphOptimizationLevel = ort.GraphOptimizationLevel.ORT_ENABLE_ALL) -> None:
        """shared_threads: the threads of a batch that starts while another runs; 0 = no second
        session (every batch on `threads`: offline tools, references)."""
        self.session = ort.InferenceSession(str(model_path), session_options(threads, level),
                                            providers=["CPUExecutionProvider"])
        # One session of one thread serves any number of runs at once, each on its caller's thread; one
        # of more threads has one pool, which two runs would split: then one such session per slot.
        sessions = 0 if not shared_threads else 1 if shared_threads == 1 else self.slots
        self.shared = [ort.InferenceSession(str(model_path), session_options(shared_threads, level),
                                            providers=["CPUExecutionProvider"]) for _ in range(sessions)]
        self._free = list(range(sessions))  # shared sessions no run holds (the 1-thread one is never held)
        self.input_names = tuple(i.name for i in self.session.get_inputs())
        self.output_names = tuple(o.name for o in self.session.get_outputs())
        self._lock = threading.Lock()
        self._running = 0
        self._counters = {"runs_alone": 0, "runs_shared": 0}  # written under the lock, by the run threads

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        feeds = {name: inputs[name] for name in self.input_names}
        held = None
        with self._lock:
            self._running += 1
            session = self.session
            if self._running > 1 and self.shared:
                if len(self.shared) == 1:
                    session = self.shared[0]
                elif self._free:
                    held = self._free.pop()
                    session = self.shared[held]
            self._counters["runs_alone" if session is self.session else "runs_shared"] += 1
        try:
            return dict(zip(self.output_names, session.run(None, feeds)))
        finally:
            with self._lock:
                self._running -= 1
                if held is not None:
                    self._free.append(held)

    def counters(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counters) if self.shared else {}

    def device_memory_bytes(self) -> int:
        return 0


class OrtRuntime(Runtime):
    name = "onnxruntime"
    version = ort.__version__
    suffix = ".onnx"

    def device(self) -> tuple[str, dict]:
        return cpu_tag()

    def precision(self, requested: str) -> str:
        return "fp32"  # the CPU provider computes in the model's own types

    def build(self, source: Path, profiles: tuple[Profile, ...], precision: str, out: Path,
              timing_cache: Path) -> dict:
        options = session_options(0, ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
        options.optimized_model_filepath = str(out)
        options.log_severity_level = 3  # its "hardware specific" warning is why the device tag has an ISA hash
        ort.InferenceSession(str(source), options, providers=["CPUExecutionProvider"])
        return {"graph_optimization": "ORT_ENABLE_ALL", "execution_provider": "CPUExecutionProvider"}

    def load(self, artifact: Path, profiles: tuple[Profile, ...], *, threads: int) -> Engine:
        shared = threads // OrtEngine.slots if threads >= OrtEngine.slots else 0  # nothing to share out of one
        return OrtEngine(artifact, threads=threads, shared_threads=shared,
                         level=ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
