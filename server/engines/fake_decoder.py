"""The fake decoder: server/engines/decoding.py's interface with no model behind it, answering each step
at once with deterministic tokens.

For tests and benchmarks of what surrounds a decoder (the generation scheduler, the prefix cache), with
no weights to load and no model time in what they measure. A slot's "keys and values" are the token ids
at its positions, and the next token is a hash of them all (over `vocab` ids): an answer depends on its
whole prompt, so a prefix block restored into the wrong place, or a chunk read twice or skipped, changes
it, as it would with a model. Each step is checked against the interface's rules (chunks and rows at
the positions the slot holds, restores in order from position 0, keeps within the positions held, slots
used only until they are released) and breaks them with ValueError, as a real decoder would fail.
`pipelined` makes the scheduler launch step n+1 before it collects step n (the GPU decoder's way); the
outcome is computed in `launch` either way. `pause` holds steps in `launch` (`allow(n)` lets n more
through, `resume` all), so a test can act at a chosen step while the decoder "computes". `steps`
keeps every launched step and `released` every slot released, in order.

`fake_model` writes a generative model of the repository's form with no weights: its config.yaml and a
version directory holding a word-level tokenizer of `vocab` words and a prompt format, so that its
ModelSpec, tokenizer and prompt format load as a real model's do.
"""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path

import numpy as np

from server.engines.decoding import Decoder, Step, StepOutcome
from server.shared.generation_spec import GENERATION_FILE
from server.shared.models import TOKENIZER_FILE, ModelSpec, load_model

END = 0  # fake_model's end-of-answer token ("<end>")


class FakeDecoder(Decoder):
    runtime = "fake"
    precision = "none"
    device = "cpu"

    def __init__(self, slots: int, context: int, vocab: int = 64, *, token_bytes: int = 4, pipelined: bool = False,
                 end_ids: tuple[int, ...] = ()) -> None:
        """token_bytes: a block position's size (a multiple of 4), for the prefix cache's byte budgets.
        end_ids: tokens the decoder never answers (an answer then ends by its length alone)."""
        if token_bytes < 4 or token_bytes % 4:
            raise ValueError("token_bytes must be a positive multiple of 4")
        self.slots, self.context, self.vocab = slots, context, vocab
        self.pipelined = pipelined
        self.end_ids = frozenset(end_ids)
        self.width = token_bytes // 4  # int32 columns per position: the id, then zeros
        self._allowed: int | None = None  # steps `launch` may still start (None: any number)
        self._turn = threading.Condition()
        self.steps: list[Step] = []
        self.released: list[int] = []
        self._held: dict[int, list[int]] = {}  # slot -> token ids at its positions
        self._next: dict[int, int] = {}        # slot -> its argmax after its last step
        self.blocks = np.empty((0, 0, self.width), np.int32)
        self.block_tokens = 0
        self._counts = {"steps": 0, "chunk_tokens": 0, "rows": 0}

    # -- tokens --------------------------------------------------------------------------------------------

    def token(self, ids: list[int]) -> int:
        """The next token after `ids` (a sequence from position 0)."""
        digest = hashlib.blake2b(np.asarray(ids, dtype="<i4").tobytes(), digest_size=8).digest()
        token = int.from_bytes(digest, "little") % self.vocab
        while token in self.end_ids:
            token = (token + 1) % self.vocab
        return token

    def answer(self, prompt: list[int], count: int) -> list[int]:
        """The `count` tokens a greedy generation of `prompt` answers (what a step-by-step run must give)."""
        ids = list(prompt)
        for _ in range(count):
            ids.append(self.token(ids))
        return ids[len(prompt):]

    def _scores(self, token: int) -> np.ndarray:
        scores = np.zeros(self.vocab, np.float32)
        scores[token] = 1.0
        return scores

    # -- steps ---------------------------------------------------------------------------------------------

    def pause(self) -> None:
        """Holds every step from now on in `launch` (on the scheduler's thread) until allowed."""
        with self._turn:
            self._allowed = 0

    def allow(self, steps: int) -> None:
        with self._turn:
            self._allowed = (self._allowed or 0) + steps
            self._turn.notify_all()

    def resume(self) -> None:
        with self._turn:
            self._allowed = None
            self._turn.notify_all()

    def launch(self, step: Step) -> StepOutcome:
        with self._turn:
            self._turn.wait_for(lambda: self._allowed != 0)
            if self._allowed is not None:
                self._allowed -= 1
        self.steps.append(step)
        outcome = StepOutcome([], exports=[(tag, self.blocks[index].copy()) for index, tag in step.exports])
        self._restore(step)
        for chunk in step.chunks:
            held = self._held.get(chunk.slot) if chunk.start else None
            if held is None:
                if chunk.start:
                    raise ValueError(f"slot {chunk.slot} holds nothing, the chunk starts at {chunk.start}")
                held = self._held[chunk.slot] = []
            if chunk.start != len(held):
                raise ValueError(f"slot {chunk.slot} holds {len(held)} positions, the chunk starts at {chunk.start}")
            held.extend(chunk.ids)
            self._counts["chunk_tokens"] += len(chunk.ids)
            self._answer(chunk.slot, outcome, chunk.scores)
        for row in step.rows:
            held = self._held.get(row.slot)
            if held is None or row.position != len(held):
                raise ValueError(f"slot {row.slot} holds {len(held or ())} positions, the row is at {row.position}")
            held.append(self._next[row.slot] if row.token is None else row.token)
            self._counts["rows"] += 1
            self._answer(row.slot, outcome, row.scores)
        for keep in step.keeps:
            held = self._held.get(keep.slot, [])
            if keep.start + self.block_tokens > len(held):
                raise ValueError(f"slot {keep.slot} holds {len(held)} positions, the kept block ends at "
                                 f"{keep.start + self.block_tokens}")
            self.blocks[keep.block] = 0
            self.blocks[keep.block, :, 0] = held[keep.start:keep.start + self.block_tokens]
        self._counts["steps"] += 1
        return outcome

    def _answer(self, slot: int, outcome: StepOutcome, scores: bool) -> None:
        token = self._next[slot] = self.token(self._held[slot])
        if scores:
            outcome.scores[len(outcome.tokens)] = self._scores(token)
        outcome.tokens.append(token)

    def _restore(self, step: Step) -> None:
        by_slot: dict[int, list] = {}
        for restore in sorted(step.restores, key=lambda r: (r.slot, r.start)):
            blocks = by_slot.setdefault(restore.slot, [])
            if restore.start != len(blocks) * self.block_tokens:
                raise ValueError(f"slot {restore.slot}: blocks must be restored in order from position 0")
            source = restore.source
            blocks.append(self.blocks[source] if isinstance(source, int) else source)
        for slot, blocks in by_slot.items():
            self._held[slot] = [int(i) for block in blocks for i in block[:, 0]]

    def collect(self, handle: StepOutcome) -> StepOutcome:
        return handle

    def release(self, slot: int) -> None:
        self._held.pop(slot, None)
        self._next.pop(slot, None)
        self.released.append(slot)

    # -- prefix blocks: [tokens, token_bytes / 4] int32, the ids in column 0 ---------------------------------

    def block_bytes(self, tokens: int) -> int:
        return tokens * self.width * 4

    def open_blocks(self, tokens: int, budget_bytes: int) -> int:
        self.block_tokens = tokens
        self.blocks = np.zeros((budget_bytes // self.block_bytes(tokens), tokens, self.width), np.int32)
        return len(self.blocks)

    def host_block(self, data) -> np.ndarray:
        raw = np.frombuffer(data, dtype=np.int32)
        if raw.size * 4 != self.block_bytes(self.block_tokens):
            raise ValueError(f"a block of {raw.size * 4} bytes, this decoder's hold {self.block_bytes(self.block_tokens)}")
        return raw.reshape(self.block_tokens, self.width).copy()

    def host_bytes(self, block: np.ndarray) -> memoryview:
        return memoryview(np.ascontiguousarray(block)).cast("B")

    def counters(self) -> dict[str, int]:
        return dict(self._counts)


def fake_model(root: Path, name: str, config: str = "", vocab: int = 64) -> ModelSpec:
    """Model `name` under `root` (task generate, version "1"): `config` is YAML added to its config.yaml
    (its generate: and prefix_cache: sections). Its tokenizer's words are "w1", "w2", ... (id END, "<end>",
    ends an answer); its chat template joins the turns' texts."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    directory = root / name / "1"
    directory.mkdir(parents=True)
    (root / name / "config.yaml").write_text(f'task: generate\nserving_version: "1"\ncache: {{ttl_s: 600}}\n{config}')
    words = {"<end>": END, **{f"w{i}": i for i in range(1, vocab)}}
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="<end>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(["<end>"])
    tokenizer.save(str(directory / TOKENIZER_FILE))
    template = "{% for message in messages %}{{ message['content'] }} {% endfor %}"
    (directory / GENERATION_FILE).write_text(json.dumps({"chat_template": template, "end_ids": [END],
                                                         "max_positions": 1 << 16}))
    return load_model(root / name)
