"""What a generation scheduler asks of a decoder (server/worker/generation/scheduler.py), whatever runs it.

A decoder holds `slots` sequences at once, each in a slot the scheduler chooses. One step reads prompt
chunks of some sequences and one new token of others, and answers each chunk that ends its prompt, and
each row, with its next token's argmax (and the scores themselves where asked: sampled generations). A
row's input token may be left to the decoder: the argmax it produced for that slot at its previous step
(greedy generations), which lets a pipelined decoder start step n+1 before the scheduler has read step n.

`launch` starts a step and `collect` waits for its outcome, in launch order. A pipelined decoder (a GPU)
returns from `launch` at once; the scheduler then launches step n+1 before it collects step n, and the
device never waits for the host. Others compute in `launch`.

Prefix blocks (server/worker/prefix/prefix_cache.py): a decoder keeps key/value blocks of `block_tokens`
positions in its fastest memory (`open_blocks`: device memory on a GPU), numbered 0..count-1. A step
first copies the blocks it exports out to host memory (the outcome carries them, tagged), then writes
restored blocks into slots (from a memory block, a host block, or a block's bytes from disk), computes,
and last keeps slot ranges as memory blocks. A block's layout: [2 (keys, values), layers, kv_heads,
block_tokens, head_dim] in the decoder's dtype.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import numpy as np


@dataclass(slots=True)
class Chunk:
    """Prompt tokens of the sequence in `slot`, at positions start, start + 1, ..."""

    slot: int
    ids: list[int]
    start: int
    last: bool = False      # the prompt's last chunk: the step answers its next token
    scores: bool = False    # ... and its scores


@dataclass(slots=True)
class StepRow:
    """One new token of the sequence in `slot`, at `position`."""

    slot: int
    position: int
    token: int | None = None  # None: the decoder's own argmax for this slot at its previous step
    scores: bool = False


@dataclass(slots=True)
class Restore:
    """A cached block into the slot's positions start .. start + block_tokens - 1."""

    slot: int
    start: int
    source: object  # int: a memory block; else a host block (an export, or host_block() of disk bytes)


@dataclass(slots=True)
class Keep:
    """The slot's positions start .. start + block_tokens - 1 into memory block `block`."""

    slot: int
    start: int
    block: int


@dataclass(slots=True)
class Step:
    chunks: list[Chunk] = field(default_factory=list)
    rows: list[StepRow] = field(default_factory=list)
    restores: list[Restore] = field(default_factory=list)
    keeps: list[Keep] = field(default_factory=list)
    exports: list[tuple[int, object]] = field(default_factory=list)  # (memory block, tag): copied out first

    def __bool__(self) -> bool:
        return bool(self.chunks or self.rows or self.restores or self.keeps or self.exports)


@dataclass(slots=True)
class StepOutcome:
    """Of one step: argmax tokens in the step's order (chunks, then rows; a chunk's is its last token's,
    meaningful where the chunk ends its prompt), and scores by that index where they were asked for."""

    tokens: list[int]
    scores: dict[int, np.ndarray] = field(default_factory=dict)
    exports: list[tuple[object, object]] = field(default_factory=list)  # (tag, host block)


class Decoder(ABC):
    slots: int                  # sequences held at once
    context: int                # positions per sequence
    pipelined: bool = False     # launch returns before the step is computed
    runtime: str
    precision: str
    device: str

    @abstractmethod
    def launch(self, step: Step):
        """Starts a step; a handle for `collect`."""

    @abstractmethod
    def collect(self, handle) -> StepOutcome:
        """Waits for a launched step (in launch order) and answers it."""

    def open_blocks(self, tokens: int, budget_bytes: int) -> int:
        """Memory for prefix blocks of `tokens` positions within `budget_bytes`; how many fit (0: none)."""
        return 0

    def block_bytes(self, tokens: int) -> int:
        """Bytes of one block of `tokens` positions."""
        return 0

    def host_block(self, data) -> object:
        """A host block from its bytes (a disk record's payload); ValueError when they do not fit."""
        raise ValueError("this decoder keeps no prefix blocks")

    def reserve_host(self, count: int) -> None:
        """Host memory for `count` blocks made ready ahead (pinned memory on a GPU), so that exports and
        disk reads do not pay for it while serving."""

    def host_bytes(self, block) -> memoryview:
        """The bytes of a host block (what the disk tier stores)."""
        raise ValueError("this decoder keeps no prefix blocks")

    def release(self, slot: int) -> None:
        """The sequence in `slot` is done; its memory may be reused (every step that used it is collected)."""

    def device_memory_bytes(self) -> int:
        return 0

    def counters(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        pass
