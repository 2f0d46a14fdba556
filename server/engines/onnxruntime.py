"""ONNX Runtime on CPU: the default runtime, runs on any machine.

Its L3 artifact is the optimized model (graph fusions and constant folding done once, at build time,
through `SessionOptions.optimized_model_filepath`); serving loads it with graph optimization off. The
optimizations depend on the CPU's instruction set, so the device tag carries a hash of it.
"""

from __future__ import annotations

import hashlib
import os
import platform
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
    # Two batches at once: while one is between runs (cut, padded, answered in Python), the other
    # computes, each on all the worker's threads (a lone batch, at low load, keeps them all). Measured on
    # 2 cores (one worker, Banking77 misses at 32 callers, bench/l2.py's setup): 2 threads x 2 slots
    # 277-296 misses/s, 2 threads x 1 slot 233-262; 1 thread x 2 slots 304-346, but a lone miss then
    # takes 9-10 ms instead of 5.5-6.5.
    slots = 2
    any_length = True

    def __init__(self, model_path: Path, *, threads: int = 0,
                 level: ort.GraphOptimizationLevel = ort.GraphOptimizationLevel.ORT_ENABLE_ALL) -> None:
        self.session = ort.InferenceSession(str(model_path), session_options(threads, level),
                                            providers=["CPUExecutionProvider"])
        self.input_names = tuple(i.name for i in self.session.get_inputs())
        self.output_names = tuple(o.name for o in self.session.get_outputs())

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        feeds = {name: inputs[name] for name in self.input_names}
        return dict(zip(self.output_names, self.session.run(None, feeds)))

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
        return OrtEngine(artifact, threads=threads, level=ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
