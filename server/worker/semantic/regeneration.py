"""Shadow regeneration: how the shadow verifier (server/worker/semantic/shadow.py) checks a semantic answer of a
generative model judged by answer equivalence (server/worker/semantic/answer_equivalence.py). The check's model is
the generative model itself: the new question's answer is generated again, with the request's own
generation settings, and embedded by the embedder; the check compares that embedding with the served
answer's.

`RegenerationLane` is what the verifier sees of a model version: a batcher's face (`enqueue`, `depth`,
`group_of`, ...) over its scheduler (server/worker/generation/scheduler.py). One regeneration at a time; it starts
only while the whole worker is idle (its `depth` says 1 otherwise, so the verifier's deferral after
MAX_DEFER_S never starts one beside foreground work), and foreground work that arrives while it runs (a
generation, a batch of another model) drops it before the next step (Preempted: the check waits, in its
place, for the next idle moment), so a regeneration delays foreground work by at most the step running
when it arrives. Event loop only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from infercache.v1 import infercache_pb2 as pb
from infercache.v1 import worker_pb2


@dataclass
class Regeneration:
    """A check's model input: the request to generate again (stores nothing, joins no flight)."""

    item: worker_pb2.ComputeItem

    def __len__(self) -> int:  # (the verifier groups checks by length)
        return len(self.item.ids) // 4


class RegenerationLane:
    row_s = 1.0     # each regeneration adds to a step's time: the verifier sends one at a time
    max_batch = 1
    max_queue = 2   # the verifier's share of it is one

    def __init__(self, generations, embed) -> None:
        """generations: the worker's Generations; embed(text) -> the embedder's unit embedding (a coroutine)."""
        self.generations = generations
        self.embed = embed
        self.labels: list[str] = []  # (no classes: a check says itself whether it agrees)

    @property
    def batcher(self) -> "RegenerationLane":
        """A check's `runtime.batcher`: the lane is both."""
        return self

    @property
    def depth(self) -> int:
        """1 while any model of the worker has work: no room for a regeneration."""
        generations = self.generations
        return int(generations.busy() or not all(s.idle for s in generations.schedulers()))

    @property
    def idle(self) -> bool:
        return self.depth == 0

    async def wait_idle(self) -> None:
        for scheduler in self.generations.schedulers():
            await scheduler.wait_idle()

    def group_of(self, length: int) -> int:
        return 0

    def enqueue(self, regeneration: Regeneration, deadline: float | None, waits: bool = True):
        """The regenerated answer's embedding, as {"embedding": ...} (a future, as a batcher's)."""
        return self.generations.background(self._run(regeneration.item))

    async def _run(self, item: worker_pb2.ComputeItem) -> dict[str, np.ndarray]:
        answer = await self.generations.regenerate(item)
        return {"embedding": await self.embed(pb.GenerateResponse.FromString(answer).text)}
