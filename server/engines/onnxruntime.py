"""ONNX Runtime engine (CPU execution provider): the default, runs on any machine."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import onnxruntime as ort

from server.engines.base import Engine, Profile

log = logging.getLogger("infercache.engine")


class OrtEngine(Engine):
    def __init__(self, model_path: Path, profiles: tuple[Profile, ...], *, threads: int = 0) -> None:
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads or os.cpu_count() or 1
        options.inter_op_num_threads = 1
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        # Idle intra-op threads would otherwise spin for a while after every run, taking the cores
        # that the frontends' and the worker's event loops need between batches.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.session = ort.InferenceSession(str(model_path), options, providers=["CPUExecutionProvider"])
        self.input_names = tuple(i.name for i in self.session.get_inputs())
        self.output_names = tuple(o.name for o in self.session.get_outputs())
        self.profiles = profiles

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        feeds = {name: inputs[name] for name in self.input_names}
        return dict(zip(self.output_names, self.session.run(None, feeds)))

    def device_memory_bytes(self) -> int:
        return 0
