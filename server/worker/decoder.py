"""A generative model's decoder on ONNX Runtime (CPU): the graph server/tools/export_decoder.py wrote, with
the past keys and values as inputs and outputs. A sequence's past stays in ONNX Runtime's own buffers
(OrtValues) from one step to the next, never copied through numpy. Not thread-safe per sequence: the
scheduler (server/worker/generation.py) runs every step of a model on one thread."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnxruntime as ort

from server.shared.generation_spec import DECODER_CONFIG_FILE, DECODER_FILE

PREFILL_CHUNK = 512  # prompt tokens per forward: a long prompt is read in pieces of this size


@dataclass(slots=True)
class Sequence:
    """One generation's state in the decoder: its past and how many positions it holds."""

    past: list = field(default_factory=list)
    length: int = 0


class OrtDecoder:
    def __init__(self, directory: Path, threads: int) -> None:
        shape = json.loads((directory / DECODER_CONFIG_FILE).read_text())
        self.layers, self.kv_heads, self.head_dim = shape["layers"], shape["kv_heads"], shape["head_dim"]
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        self.session = ort.InferenceSession(str(directory / DECODER_FILE), options, providers=["CPUExecutionProvider"])
        self.past_names = [i.name for i in self.session.get_inputs()][3:]
        self.output_names = [o.name for o in self.session.get_outputs()]
        self._empty = ort.OrtValue.ortvalue_from_numpy(np.zeros((1, self.kv_heads, 0, self.head_dim), np.float32))

    def prefill(self, ids: list[int], chunk: int = PREFILL_CHUNK) -> tuple[Sequence, np.ndarray]:
        """A new sequence that has read `ids`, and the scores of its next token."""
        sequence = Sequence([self._empty] * (2 * self.layers), 0)
        logits = None
        for start in range(0, len(ids), chunk):
            logits = self._forward(sequence, ids[start:start + chunk])
        return sequence, logits

    def decode(self, sequence: Sequence, token: int) -> np.ndarray:
        """Feeds one token to the sequence; the scores of the next one."""
        return self._forward(sequence, [token])

    def _forward(self, sequence: Sequence, ids: list[int]) -> np.ndarray:
        new = len(ids)
        total = sequence.length + new
        feeds = {
            "input_ids": ort.OrtValue.ortvalue_from_numpy(np.asarray([ids], dtype=np.int64)),
            "attention_mask": ort.OrtValue.ortvalue_from_numpy(np.ones((1, total), dtype=np.int64)),
            "position_ids": ort.OrtValue.ortvalue_from_numpy(np.arange(sequence.length, total, dtype=np.int64)[None]),
        }
        feeds.update(zip(self.past_names, sequence.past))
        outputs = self.session.run_with_ort_values(self.output_names, feeds)
        sequence.past = outputs[1:]
        sequence.length = total
        return outputs[0].numpy()[0]
