"""The null runtime: answers every batch at once with zeros of the model's output shapes.

For benchmarks only (`engines.runtime: null`, never picked by auto): with no model work left, what a
server run measures is the server itself, the capacity of its frontends and workers in items per
second. Its artifact is the output shapes read from the ONNX graph, kept in the L3 store like any other.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from server.engines.base import Engine, Profile, Runtime


class NullEngine(Engine):
    slots = 2

    def __init__(self, dims: dict[str, int]) -> None:
        self.dims = dims

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        rows = len(inputs["input_ids"])
        return {name: np.zeros((rows, dim), dtype=np.float32) for name, dim in self.dims.items()}

    def device_memory_bytes(self) -> int:
        return 0


class NullRuntime(Runtime):
    name = "null"
    version = "1"
    suffix = ".shapes"  # not .json: manifests are <name>.json beside the artifacts

    def device(self) -> tuple[str, dict]:
        return "any", {}

    def precision(self, requested: str) -> str:
        return "none"

    def build(self, source: Path, profiles: tuple[Profile, ...], precision: str, out: Path,
              timing_cache: Path) -> dict:
        import onnxruntime as ort

        session = ort.InferenceSession(str(source), providers=["CPUExecutionProvider"])
        feeds = {i.name: np.ones((1, 2), dtype=np.int64) for i in session.get_inputs()}  # shapes are symbolic
        names = [o.name for o in session.get_outputs()]
        dims = {name: int(value.shape[-1]) for name, value in zip(names, session.run(None, feeds))}
        out.write_text(json.dumps(dims))
        return {"outputs": dims}

    def load(self, artifact: Path, profiles: tuple[Profile, ...], *, threads: int) -> Engine:
        return NullEngine(json.loads(artifact.read_text()))
