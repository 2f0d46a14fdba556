"""A generative model's decoder on ONNX Runtime (CPU): the graph server/tools/export_decoder.py wrote, with
the past keys and values as inputs and outputs. A sequence's past stays in ONNX Runtime's own buffers
(OrtValues) from one step to the next, never copied through numpy. Each chunk and each row of a step is
one forward of its own sequence, in `launch` (not pipelined). Not thread-safe: the scheduler
(server/worker/generation.py) runs every step of a model on one thread."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort

from server.engines.decoding import Decoder, Outcome, Step
from server.shared.generation_spec import DECODER_CONFIG_FILE, DECODER_FILE


class _Sequence:
    __slots__ = ("past", "length", "next")

    def __init__(self, empty: list) -> None:
        self.past = empty       # OrtValues, keys and values of each layer
        self.length = 0         # positions it holds
        self.next = -1          # argmax after its last forward: the next row's token unless one is given


class OrtDecoder(Decoder):
    runtime = "onnxruntime"
    precision = "fp32"
    device = "cpu"

    def __init__(self, directory: Path, threads: int, slots: int, context: int) -> None:
        shape = json.loads((directory / DECODER_CONFIG_FILE).read_text())
        self.layers, self.kv_heads, self.head_dim = shape["layers"], shape["kv_heads"], shape["head_dim"]
        self.slots, self.context = slots, context
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        self.session = ort.InferenceSession(str(directory / DECODER_FILE), options, providers=["CPUExecutionProvider"])
        self.past_names = [i.name for i in self.session.get_inputs()][3:]
        self.output_names = [o.name for o in self.session.get_outputs()]
        empty = ort.OrtValue.ortvalue_from_numpy(np.zeros((1, self.kv_heads, 0, self.head_dim), np.float32))
        self._empty = [empty] * (2 * self.layers)
        self._sequences: dict[int, _Sequence] = {}

    def launch(self, step: Step) -> Outcome:
        outcome = Outcome([])
        for chunk in step.chunks:
            sequence = self._sequences.get(chunk.slot)
            if sequence is None or chunk.start == 0:
                sequence = self._sequences[chunk.slot] = _Sequence(self._empty)
            if chunk.start != sequence.length:
                raise ValueError(f"slot {chunk.slot} holds {sequence.length} positions, the chunk starts at {chunk.start}")
            self._forward(sequence, chunk.ids, outcome, chunk.scores)
        for row in step.rows:
            sequence = self._sequences[row.slot]
            if row.position != sequence.length:
                raise ValueError(f"slot {row.slot} holds {sequence.length} positions, the row is at {row.position}")
            self._forward(sequence, [sequence.next if row.token is None else row.token], outcome, row.scores)
        return outcome

    def collect(self, handle: Outcome) -> Outcome:
        return handle

    def release(self, slot: int) -> None:
        self._sequences.pop(slot, None)  # its past's memory goes now

    def _forward(self, sequence: _Sequence, ids: list[int], outcome: Outcome, scores: bool) -> None:
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
        logits = outputs[0].numpy()[0]
        sequence.next = int(np.argmax(logits))
        if scores:
            outcome.scores[len(outcome.tokens)] = logits
        outcome.tokens.append(sequence.next)
