"""The engine interface: what the worker needs from a runtime, and nothing more.

A Runtime builds an artifact from a model's ONNX file (once, into the L3 store) and loads an Engine
from it (in every serving process). An Engine runs padded batches.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

import numpy as np


class RuntimeUnavailable(RuntimeError):
    """This runtime cannot build or run on this host (library or device missing)."""


class EngineBuildError(RuntimeError):
    pass


@dataclass(frozen=True)
class Profile:
    """One optimization profile: batches of up to max_batch sequences of min_seq..max_seq tokens.

    The batcher's sequence-length buckets map one to one onto profiles, so every batch it cuts fits
    exactly one profile (TensorRT needs that; ONNX Runtime takes any shape)."""

    min_seq: int
    max_seq: int
    max_batch: int

    @property
    def opt_batch(self) -> int:
        return max(1, self.max_batch // 2)  # the batcher mostly cuts partial batches

    def shapes(self) -> tuple[int, ...]:
        """(min_batch, opt_batch, max_batch, min_seq, opt_seq, max_seq), as named in the L3 key."""
        return (1, self.opt_batch, self.max_batch, self.min_seq, self.max_seq, self.max_seq)


def profiles_for(buckets: tuple[int, ...], max_batch: int) -> tuple[Profile, ...]:
    lows = (1,) + tuple(b + 1 for b in buckets[:-1])
    return tuple(Profile(lo, hi, max_batch) for lo, hi in zip(lows, buckets))


class Engine(ABC):
    """Runs padded batches; the worker calls it off the event loop, from `slots` threads at most (a
    GPU engine with two slots prepares batch n+1 on the host while the device runs batch n)."""

    slots: int = 1
    # Runs a batch of any sequence length at that length's cost, padded to its longest row (not to its
    # profile): the batcher then cuts batches by finer length groups (server/shared/admission.py length_groups).
    any_length: bool = False

    @abstractmethod
    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """inputs: name -> [batch, seq] int64; returns name -> [batch, ...] arrays."""

    @abstractmethod
    def device_memory_bytes(self) -> int:
        """Memory the engine holds on its device (0 where that is host memory)."""

    def counters(self) -> dict[str, int]:
        """The engine's own figures (padding, graph replays, ...) for GetStats; written by its run threads."""
        return {}

    def warm_behind_traffic(self) -> None:
        """Starts, in the background, what makes the engine faster without changing its answers (the
        torch-cuda engine's CUDA graphs); the engine serves meanwhile. Nothing to do for most."""

    def warm_since(self) -> float | None:
        """When (time.monotonic()) the engine reached full speed: None while warm_behind_traffic's work
        is under way, 0.0 for an engine at full speed from its load."""
        return 0.0

    def warm_phases(self) -> dict[str, float]:
        """Seconds of the engine's own phases of its start (the torch-cuda engine's capture, once done)."""
        return {}


class Runtime(ABC):
    name: str
    version: str
    suffix: str  # artifact file extension
    source_file: str = "model.onnx"  # what a build reads from the model version directory

    def cannot_serve(self, version_dir: Path) -> str | None:
        """Why this runtime cannot serve the model version in version_dir; None when it can."""
        if not (version_dir / self.source_file).is_file():
            return f"{version_dir / self.source_file} is missing"
        return None

    def open_device(self) -> None:
        """Creates the device's context before the first engine loads (timed on its own at start)."""

    def device_label(self) -> str:
        """The device it runs on, for ListModels and GetStats ("cpu", "cuda:0 (NVIDIA H200)")."""
        return "cpu"

    @abstractmethod
    def device(self) -> tuple[str, dict]:
        """(tag for artifact names, details for the manifest) of the device this host builds for."""

    @abstractmethod
    def precision(self, requested: str) -> str:
        """The precision a build will have, given the requested one ("fp16", "fp32", "int8-qdq")."""

    @abstractmethod
    def build(self, source: Path, profiles: tuple[Profile, ...], precision: str, out: Path,
              timing_cache: Path) -> dict:
        """Builds `source` into `out`; returns details for the manifest."""

    @abstractmethod
    def load(self, artifact: Path, profiles: tuple[Profile, ...], *, threads: int) -> Engine:
        pass
