"""A generation's flight: the callers it answers, the text sent so far (a late joiner's replay) and, once
it ended, its whole answer; whatever computes it (a local scheduler, an upstream's stream) sends its pieces
through it. Generation adds a local decoder's state of it: its prompt, sampler, slot and step bookkeeping."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import numpy as np

from cachestore.results import now_us
from infercache.v1 import worker_pb2
from server.worker.generation.answer_text import AnswerText, Sampler

if TYPE_CHECKING:
    from server.worker.generation.scheduler import GenerativeRuntime


class GenerateFlight:
    """One generation and the callers it answers: (connection, item id) -> joined."""

    __slots__ = ("key", "item", "model", "listeners", "sent", "answer", "dropped", "deadline", "created_us", "store",
                 "companion", "background")
    CANCELLED = "generate_cancelled"  # the counter of generations nobody waited for any more
    pending = None  # (no future of its own to wait for at close: its scheduler closes with it)

    def __init__(self, item: worker_pb2.ComputeItem, model, deadline: float | None) -> None:
        """model: the model version's runtime (spec, version; a local one's tokenizer and format)."""
        self.key = item.key
        self.item = item
        self.model = model
        self.listeners: dict[tuple, bool] = {}
        self.sent: list[tuple[str, list[int]]] = []  # deltas so far: a late joiner's replay
        self.answer: bytes | None = None     # once it ended: the whole answer (server/shared/generated.py)
        self.dropped = False                 # cancelled by all its callers, or past its deadline
        self.deadline = deadline
        self.created_us = now_us()
        self.store = item.store
        # Semantic answers (server/worker/semantic/answer_matching.py): the question's entry, stored beside the answer.
        self.companion = None
        # A shadow regeneration: the future its whole answer goes to (None: a foreground generation).
        self.background: asyncio.Future | None = None

    def may_join(self, item: worker_pb2.ComputeItem) -> bool:
        """Whether an item may take this generation's answer: a deterministic one (its key names its
        answer), while the generation runs, or once it ended where the item may use a stored answer."""
        return (item.cached_ok or item.store) and not self.dropped and (self.answer is None or item.cached_ok)

    def leave(self, replies, item_id: int) -> bool:
        """A caller went away; True when nobody waits any more for a generation still running (it is
        dropped at its scheduler's next step)."""
        self.listeners.pop((replies, item_id), None)
        if self.listeners or self.answer is not None:
            return False
        self.dropped = True
        return True

    def fail(self, exc: BaseException) -> None:
        """Every caller gets `exc`; the flight is dropped (its computation stops)."""
        self.dropped = True
        for replies, item_id in list(self.listeners):
            replies.waiting.pop(item_id, None)
            replies.fail(item_id, exc)
        self.listeners.clear()

    def send(self, delta: str, ids: list[int]) -> None:
        """The answer's next piece, to every caller (and kept for one that joins later)."""
        self.sent.append((delta, ids))
        for replies, item_id in self.listeners:
            replies.stream(item_id, delta, ids)


class Generation(GenerateFlight):
    """A generation a local decoder computes: its prompt, sampler, slot and step bookkeeping."""

    __slots__ = ("text", "sampler", "prompt", "limit", "slot", "fed", "planned", "received", "next_token", "awaiting",
                 "last_step", "looked_up", "loading", "loaded", "block_keys", "kept", "reused_from", "erasures",
                 "seated_at")

    def __init__(self, item: worker_pb2.ComputeItem, model: "GenerativeRuntime", deadline: float | None) -> None:
        super().__init__(item, model, deadline)
        params = item.generate
        self.text = AnswerText(model.tokenizer, model.format.end_ids, list(params.stop), params.max_new_tokens)
        self.sampler = Sampler(params.temperature, params.top_p, params.top_k,
                               params.seed if params.HasField("seed") else None)
        self.prompt = np.frombuffer(item.ids, dtype="<i4").tolist()
        # The answer's most tokens: what was asked, and what the context leaves (prompt + answer <= context).
        self.limit = min(params.max_new_tokens, model.spec.generation.context_length - len(self.prompt))
        # The scheduler's bookkeeping: the slot it holds in the decoder, prompt tokens given to steps,
        # answer tokens that launched steps will produce, those read, the token to give the next row
        # (sampled: chosen here; greedy: None, the decoder's own), whether a launched step's answer is
        # awaited before it (sampled), and the last step that used the slot.
        self.slot: int | None = None
        self.fed = 0
        self.planned = 0
        self.received = 0
        self.next_token: int | None = None
        self.awaiting = False
        self.last_step = 0
        # The prefix cache's (server/worker/prefix/prefix_cache.py): whether its prompt was looked up, blocks being
        # read from disk for it and those read, its block keys, blocks kept so far, the tier it reused from,
        # the cache's erasures when it was looked up.
        self.looked_up = False
        self.loading = False
        self.loaded: dict | None = None
        self.block_keys: list[bytes] = []
        self.kept = 0
        self.reused_from = "none"
        self.erasures = 0
        self.seated_at = 0.0

    @property
    def sampled(self) -> bool:
        return self.sampler.rng is not None
