"""The CUDA runtime on torch: encoder models in FP16 on an NVIDIA GPU, one CUDA graph per
(optimization profile, batch class).

Source: the model version's torch form (`torch.json` + `torch.safetensors`, written by prepare-model
and train-head from the same checkpoint as model.onnx; server/engines/torch_bert.py). Artifact in the
L3 store: the module's weights cast to the serving precision (a safetensors file carrying its
architecture), named and checked like any other artifact (device, torch + CUDA version, precision,
profile set).

Load: weights onto the GPU and one batch of the largest shape (the libraries' handles and workspaces,
the kernels loaded): from then on the engine serves, each batch padded to its (profile, batch class)
shape (batch classes 1, 2, 3, 4, 6, 8, 12, ... up to max_batch: at worst a third of the rows computed
are padding). A shape without its graph yet runs eagerly, at the same padded shape, so with the same
kernels: the answer is the one its graph gives. warm_behind_traffic() captures the graphs in a
thread of their own, the shapes that live traffic ran eagerly first (then the largest first), each
under the engine's lock, let go between captures: a batch waits for one capture at most (about 50 ms
on an H200). Nothing of a capture outlives the process (CUDA graphs are not serializable), so only
the weights are stored. The graphs share one memory pool; they replay on one stream, so they never
run at the same time.

Run: two slots, each with pinned host staging buffers sized for the largest profile. A caller fills its
slot's pinned inputs (host work), enqueues copy-in, replay (or the eager forward) and copy-out on the
stream under a short lock, and waits on its slot's event: while the GPU runs batch n, the next caller
prepares batch n+1. Once warm, no device memory is allocated on this path (the answer is copied out of
the pinned buffer into a fresh array, which the caller keeps). Only this module (and torch_bert) import
torch, lazily, through artifacts.get_runtime: the CPU path never does.
"""

from __future__ import annotations

import atexit
import json
import logging
import queue
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np

from server.engines.base import Engine, Profile, Runtime, RuntimeUnavailable
from server.shared.models import TORCH_CONFIG_FILE, TORCH_WEIGHTS_FILE

log = logging.getLogger("infercache.torch_cuda")

try:
    import torch

    from server.engines.cuda_graphs import capture
except ImportError:  # pragma: no cover - a GPU host without torch: auto never picks this runtime
    torch = None


def batch_classes(max_batch: int) -> tuple[int, ...]:
    """1, 2, 3, 4, 6, 8, 12, 16, ... (powers of two and 1.5x powers of two) up to and with max_batch."""
    sizes = {max_batch}
    power = 1
    while power < max_batch:
        sizes.update(s for s in (power, power * 3 // 2) if 0 < s < max_batch)
        power *= 2
    return tuple(sorted(sizes))


def next_capture(order: list, captured, demand: Counter) -> tuple[int, int] | None:
    """The shape whose graph to capture next: the one live traffic ran eagerly most often, ties (and no
    traffic) in `order`; None once every shape has its graph."""
    waiting = [shape for shape in order if shape not in captured]
    return max(waiting, key=lambda shape: demand[shape], default=None)  # max keeps the first of equals


class _Graph:
    """One captured forward pass for a fixed [batch class, sequence length] input shape."""

    def __init__(self, module, rows: int, seq: int, pool, stream) -> None:
        self.rows, self.seq = rows, seq
        with torch.cuda.stream(stream):
            # Every element is written by each run before a replay: empty is enough.
            self.ids = torch.empty((rows, seq), dtype=torch.int64, device="cuda")
            self.mask = torch.empty((rows, seq), dtype=torch.int64, device="cuda")
        self.graph, self.outputs = capture(lambda: module(self.ids, self.mask), pool, stream)


class _Slot:
    """Pinned host buffers of one caller: inputs for the largest shape, outputs for the largest batch."""

    def __init__(self, max_rows: int, max_seq: int, output_dims: dict[str, int]) -> None:
        self.ids = torch.zeros(max_rows * max_seq, dtype=torch.int64, pin_memory=True)
        self.mask = torch.zeros(max_rows * max_seq, dtype=torch.int64, pin_memory=True)
        self.ids_np, self.mask_np = self.ids.numpy(), self.mask.numpy()
        self.outputs = {name: torch.zeros((max_rows, dim), dtype=torch.float32, pin_memory=True)
                        for name, dim in output_dims.items()}
        # Blocking: its caller sleeps until the GPU is done instead of spinning on a core (CUDA spins
        # by default when a process has fewer contexts than the host has CPUs). Spinning cost each
        # worker about half a core on an H200 host, taken from the frontends (docs/benchmarks.md, GPU).
        self.done = torch.cuda.Event(blocking=True)


class TorchCudaEngine(Engine):
    slots = 2

    def __init__(self, module, profiles: tuple[Profile, ...]) -> None:
        self.module = module
        self.output_names: tuple[str, ...] = module.output_names
        self.seqs = tuple(p.max_seq for p in profiles)
        max_batch = max(p.max_batch for p in profiles)
        self.classes = batch_classes(max_batch)
        self.stream = torch.cuda.Stream()
        # Orders enqueueing on the one stream and guards what follows; held for microseconds (a capture:
        # milliseconds).
        self._lock = threading.Lock()
        self._counters: Counter[str] = Counter()
        self.graphs: dict[tuple[int, int], _Graph] = {}  # (seq, rows): written by the capture thread
        self._demand: Counter[tuple[int, int]] = Counter()  # eager runs by shape since capture started
        # Largest first where traffic does not say otherwise: later (smaller) captures reuse the pool's blocks.
        self._order = [(seq, rows) for seq in reversed(self.seqs) for rows in reversed(self.classes)]
        self._before = torch.cuda.memory_allocated()
        with torch.inference_mode():
            dims = self._first_batch(max_batch, self.stream)
        self._free: queue.SimpleQueue[_Slot] = queue.SimpleQueue()
        for _ in range(self.slots):
            self._free.put(_Slot(max_batch, self.seqs[-1], dims))
        torch.cuda.synchronize()
        self._memory = torch.cuda.memory_allocated() - self._before
        self._capture: threading.Thread | None = None
        self._stopping = threading.Event()
        self._capture_s: float | None = None  # seconds the capture of every graph took, once done
        self.warm_at: float | None = None     # when (monotonic) that was

    def _first_batch(self, rows: int, stream) -> dict[str, int]:
        """One eager batch of `rows` at the longest profile on `stream` (the libraries' handles and
        workspaces for it, the kernels loaded); the output dimensions."""
        warm = torch.full((rows, self.seqs[-1]), 100, dtype=torch.int64, device="cuda")  # [UNK]: any id
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            outputs = self.module(warm, torch.ones_like(warm))
        torch.cuda.current_stream().wait_stream(stream)
        return {name: int(t.shape[-1]) for name, t in zip(self.output_names, outputs)}

    # ---- warming behind traffic ----------------------------------------------------------------------

    def warm_behind_traffic(self) -> None:
        if self._capture is None:
            with self._lock:
                self._demand.clear()  # the worker's warmup batches are not traffic
            self._capture = threading.Thread(target=self._capture_all, name="cuda-graphs", daemon=True)
            atexit.register(self._stop_capturing)  # not torn down mid-capture by the interpreter's exit
            self._capture.start()

    def _stop_capturing(self) -> None:
        self._stopping.set()
        self._capture.join(timeout=10)

    def wait_warm(self, timeout: float | None = None) -> bool:
        """Captures every graph (if not started yet) and waits for it; whether all were captured."""
        self.warm_behind_traffic()
        self._capture.join(timeout)
        return self.warm_at is not None

    def warm_since(self) -> float | None:
        return self.warm_at

    def warm_phases(self) -> dict[str, float]:
        return {} if self._capture_s is None else {"capture": self._capture_s}

    def _capture_all(self) -> None:
        started = time.monotonic()
        stream = torch.cuda.Stream()
        pool = torch.cuda.graph_pool_handle()
        try:
            with torch.inference_mode():
                with self._lock:  # this thread's library handles and the stream's workspaces, before any capture
                    self._first_batch(1, stream)
                stream.synchronize()
                while True:
                    with self._lock:
                        shape = next_capture(self._order, self.graphs, self._demand)
                        if shape is None or self._stopping.is_set():
                            break
                        self.graphs[shape] = _Graph(self.module, shape[1], shape[0], pool, stream)
                    # Python's locks are not fair: re-taken at once, this loop kept every caller (and the
                    # event loop reading counters) waiting for all of the captures, not one.
                    time.sleep(0.0005)
            with self._lock:
                self._memory = torch.cuda.memory_allocated() - self._before
        except Exception:  # a shape without its graph keeps running eagerly: slower, never wrong
            log.exception("capturing CUDA graphs failed after %d of %d; the rest run without one",
                          len(self.graphs), len(self._order))
            return
        finally:  # (the registration holds the engine: let it go once there is nothing to stop)
            atexit.unregister(self._stop_capturing)
        if self._stopping.is_set():
            return
        self.warm_at = time.monotonic()
        self._capture_s = round(self.warm_at - started, 3)
        log.info("captured %d CUDA graphs in %.2f s behind live traffic", len(self.graphs), self._capture_s)

    # ---- running -----------------------------------------------------------------------------------

    def _shape_for(self, rows: int, seq: int) -> tuple[int, int]:
        padded_seq = next((s for s in self.seqs if s >= seq), None)
        padded_rows = next((c for c in self.classes if c >= rows), None)
        if padded_seq is None or padded_rows is None:
            raise ValueError(f"batch {rows} x {seq} tokens exceeds the largest profile "
                             f"({self.classes[-1]} x {self.seqs[-1]})")
        return padded_rows, padded_seq

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        ids, mask = inputs["input_ids"], inputs["attention_mask"]
        rows, seq = ids.shape
        padded_rows, padded_seq = self._shape_for(rows, seq)
        slot = self._free.get()
        try:
            size = padded_rows * padded_seq
            host_ids = slot.ids_np[:size].reshape(padded_rows, padded_seq)
            host_mask = slot.mask_np[:size].reshape(padded_rows, padded_seq)
            host_ids.fill(0)
            host_mask.fill(0)
            host_ids[:rows, :seq] = ids
            host_mask[:rows, :seq] = mask
            staged_ids = slot.ids[:size].view(padded_rows, padded_seq)
            staged_mask = slot.mask[:size].view(padded_rows, padded_seq)
            with self._lock, torch.inference_mode(), torch.cuda.stream(self.stream):
                graph = self.graphs.get((padded_seq, padded_rows))
                if graph is not None:
                    graph.ids.copy_(staged_ids, non_blocking=True)
                    graph.mask.copy_(staged_mask, non_blocking=True)
                    graph.graph.replay()
                    outputs = graph.outputs
                    self._counters["replays"] += 1
                else:  # same shape, same kernels as its graph; allocates (stream-ordered) until it has one
                    self._demand[(padded_seq, padded_rows)] += 1
                    self._counters["eager_runs"] += 1
                    outputs = self.module(staged_ids.to("cuda", non_blocking=True),
                                          staged_mask.to("cuda", non_blocking=True))
                for name, out in zip(self.output_names, outputs):
                    slot.outputs[name][:rows].copy_(out[:rows], non_blocking=True)
                slot.done.record(self.stream)
                self._count(rows, seq, padded_rows, padded_seq, int(mask.sum()))
            slot.done.synchronize()         # waits without the GIL; the other slot's caller runs meanwhile
            return {name: slot.outputs[name][:rows].numpy().copy() for name in self.output_names}
        finally:
            self._free.put(slot)

    def _count(self, rows: int, seq: int, padded_rows: int, padded_seq: int, tokens: int) -> None:
        c = self._counters
        c["rows"] += rows
        c["padded_rows"] += padded_rows - rows
        c["tokens"] += tokens
        c["computed_tokens"] += padded_rows * padded_seq

    def counters(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counters)

    def device_memory_bytes(self) -> int:
        return self._memory


class TorchCudaRuntime(Runtime):
    name = "torch-cuda"
    suffix = ".safetensors"
    source_file = TORCH_WEIGHTS_FILE

    def __init__(self) -> None:
        if torch is None:
            raise RuntimeUnavailable("the torch-cuda runtime needs torch (pip install torch)")
        self.version = f"{torch.__version__.split('+')[0]}-cu{torch.version.cuda or 'none'}"

    def _gpu(self) -> tuple[str, int, int]:
        if not torch.cuda.is_available():
            raise RuntimeUnavailable("the torch-cuda runtime needs a CUDA GPU; torch sees none")
        major, minor = torch.cuda.get_device_capability()
        return torch.cuda.get_device_name(), major, minor

    def device(self) -> tuple[str, dict]:
        name, major, minor = self._gpu()
        return (f"sm{major}{minor}-{name.lower().replace(' ', '-')}",
                {"gpu": name, "compute_capability": f"{major}.{minor}"})

    def open_device(self) -> None:
        self._gpu()
        torch.zeros(1, device="cuda")
        torch.cuda.synchronize()

    def device_label(self) -> str:
        return f"cuda:{torch.cuda.current_device()} ({self._gpu()[0]})"

    def precision(self, requested: str) -> str:
        return "fp32" if requested == "fp32" else "fp16"  # int8-qdq is a TensorRT (Q/DQ graph) feature

    def cannot_serve(self, version_dir: Path) -> str | None:
        missing = super().cannot_serve(version_dir)
        if missing is None and not (version_dir / TORCH_CONFIG_FILE).is_file():
            missing = f"{version_dir / TORCH_CONFIG_FILE} is missing"
        return None if missing is None else f"{missing} (no torch form; run prepare-model / train-head again)"

    def build(self, source: Path, profiles: tuple[Profile, ...], precision: str, out: Path,
              timing_cache: Path) -> dict:
        from safetensors.torch import save_file

        from server.engines.torch_bert import load_torch_source, read_architecture

        dtype = torch.float16 if precision == "fp16" else torch.float32
        arch = read_architecture(source.parent)
        module = load_torch_source(source.parent, device="cpu", dtype=dtype)
        state = {name: t.contiguous() for name, t in module.state_dict().items()}
        save_file(state, str(out), metadata={"architecture": json.dumps(arch.to_json())})
        name, major, minor = self._gpu()
        return {"gpu": name, "compute_capability": f"{major}.{minor}", "torch": torch.__version__,
                "cuda": torch.version.cuda, "parameters": sum(t.numel() for t in state.values())}

    def load(self, artifact: Path, profiles: tuple[Profile, ...], *, threads: int) -> Engine:
        from safetensors import safe_open

        from server.engines.torch_bert import BertArchitecture, TorchBert

        self._gpu()
        with safe_open(str(artifact), framework="pt", device="cuda") as f:
            arch = BertArchitecture.from_json(json.loads(f.metadata()["architecture"]))
            state = {name: f.get_tensor(name) for name in f.keys()}
        with torch.device("meta"):
            module = TorchBert(arch)
        module.load_state_dict(state, strict=True, assign=True)
        return TorchCudaEngine(module.eval().requires_grad_(False), profiles)
