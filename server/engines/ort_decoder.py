"""A generative model's decoder on ONNX Runtime (CPU): the graph server/tools/export_decoder.py wrote, with
the past keys and values as inputs and outputs. A sequence's past stays in ONNX Runtime's own buffers
(OrtValues) from one step to the next, never copied through numpy. Each chunk and each row of a step is
one forward of its own sequence, in `launch` (not pipelined). Not thread-safe: the scheduler
(server/worker/generation/scheduler.py) runs every step of a model on one thread."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort

from server.engines.decoding import Decoder, Step, StepOutcome
from server.shared.generation_spec import DECODER_CONFIG_FILE, DECODER_FILE


class _Sequence:
    __slots__ = ("past", "length", "next", "arrays")

    def __init__(self, empty: list) -> None:
        self.past = empty       # OrtValues, keys and values of each layer
        self.length = 0         # positions it holds
        self.next = -1          # argmax after its last forward: the next row's token unless one is given
        self.arrays: list = []  # what restored OrtValues were made from (they share its memory)


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
        self.blocks = np.empty((0,), np.float32)  # prefix blocks (open_blocks)
        self.block_tokens = 0

    def launch(self, step: Step) -> StepOutcome:
        outcome = StepOutcome([], exports=[(tag, self.blocks[index].copy()) for index, tag in step.exports])
        self._restore(step.restores)
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
        self._keep(step.keeps)
        return outcome

    # -- prefix blocks: [2, layers, kv_heads, tokens, head_dim] float32 in host memory --------------------

    def block_bytes(self, tokens: int) -> int:
        return 2 * self.layers * self.kv_heads * tokens * self.head_dim * 4

    def open_blocks(self, tokens: int, budget_bytes: int) -> int:
        count = budget_bytes // self.block_bytes(tokens)
        self.block_tokens = tokens
        self._block_shape = (2, self.layers, self.kv_heads, tokens, self.head_dim)
        self.blocks = np.empty((count, *self._block_shape), np.float32)
        return count

    def host_block(self, data) -> np.ndarray:
        raw = np.frombuffer(data, dtype=np.float32)
        if raw.size * 4 != self.block_bytes(self.block_tokens):
            raise ValueError(f"a block of {raw.size * 4} bytes, this decoder's hold {self.block_bytes(self.block_tokens)}")
        return raw.reshape(self._block_shape).copy()

    def host_bytes(self, block: np.ndarray) -> memoryview:
        return memoryview(block).cast("B")

    def _restore(self, restores) -> None:
        """Each slot restored gets a new sequence whose past is its blocks, in order from position 0."""
        by_slot: dict[int, list] = {}
        for restore in sorted(restores, key=lambda r: (r.slot, r.start)):
            if restore.start != len(by_slot.setdefault(restore.slot, [])) * self.block_tokens:
                raise ValueError(f"slot {restore.slot}: blocks must be restored in order from position 0")
            by_slot[restore.slot].append(self.blocks[restore.source] if isinstance(restore.source, int)
                                         else restore.source)
        for slot, blocks in by_slot.items():
            joined = np.concatenate(blocks, axis=3)  # [2, layers, kv, positions, d]
            sequence = self._sequences[slot] = _Sequence(self._empty)
            sequence.arrays = [np.ascontiguousarray(joined[kv, layer][None]) for layer in range(self.layers)
                               for kv in (0, 1)]
            sequence.past = [ort.OrtValue.ortvalue_from_numpy(a) for a in sequence.arrays]
            sequence.length = joined.shape[3]

    def _keep(self, keeps) -> None:
        by_slot: dict[int, list] = {}
        for keep in keeps:
            by_slot.setdefault(keep.slot, []).append(keep)
        for slot, wanted in by_slot.items():
            past = [value.numpy() for value in self._sequences[slot].past]  # [1, kv, positions, d] each
            for keep in wanted:
                end = keep.start + self.block_tokens
                for layer in range(self.layers):
                    self.blocks[keep.block, 0, layer] = past[2 * layer][0, :, keep.start:end]
                    self.blocks[keep.block, 1, layer] = past[2 * layer + 1][0, :, keep.start:end]

    def collect(self, handle: StepOutcome) -> StepOutcome:
        return handle

    def release(self, slot: int) -> None:
        self._sequences.pop(slot, None)  # its past's memory goes now

    def _forward(self, sequence: _Sequence, ids: list[int], outcome: StepOutcome, scores: bool) -> None:
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
