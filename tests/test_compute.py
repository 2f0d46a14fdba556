"""The worker core (server/worker/core.py) without processes: coalescing and cancellation on one event loop."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from infercache.v1 import infercache_pb2 as pb
from infercache.v1 import worker_pb2
from server.worker.core import WorkerCore
from server.config import Config
from server.engines.artifacts import LoadedEngine
from server.engines.null import NullEngine
from server.worker.model_runtime import ModelRuntime
from server.shared.models import ModelRepository
from tests.conftest import MINILM_CONFIG, MODEL_VERSION_DIR
from harness.servers import link_model


class Answers:
    """A connection as the core sees it: what it was answered, by item id."""

    def __init__(self) -> None:
        self.waiting: dict = {}
        self.answers: dict[int, tuple[int, bytes | BaseException]] = {}

    def ok(self, item_id: int, source: int, payload: bytes, rejected: bool = False) -> None:
        self.answers[item_id] = (source, payload)

    def fail(self, item_id: int, exc: BaseException) -> None:
        self.answers[item_id] = (-1, exc)


def _item(item_id: int, key: bytes) -> worker_pb2.ComputeItem:
    ids = np.array([101, 7592, 102], dtype="<i4").tobytes()
    return worker_pb2.ComputeItem(id=item_id, model="minilm", version="1", key=key, ids=ids, store=False,
                                  cached_ok=False)


async def _answered(answers: Answers, count: int) -> None:
    """Waits (up to 2 s) until `count` items are answered."""
    for _ in range(200):
        if len(answers.answers) >= count:
            return
        await asyncio.sleep(0.01)


async def _core(models) -> WorkerCore:
    repository = ModelRepository(models)
    spec = repository.get("minilm")
    runtime = ModelRuntime(spec, "1", LoadedEngine(NullEngine({"embedding": 384}), "null", "none", "cpu"), Config())
    return WorkerCore(repository, {("minilm", "1"): runtime}, writer=None)


def test_an_item_arriving_just_after_its_twin_was_cancelled_is_still_answered(tmp_path):
    link_model(tmp_path, "minilm", MINILM_CONFIG, {"1": MODEL_VERSION_DIR})

    async def scenario() -> Answers:
        core = await _core(tmp_path)
        first, second = Answers(), Answers()
        key = bytes(24)
        core.submit(first, _item(1, key), None)
        core.cancel(first, 1)                      # its caller went away ...
        core.submit(second, _item(2, key), None)   # ... and the same text arrives in the same iteration
        await _answered(second, 1)
        await core.close()
        return second

    second = asyncio.run(scenario())
    source, payload = second.answers[2]
    assert source == pb.CacheInfo.MISS, payload
    assert pb.InferResponse.FromString(payload).outputs[0].shape == [384]


def test_identical_items_in_one_frame_are_computed_once(tmp_path):
    link_model(tmp_path, "minilm", MINILM_CONFIG, {"1": MODEL_VERSION_DIR})

    async def scenario() -> tuple[Answers, WorkerCore]:
        core = await _core(tmp_path)
        answers = Answers()
        core.submit_all(answers, [_item(i, b"k" * 24) for i in range(5)], asyncio.get_running_loop().time())
        await _answered(answers, 5)
        await core.close()
        return answers, core

    answers, core = asyncio.run(scenario())
    sources = sorted(source for source, _ in answers.answers.values())
    assert sources == [pb.CacheInfo.MISS] + [pb.CacheInfo.COALESCED] * 4
    assert core.counters["computed"] == 1 and core.counters["coalesced"] == 4
    assert len({payload for _, payload in answers.answers.values()}) == 1


def _follow_up(kind: str, key: bytes) -> worker_pb2.ComputeItem:
    item = _item(2, key)
    item.cached_ok = kind != "bypass"
    if kind == "too_old":
        item.max_age_us = 0
    return item


@pytest.mark.parametrize("kind, expected", [("bypass", pb.CacheInfo.MISS), ("too_old", pb.CacheInfo.MISS),
                                            ("default", pb.CacheInfo.COALESCED)])
def test_an_item_arriving_as_its_twin_is_answered_is_computed_again_unless_a_stored_answer_would_do(
        tmp_path, kind, expected):
    """The moment a flight is answered its entry is not committed yet, and the flight stands for it (the
    CI caught a BYPASS call labelled COALESCED this way): a BYPASS item, or one that the answer is already
    too old for, computes anew; a DEFAULT item takes the answer."""
    link_model(tmp_path, "minilm", MINILM_CONFIG, {"1": MODEL_VERSION_DIR})
    key = b"t" * 24

    class FollowedAtOnce(Answers):
        """Its caller sends the same text again as the answer arrives."""

        def __init__(self, core: WorkerCore, later: Answers) -> None:
            super().__init__()
            self.core, self.later = core, later

        def ok(self, item_id, source, payload, rejected=False):
            super().ok(item_id, source, payload, rejected)
            self.core.submit(self.later, _follow_up(kind, key), None)

    async def scenario() -> tuple[Answers, Answers, WorkerCore]:
        core = await _core(tmp_path)
        later = Answers()
        first = FollowedAtOnce(core, later)
        core.submit(first, _item(1, key), None)
        await _answered(later, 1)
        await core.close()
        return first, later, core

    first, later, core = asyncio.run(scenario())
    assert first.answers[1][0] == pb.CacheInfo.MISS
    assert later.answers[2][0] == expected
    assert core.counters["computed"] == (2 if expected == pb.CacheInfo.MISS else 1)


@pytest.mark.parametrize("kind, expected", [("bypass", pb.CacheInfo.MISS), ("too_old", pb.CacheInfo.MISS),
                                            ("default", pb.CacheInfo.COALESCED)])
def test_a_stricter_item_does_not_join_a_running_flight_that_may_end_in_an_older_answer(tmp_path, kind, expected):
    """A running flight started by a DEFAULT item may end in a stored answer (a near-duplicate's, the
    fleet's): a BYPASS item, or one with a max_age the first did not ask for, computes on its own."""
    link_model(tmp_path, "minilm", MINILM_CONFIG, {"1": MODEL_VERSION_DIR})
    key = b"r" * 24
    first = _item(1, key)
    first.cached_ok = True

    async def scenario() -> tuple[Answers, WorkerCore]:
        core = await _core(tmp_path)
        answers = Answers()
        core.submit(answers, first, None)
        core.submit(answers, _follow_up(kind, key), None)  # while the first is still running
        await _answered(answers, 2)
        await core.close()
        return answers, core

    answers, core = asyncio.run(scenario())
    assert answers.answers[1][0] == pb.CacheInfo.MISS and answers.answers[2][0] == expected
    assert core.counters["computed"] == (2 if expected == pb.CacheInfo.MISS else 1)


def test_a_model_runtime_cuts_by_length_group_where_its_engine_takes_any_length(tmp_path):
    """ONNX Runtime pads to a batch's longest row: finer groups than the profiles (unless
    server.length_groups is off); the null engine (as a profile-padded engine would) keeps the buckets."""
    import dataclasses

    from server.shared.admission import length_groups
    from server.engines.onnxruntime import OrtEngine

    link_model(tmp_path, "minilm", MINILM_CONFIG, {"1": MODEL_VERSION_DIR})
    off = Config()
    off = dataclasses.replace(off, server=dataclasses.replace(off.server, length_groups=False))

    async def groups() -> tuple[tuple, ...]:
        spec = ModelRepository(tmp_path).get("minilm")
        ort_engine = LoadedEngine(OrtEngine(MODEL_VERSION_DIR / "model.onnx", threads=1), "onnxruntime", "fp32", "cpu")
        runtimes = (ModelRuntime(spec, "1", ort_engine, Config()), ModelRuntime(spec, "1", ort_engine, off),
                    ModelRuntime(spec, "1", LoadedEngine(NullEngine({"embedding": 384}), "null", "none", "cpu"), Config()))
        for runtime in runtimes:
            await runtime.batcher.close()
        return (spec.buckets, *(runtime.batcher.groups for runtime in runtimes))

    buckets, ort_groups, ort_off, null_groups = asyncio.run(groups())
    assert ort_groups == length_groups(buckets) and len(ort_groups) > len(buckets)
    assert ort_off == buckets and null_groups == buckets
