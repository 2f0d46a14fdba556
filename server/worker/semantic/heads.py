"""A head model version in an inference worker: a small layer (one matrix product and a softmax) on the
output of an encoder the worker serves. Its misses run the encoder's batcher once per text, then the head;
the feature tier (server/worker/store/features.py) keeps the encoder output, so the next head version, or the same one
after its result expired, runs the head only.

Heads batch like any other work: their own batcher (one bucket: the feature dimension) cuts batches of
features, run in its thread, on the GPU when the feature tier's memory level is there.
"""

from __future__ import annotations

import time

import numpy as np

from infercache.v1 import infercache_pb2 as pb
from server.worker.batcher import Batcher
from server.config import Config
from server.shared.head_scoring import head_scores, load_head
from server.worker.semantic import label_calibration
from server.worker.store.feature_lru import DeviceRow
from server.shared.answers import Answers
from server.worker.model_runtime import ModelRuntime
from server.shared.models import HeadRef, ModelConfigError, ModelSpec


class _NumpyHead:
    slots = 1

    def __init__(self, weight: np.ndarray, bias: np.ndarray) -> None:
        self.weight, self.bias = weight, bias

    def run(self, features: list) -> np.ndarray:
        return head_scores(np.stack(features), self.weight, self.bias)

    def counters(self) -> dict:
        return {}


class _TorchHead:
    """The head on the GPU: features that the memory LRU holds are already there; others are copied in."""

    slots = 1

    def __init__(self, weight: np.ndarray, bias: np.ndarray, device: str) -> None:
        import torch

        self.torch = torch
        self.device = device
        self.weight = torch.from_numpy(weight).to(device)
        self.bias = torch.from_numpy(bias).to(device)

    def run(self, features: list) -> np.ndarray:
        """`features`: DeviceRows of the feature LRU (gathered on the device) and host arrays (copied in
        together), in any mix."""
        torch = self.torch
        on_device = [n for n, f in enumerate(features) if isinstance(f, DeviceRow)]
        if len(on_device) == len(features):
            x = features[0].lru.gather(features).float()
        else:
            host = [n for n, f in enumerate(features) if not isinstance(f, DeviceRow)]
            rows = torch.from_numpy(np.stack([features[n] for n in host]).astype(np.float32)).to(self.device)
            if on_device:
                x = torch.empty((len(features), rows.shape[1]), dtype=torch.float32, device=self.device)
                x[host] = rows
                x[on_device] = features[on_device[0]].lru.gather([features[n] for n in on_device]).float()
            else:
                x = rows
        return torch.softmax(x @ self.weight + self.bias, dim=1).cpu().numpy()

    def counters(self) -> dict:
        return {}


class HeadRuntime(ModelRuntime):
    def __init__(self, spec: ModelSpec, version: str, ref: HeadRef, encoder: ModelRuntime, dim: int, config: Config,
                 device: str | None) -> None:
        """`dim`: the length of the encoder output the head reads. Made on the event loop (its batcher)."""
        weight, bias, self.labels = load_head(spec, version, ref, encoder.spec)
        self.dim = dim
        if weight.shape[0] != self.dim:
            raise ModelConfigError(f"{spec.version_dir(version)}: head takes {weight.shape[0]} features, the encoder "
                                   f"gives {self.dim}")
        self.spec = spec
        self.version = version
        self.ref = ref
        self.encoder_runtime = encoder  # its batcher computes the features
        self.nice = encoder.nice        # and the head runs at its priority
        self.engine = _TorchHead(weight, bias, device) if device else _NumpyHead(weight, bias)
        self.info = pb.EngineInfo(model=spec.name, version=version, runtime=f"head on {ref.encoder}/{ref.encoder_version}",
                                  precision="fp32", device=device or "cpu")
        self.built_s, self.warmup_s = 0.0, 0.0  # nothing to build: weights
        self.encoder = encoder.encoder
        self.answers = Answers(spec, version, self.labels)
        # What the head is worth as the judge of semantic answers (server/worker/semantic/label_calibration.py):
        # None where train-head wrote none; an unreadable one answers no semantic question (`label_refused`).
        self.label_calibration, self.label_refused = None, ""
        try:
            self.label_calibration = label_calibration.read(spec.version_dir(version))
        except ValueError as exc:
            self.label_refused = str(exc)
        self.batcher = Batcher(
            self._run_batch, buckets=(self.dim,), max_batch=max(256, spec.max_batch_size), max_delay_s=0.0,
            max_queue=config.server.max_queue, concurrency=1, name=f"{spec.name}-{version}-head",
            max_wait_s=config.server.max_queue_wait_s, nice=self.nice,
        )

    def phases(self) -> dict[str, float]:
        """Seconds of each phase of its start (server/worker/startup.py): a head only warms up."""
        return {"warmup": self.warmup_s}

    @property
    def source(self) -> tuple[str, str, str]:
        """(encoder model, version, output): what this head reads (server/worker/store/features.py Source)."""
        return self.ref.encoder, self.ref.encoder_version, self.ref.input

    def reads(self, runtime: ModelRuntime, output: str) -> bool:
        """Whether this head reads `output` of that model version (its features are then that output)."""
        return (runtime.spec.name, runtime.version, output) == self.source

    def _run_batch(self, features: list) -> list[dict[str, np.ndarray]]:
        scores = self.engine.run(features)
        return [{"scores": row} for row in scores]

    def warmup(self) -> None:
        started = time.perf_counter()
        self._run_batch([np.zeros(self.dim, dtype=np.float32)])
        self.batcher.seed_timing(time.perf_counter() - started)
