"""The engine interface: what the worker needs from a runtime, and nothing more."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Profile:
    """One optimization profile: batches up to max_batch of sequences up to max_seq tokens.

    The batcher's sequence-length buckets map one to one onto profiles, so every batch it cuts fits
    exactly one profile (TensorRT needs that; ONNX Runtime takes any shape)."""

    min_seq: int
    max_seq: int
    max_batch: int


def profiles_for(buckets: tuple[int, ...], max_batch: int) -> tuple[Profile, ...]:
    lows = (1,) + tuple(b + 1 for b in buckets[:-1])
    return tuple(Profile(lo, hi, max_batch) for lo, hi in zip(lows, buckets))


class Engine(ABC):
    """Runs padded batches. Thread-safe for one caller at a time; the worker calls it off the event loop."""

    @abstractmethod
    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """inputs: name -> [batch, seq] int64; returns name -> [batch, ...] arrays."""

    @abstractmethod
    def device_memory_bytes(self) -> int:
        """Memory the engine holds on its device (0 where that is host memory)."""


def load_engine(model_path: Path, profiles: tuple[Profile, ...], *, threads: int) -> Engine:
    """The engine for this host. CPU builds use ONNX Runtime; later runtimes plug in here."""
    from server.engines.onnxruntime import OrtEngine

    return OrtEngine(model_path, profiles, threads=threads)
