"""TensorRT: the per-GPU production runtime.

Written against TensorRT's Python API (10.x / 11.x), importing `tensorrt`, or TensorRT-RTX
(`tensorrt_rtx`, or `tensorrt_rtx_bindings` from the PyPI wheel) where only that is installed.
TensorRT-RTX builds ahead of time without a GPU; full TensorRT builds for the GPU it runs on.

Build: parse the ONNX file; one optimization profile per batcher bucket (min/opt/max over batch and
sequence); FP16 where the builder offers it; explicitly quantized (Q/DQ) models built as given; the
timing cache of this device and runtime version loaded before the build and saved after it.
Run: deserialize; one execution context per profile with its own device/pinned buffers sized for the
profile's maximum shapes; one CUDA stream; execute_async_v3; outputs shaped from the context.
"""

from __future__ import annotations

import importlib
import logging
import warnings
from pathlib import Path

import numpy as np

from cachestore.engine_store import write_atomic
from server.engines.base import Engine, EngineBuildError, Profile, Runtime, RuntimeUnavailable

log = logging.getLogger("infercache.tensorrt")

MODULES = ("tensorrt", "tensorrt_rtx", "tensorrt_rtx_bindings")


def import_tensorrt():
    """(module, name) of the first TensorRT flavour installed."""
    for name in MODULES:
        try:
            return importlib.import_module(name), name
        except ImportError:
            continue
    raise RuntimeUnavailable("TensorRT is not installed (pip install tensorrt; tensorrt-rtx-cu13-bindings "
                             "and -libs also build engines ahead of time without a GPU)")


class TensorRTRuntime(Runtime):
    suffix = ".plan"

    def __init__(self) -> None:
        self.trt, self.module = import_tensorrt()
        self.is_rtx = "rtx" in self.module
        self.name = "tensorrt_rtx" if self.is_rtx else "tensorrt"
        self.version = self.trt.__version__
        self.logger = self.trt.Logger(self.trt.Logger.WARNING)

    def device(self) -> tuple[str, dict]:
        from server.engines.cuda import device_info

        gpu = device_info()
        if gpu is not None:
            return gpu.tag, {"gpu": gpu.name, "compute_capability": f"{gpu.major}.{gpu.minor}"}
        if self.is_rtx:
            # Ahead-of-time build: portable to the runtime's default targets (8.0, 8.6, 8.9, 12.0).
            return "aot-portable", {"gpu": None, "compute_capability": "runtime defaults (ahead of time)"}
        raise RuntimeUnavailable("TensorRT needs an NVIDIA GPU to build engines; this host has none")

    def precision(self, requested: str) -> str:
        if requested == "int8-qdq":
            return requested  # explicitly quantized model (Q/DQ nodes): built as given
        if requested == "fp16" and hasattr(self.trt.BuilderFlag, "FP16"):
            return "fp16"
        return "fp32"  # TensorRT-RTX takes precisions from the model's types (it has no FP16 flag)

    def build(self, source: Path, profiles: tuple[Profile, ...], precision: str, out: Path,
              timing_cache: Path) -> dict:
        trt = self.trt
        builder = trt.Builder(self.logger)
        network = builder.create_network(0)
        parser = trt.OnnxParser(network, self.logger)
        if not parser.parse_from_file(str(source)):
            errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
            raise EngineBuildError(f"TensorRT could not parse {source}: {errors}")
        config = builder.create_builder_config()
        if precision == "fp16":
            config.set_flag(trt.BuilderFlag.FP16)
        elif precision == "int8-qdq" and hasattr(trt.BuilderFlag, "INT8"):
            config.set_flag(trt.BuilderFlag.INT8)  # explicit quantization: scales come from the Q/DQ nodes
        cache_bytes = timing_cache.read_bytes() if timing_cache.is_file() else b""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # TensorRT-RTX: timing cache calls are no-ops
            cache = config.create_timing_cache(cache_bytes)
            if not config.set_timing_cache(cache, ignore_mismatch=False) and cache_bytes:
                log.warning("timing cache %s does not match this device/runtime; starting a new one", timing_cache)
        inputs = [network.get_input(i) for i in range(network.num_inputs)]
        for profile in profiles:
            shapes = builder.create_optimization_profile()
            for tensor in inputs:
                shapes.set_shape(tensor.name, (1, profile.min_seq), (profile.opt_batch, profile.max_seq),
                                 (profile.max_batch, profile.max_seq))
            config.add_optimization_profile(shapes)
        serialized = builder.build_serialized_network(network, config)
        if serialized is None:
            raise EngineBuildError(f"TensorRT failed to build {source} (see the TensorRT log above)")
        with open(out, "wb") as f:
            f.write(memoryview(serialized))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            saved = bytes(memoryview(config.get_timing_cache().serialize()))
        write_atomic(timing_cache, saved)
        _, device = self.device()
        return {
            **device, "module": self.module, "timing_cache": timing_cache.name,
            "timing_cache_loaded_bytes": len(cache_bytes), "timing_cache_saved_bytes": len(saved),
            "inputs": [t.name for t in inputs],
        }

    def load(self, artifact: Path, profiles: tuple[Profile, ...], *, threads: int) -> Engine:
        return TensorRTEngine(self, artifact.read_bytes(), profiles)


class _Context:
    """One execution context bound to one profile, with buffers for that profile's largest shapes."""

    def __init__(self, engine, index: int, profile: Profile, stream) -> None:
        from server.engines.cuda import Buffer

        self.profile = profile
        self.context = engine.create_execution_context()
        self.context.set_optimization_profile_async(index, stream.handle)
        self.buffers = {}
        self.dtypes = {}
        for i in range(engine.num_io_tensors):
            name = engine.get_tensor_name(i)
            dtype = np.dtype(_numpy_dtype(engine.get_tensor_dtype(name)))
            shape = [profile.max_batch if d == -1 and j == 0 else (profile.max_seq if d == -1 else d)
                     for j, d in enumerate(engine.get_tensor_shape(name))]
            self.dtypes[name] = dtype
            self.buffers[name] = Buffer(int(np.prod(shape)) * dtype.itemsize)
            self.context.set_tensor_address(name, int(self.buffers[name].device))


class TensorRTEngine(Engine):
    def __init__(self, runtime: TensorRTRuntime, plan: bytes, profiles: tuple[Profile, ...]) -> None:
        from server.engines.cuda import Stream

        trt = runtime.trt
        self.trt = trt
        self.runtime = trt.Runtime(runtime.logger)
        self.engine = self.runtime.deserialize_cuda_engine(plan)
        if self.engine is None:
            raise RuntimeUnavailable("TensorRT could not deserialize the engine for this GPU/runtime")
        if self.engine.num_optimization_profiles != len(profiles):
            raise EngineBuildError(f"engine has {self.engine.num_optimization_profiles} profiles, "
                                   f"the model config {len(profiles)}")
        self.stream = Stream()
        self.contexts = [_Context(self.engine, i, p, self.stream) for i, p in enumerate(profiles)]
        self.inputs = [n for n in self.contexts[0].buffers
                       if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.outputs = [n for n in self.contexts[0].buffers if n not in self.inputs]
        self.stream.synchronize()

    def _context_for(self, batch: int, seq: int) -> _Context:
        for ctx in self.contexts:
            if ctx.profile.min_seq <= seq <= ctx.profile.max_seq and batch <= ctx.profile.max_batch:
                return ctx
        raise ValueError(f"no optimization profile takes batch {batch} x {seq} tokens")

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        batch, seq = inputs[self.inputs[0]].shape
        ctx = self._context_for(batch, seq)
        for name in self.inputs:
            array = inputs[name].astype(ctx.dtypes[name], copy=False)
            ctx.context.set_input_shape(name, array.shape)
            ctx.buffers[name].upload(array, self.stream)
        if not ctx.context.execute_async_v3(int(self.stream.handle)):
            raise RuntimeError("TensorRT execute_async_v3 failed")
        views = {name: ctx.buffers[name].download(ctx.dtypes[name], tuple(ctx.context.get_tensor_shape(name)),
                                                  self.stream)
                 for name in self.outputs}
        self.stream.synchronize()
        return {name: view.copy() for name, view in views.items()}

    def device_memory_bytes(self) -> int:
        buffers = sum(b.nbytes for ctx in self.contexts for b in ctx.buffers.values())
        return int(self.engine.device_memory_size_v2) + buffers


def _numpy_dtype(dtype) -> type:
    """numpy type of a TensorRT DataType (same member names in every flavour)."""
    return {"FLOAT": np.float32, "HALF": np.float16, "INT32": np.int32, "INT64": np.int64, "INT8": np.int8,
            "BOOL": np.bool_, "UINT8": np.uint8}[dtype.name]
