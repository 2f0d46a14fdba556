"""Which devices this host has and which runtime serves on them, decided without a CUDA context.

The supervisor calls this before it spawns anything: it must not import torch or create a CUDA
context (children could inherit neither through spawn anyway, but the CPU path must never pay for
torch's import). GPUs are counted from CUDA_VISIBLE_DEVICES, the driver's /proc entries or
`nvidia-smi -L`; runtimes are looked up with importlib.util.find_spec, which imports nothing.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

GPU_RUNTIMES = ("torch-cuda", "tensorrt")
RUNTIMES = ("auto", "onnxruntime", *GPU_RUNTIMES, "null")  # null: benchmarks only (server/engines/null.py)
SHARING_MODES = ("auto", "mps", "timeslice")  # server.gpu_sharing: how workers share a GPU (server/mps.py)


def visible_gpus(environ: dict[str, str] | None = None) -> list[str]:
    """Ids of the GPUs this process may use, as CUDA_VISIBLE_DEVICES would name them."""
    environ = os.environ if environ is None else environ
    listed = environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [d.strip() for d in listed.split(",") if d.strip() and d.strip() != "-1"]
    proc = Path("/proc/driver/nvidia/gpus")
    if proc.is_dir():
        return [str(i) for i in range(len(list(proc.iterdir())))]
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.SubprocessError):
            return []
        return [str(i) for i, line in enumerate(l for l in out.splitlines() if l.startswith("GPU "))]
    return []


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def resolve_runtime(requested: str, gpus: list[str]) -> str:
    """The runtime `engines.runtime` names, with `auto` decided for this host: full TensorRT where it
    is installed and a GPU is visible, else the CUDA runtime on torch, else ONNX Runtime on CPU.
    (TensorRT-RTX is never picked by auto: its engines do not run on data-center GPUs such as the
    H200; name `tensorrt` explicitly to use it.)"""
    if requested != "auto":
        return requested
    if gpus and _installed("tensorrt"):
        return "tensorrt"
    if gpus and _installed("torch"):
        return "torch-cuda"
    return "onnxruntime"


@dataclass(frozen=True)
class WorkerPlacement:
    """One inference worker: its index, its runtime and the GPU it is pinned to (None on CPU)."""

    index: int
    runtime: str
    gpu: str | None
    sharing: int = 1  # workers on this worker's GPU, itself included (they share its memory)
    ordinal: int = 0  # its GPU's position among the visible GPUs (what an MPS server numbers it)

    @property
    def device(self) -> str:
        return "cpu" if self.gpu is None else f"cuda:{self.gpu}"


AUTO_MAX_PER_GPU = 4        # workers_per_gpu 0 (auto): at most this many worker processes per GPU,
CPUS_PER_AUTO_WORKER = 4    # one per this many CPUs (the frontends need most of them)


def auto_per_gpu(gpus: int, cpus: int | None = None) -> int:
    """Worker processes per GPU when `server.workers_per_gpu` is 0: one per 4 CPUs per GPU, 1 to 4. On
    an H200 host one worker's Python, not the GPU, bounds MiniLM misses; four (through MPS) carry more,
    with the 16 frontends on the same cores (docs/benchmarks.md, GPU)."""
    cpus = (os.cpu_count() or 1) if cpus is None else cpus
    return max(1, min(AUTO_MAX_PER_GPU, cpus // (CPUS_PER_AUTO_WORKER * max(1, gpus))))


def plan_workers(requested_runtime: str, workers: int, gpus: list[str], per_gpu: int = 1) -> list[WorkerPlacement]:
    """workers = 0: `per_gpu` per visible GPU for a GPU runtime (0: auto_per_gpu), else one. Workers
    share the GPUs round-robin (worker i on GPU i mod n), so each GPU gets the same number, and two
    workers on one GPU exercise the multi-worker path on a one-GPU host. Several workers per GPU are
    several Python processes feeding it: what one process's GIL cannot carry (docs/benchmarks.md, GPU)."""
    runtime = resolve_runtime(requested_runtime, gpus)
    on_gpu = runtime in GPU_RUNTIMES and bool(gpus)
    count = workers or (len(gpus) * (per_gpu or auto_per_gpu(len(gpus))) if on_gpu else 1)
    if not on_gpu:
        return [WorkerPlacement(i, runtime, None) for i in range(count)]
    return [WorkerPlacement(i, runtime, gpus[i % len(gpus)], len(range(i % len(gpus), count, len(gpus))), i % len(gpus))
            for i in range(count)]
