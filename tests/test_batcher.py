"""The dynamic batcher driving the real ONNX Runtime engine of the default model."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from server.shared.admission import ADMIT_HEADROOM
from server.shared.admission import length_groups
from server.worker.batcher import Batcher
from server.engines.onnxruntime import OrtEngine
from server.shared.errors import DeadlineExceeded, Overloaded
from server.shared.tokenization import TextEncoder, pad_batch
from tests.conftest import MODEL_VERSION_DIR

BUCKETS = (16, 32, 64, 128, 256)


@pytest.fixture(scope="module")
def model():
    encoder = TextEncoder(MODEL_VERSION_DIR / "tokenizer.json", 256)
    engine = OrtEngine(MODEL_VERSION_DIR / "model.onnx", threads=2)
    return encoder, engine


class RecordingEngine:
    """The real engine, plus a record of every batch it ran and a gate to hold it busy."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.batches: list[list[list[int]]] = []
        self.gate = threading.Event()
        self.gate.set()

    def __call__(self, sequences):
        self.gate.wait(30)
        self.batches.append(sequences)
        out = self.engine.run(pad_batch(sequences, max(len(s) for s in sequences)))["embedding"]
        return list(out)


def texts_of_many_lengths(n: int) -> list[str]:
    return [" ".join(["refund"] * (1 + (i * 7) % 90)) + f" request {i}" for i in range(n)]


def test_batched_results_equal_unbatched_and_batches_stay_in_one_bucket(model):
    encoder, engine = model
    texts = texts_of_many_lengths(64)
    ids = [encoder.encode(t) for t in texts]
    alone = [engine.run(pad_batch([s], len(s)))["embedding"][0] for s in ids]
    recorder = RecordingEngine(engine)

    async def run():
        batcher = Batcher(recorder, buckets=BUCKETS, max_batch=8, max_delay_s=0.005, max_queue=1000)
        results = await asyncio.gather(*(batcher.submit(s, None) for s in ids))
        await batcher.close()
        return batcher, results

    batcher, results = asyncio.run(run())
    for got, want in zip(results, alone):
        assert np.dot(got, want) > 0.99999
    assert len(recorder.batches) < len(texts)
    assert sum(len(b) for b in recorder.batches) == len(texts)
    for batch in recorder.batches:
        assert len(batch) <= 8
        assert len({batcher.bucket_of(len(s)) for s in batch}) == 1  # padded only within its bucket
    assert batcher.counters["batched_requests"] == len(texts)


def test_an_any_length_engine_pads_less_by_length_group(model):
    """ONNX Runtime pads a batch to its longest row: its batches are cut by length group within the
    buckets (fewer padded tokens than by bucket), with the same results, and timings still per bucket."""
    encoder, engine = model
    assert engine.any_length
    groups = length_groups(BUCKETS)
    assert set(BUCKETS) <= set(groups) and groups[0] == 8 and groups[-1] == BUCKETS[-1]
    assert all(b - a <= max(2, a // 4) for a, b in zip(groups, groups[1:]))  # under a quarter of a length
    texts = texts_of_many_lengths(96)
    ids = [encoder.encode(t) for t in texts]
    alone = [engine.run(pad_batch([s], len(s)))["embedding"][0] for s in ids]

    def padded_tokens(batches) -> int:
        return sum(len(b) * max(len(s) for s in b) - sum(len(s) for s in b) for b in batches)

    async def run(by_group: bool):
        recorder = RecordingEngine(engine)
        batcher = Batcher(recorder, buckets=BUCKETS, max_batch=16, max_delay_s=0.0, max_queue=1000,
                          groups=groups if by_group else None)
        futures = [batcher.enqueue(s, None) for s in ids]  # all queued before the first cut, either way
        results = await asyncio.gather(*futures)
        await batcher.close()
        return batcher, recorder.batches, results

    batcher, batches, results = asyncio.run(run(by_group=True))
    _, by_bucket, _ = asyncio.run(run(by_group=False))
    for got, want in zip(results, alone):
        assert np.dot(got, want) > 0.99999
    for batch in batches:
        assert len({batcher.group_of(len(s)) for s in batch}) == 1
    assert sum(len(b) for b in batches) == len(texts)
    assert padded_tokens(batches) < padded_tokens(by_bucket) / 2
    assert set(batcher.text_s) <= set(BUCKETS)  # what a hit saves, per bucket (metrics)
    assert set(batcher.text_s) == {batcher.bucket_of(len(s)) for s in ids}


def test_admission_counts_a_batch_per_length_group(model):
    """Rows of three length groups queue as three batches, not one: the wait a new request is told
    counts them (and a request of a group with room joins its batch), and the queue's row counts stay
    whole after a cut."""
    encoder, engine = model
    recorder = RecordingEngine(engine)
    recorder.gate.clear()
    texts = ("a b", "a b c d e f g h i", "a b c d e f g h i j k l")  # 4, 11 and 14 tokens: one bucket, 3 groups

    async def run(groups):
        batcher = Batcher(recorder, buckets=BUCKETS, max_batch=8, max_delay_s=0.0, max_queue=100, groups=groups)
        batcher.seed_timing(1.0)  # a batch takes 1 s (no row model): the held batch's age stays under it
        held = batcher.enqueue(encoder.encode("the engine is busy with this one"), None)
        while not batcher._running:
            await asyncio.sleep(0.001)
        queued = [batcher.enqueue(encoder.encode(text), None) for text in texts]
        await asyncio.sleep(0)
        told = (batcher.expected_wait(), batcher.expected_wait(group=batcher.group_of(4)),
                batcher.expected_wait(group=batcher.group_of(20)))
        recorder.gate.set()
        await asyncio.gather(held, *queued)
        rows = sum(batcher._rows.values())
        await batcher.close()
        recorder.gate.clear()
        return told, rows, {batcher.group_of(len(encoder.encode(t))) for t in texts}

    by_group, rows, groups = asyncio.run(run(length_groups(BUCKETS)))
    assert len(groups) == 3 and rows == 0
    # 3 queued batches; a request joins one with room (any length, or 4 tokens), or starts a 4th (20 tokens)
    assert by_group == pytest.approx((3.0, 3.0, 4.0))
    by_bucket, _, _ = asyncio.run(run(None))
    assert by_bucket == pytest.approx((1.0, 1.0, 2.0))  # one bucket of 16 (the 20 tokens': 32): one batch


def test_full_queue_rejects_at_once(model):
    encoder, engine = model
    recorder = RecordingEngine(engine)
    recorder.gate.clear()

    async def run():
        batcher = Batcher(recorder, buckets=BUCKETS, max_batch=1, max_delay_s=0.0, max_queue=3)
        first = asyncio.ensure_future(batcher.submit(encoder.encode("first"), None))
        while not batcher._running:  # the first request is inside the (held) engine
            await asyncio.sleep(0.001)
        waiting = [asyncio.ensure_future(batcher.submit(encoder.encode(f"w {i}"), None)) for i in range(3)]
        await asyncio.sleep(0.01)
        with pytest.raises(Overloaded, match="full"):
            await batcher.submit(encoder.encode("one too many"), None)
        recorder.gate.set()
        await asyncio.gather(first, *waiting)
        await batcher.close()
        return batcher

    batcher = asyncio.run(run())
    assert batcher.counters["rejected_full"] == 1 and batcher.counters["batched_requests"] == 4


def test_cancelled_and_expired_requests_never_reach_the_engine(model):
    encoder, engine = model
    recorder = RecordingEngine(engine)
    recorder.gate.clear()

    async def run():
        loop = asyncio.get_running_loop()
        batcher = Batcher(recorder, buckets=BUCKETS, max_batch=8, max_delay_s=0.0, max_queue=100)
        busy = asyncio.ensure_future(batcher.submit(encoder.encode("keeps the engine busy"), None))
        while not batcher._running:
            await asyncio.sleep(0.001)
        cancelled = asyncio.ensure_future(batcher.submit(encoder.encode("cancelled"), None))
        # A deadline admission cannot refuse on a busy machine (it keeps a third as headroom over its
        # estimate of a batch), passed while the engine is held.
        expired = asyncio.ensure_future(batcher.submit(encoder.encode("expired"), loop.time() + 0.2))
        kept = asyncio.ensure_future(batcher.submit(encoder.encode("kept"), None))
        await asyncio.sleep(0.3)
        cancelled.cancel()
        recorder.gate.set()
        await asyncio.gather(busy, kept)
        with pytest.raises(DeadlineExceeded):
            await expired
        await batcher.close()
        return batcher

    batcher = asyncio.run(run())
    seen = [s for batch in recorder.batches for s in batch]
    assert encoder.encode("cancelled") not in seen and encoder.encode("expired") not in seen
    assert encoder.encode("kept") in seen
    assert batcher.counters["dropped_cancelled"] == 1 and batcher.counters["dropped_expired"] == 1


def test_engine_matches_sentence_transformers(model, reference_encoder):
    encoder, engine = model
    texts = ["How do I return an item?", "I am still waiting on my card?", "x", " ".join(["long"] * 300)]
    ids = [encoder.encode(t) for t in texts]
    got = engine.run(pad_batch(ids, max(map(len, ids))))["embedding"]
    want = reference_encoder.encode(texts, normalize_embeddings=True)
    cosine = np.sum(got * want, axis=1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert cosine.min() >= 0.999, cosine


def _sleeping(seconds: float):
    def run(sequences):
        time.sleep(seconds)
        return [len(s) for s in sequences]
    return run


def _flood(batcher: Batcher, count: int, deadline: float | None):
    admitted, refused = [], 0
    for i in range(count):
        try:
            admitted.append(batcher.enqueue([101, i, 102], deadline))
        except Overloaded as exc:
            assert "retry later" in str(exc)
            refused += 1
    return admitted, refused


def test_admission_refuses_what_cannot_finish_before_the_deadline():
    async def run():
        loop = asyncio.get_running_loop()
        # Estimated 50 ms per batch of 4 (the real ones take 5 ms): 1 s allows 20 batches, its own included,
        # of which 13 are admitted (batcher.ADMIT_HEADROOM).
        batcher = Batcher(_sleeping(0.005), buckets=(16,), max_batch=4, max_delay_s=0.0, max_queue=10_000)
        batcher.seed_timing(0.05)
        admitted, refused = _flood(batcher, 400, loop.time() + 1.025)
        results = await asyncio.gather(*admitted, return_exceptions=True)
        await batcher.close()
        return admitted, refused, results, batcher

    admitted, refused, results, batcher = asyncio.run(run())
    assert len(admitted) == 52 and refused == 348  # waiting 0..51 admitted, the rest refused at once
    assert all(r == 3 for r in results), [r for r in results if r != 3][:3]  # every admitted one ran in time
    assert batcher.counters["rejected_wait"] == 348 and "dropped_expired" not in batcher.counters
    assert 0.0 < batcher.batch_s < 0.05  # the estimate moved toward the real batches


def test_the_wait_told_to_frontends_is_that_of_the_last_refusal_while_work_remains():
    """The worker keeps its queue under the bound, and once a batch is cut from it its expected wait
    falls back under the bound too: told that alone, a frontend would send the next requests of a burst
    to be refused here. So the frontends are told the last refused request's wait as it drains, at most
    a batch above the queue's own, and nothing once the batcher is idle."""
    async def run():
        loop = asyncio.get_running_loop()
        batcher = Batcher(_sleeping(0.05), buckets=(16,), max_batch=4, max_delay_s=0.0, max_queue=10_000)
        batcher.seed_timing(0.05)
        before = batcher.told_wait()
        admitted, refused = _flood(batcher, 40, loop.time() + 0.5)
        at_refusal, refused_at = batcher.told_wait(), loop.time()
        await asyncio.sleep(0.01)  # the first batch is cut and running
        queued, told, elapsed = batcher.expected_wait(), batcher.told_wait(), loop.time() - refused_at
        await asyncio.gather(*admitted)
        await asyncio.sleep(0.01)
        after = batcher.told_wait()
        await batcher.close()
        return before, refused, at_refusal, queued, told, elapsed, after

    before, refused, at_refusal, queued, told, elapsed, after = asyncio.run(run())
    assert before == 0.0 and refused > 0 and at_refusal * ADMIT_HEADROOM > 0.5  # what the refused would wait
    assert told == pytest.approx(max(queued, min(at_refusal - elapsed, queued + 0.05)), abs=0.002)
    assert told > queued or elapsed > 0.045  # held over the cut (unless the machine slept through a batch)
    assert after == 0.0  # idle: nothing is told, whatever was refused


def test_a_slowdown_refuses_queued_requests_that_can_no_longer_finish_in_time():
    """Seeded at 5 ms per batch, the engine takes 50: everything was admitted (100 batches x 5 ms fit in
    the 1 s deadline), and once the first batch shows the real duration, the requests that cannot finish
    by their deadline any more are refused at once instead of expiring in the queue."""
    async def run():
        loop = asyncio.get_running_loop()
        batcher = Batcher(_sleeping(0.05), buckets=(16,), max_batch=4, max_delay_s=0.0, max_queue=10_000)
        batcher.seed_timing(0.005)
        admitted, refused = _flood(batcher, 400, loop.time() + 1.0)
        started = loop.time()
        outcomes = await asyncio.gather(*(_timed(f, loop) for f in admitted))
        await batcher.close()
        return refused, outcomes, started, batcher

    refused, outcomes, started, batcher = asyncio.run(run())
    assert refused == 0
    ran = [at for outcome, at in outcomes if outcome == 3]
    shed = [at for outcome, at in outcomes if isinstance(outcome, Overloaded)]
    assert len(ran) + len(shed) == 400, {type(o) for o, _ in outcomes}  # no DeadlineExceeded
    # About 80 fit at 50 ms a batch of 4; fewer where the machine is busy (batches then take longer, and
    # the batcher sheds what its measured pace cannot finish: 56 in one CI run).
    assert 20 <= len(ran) < 90 and batcher.counters["shed"] == len(shed)
    assert max(shed) - started < 0.2  # refused when the first batch ended, not at the deadline
    assert "dropped_expired" not in batcher.counters


def test_the_row_model_refuses_at_once_what_a_one_row_estimate_would_admit_and_then_shed():
    """An engine whose batches take 5 ms + 10 ms a row (a CPU): one row's time (15 ms) would admit most
    of 400 requests against a 1 s deadline and shed most of them once the first batch ran. Seeded with
    what four rows take too, the batcher refuses at once what cannot finish, and sheds next to nothing."""
    def linear(sequences):
        time.sleep(0.005 + 0.010 * len(sequences))
        return [len(s) for s in sequences]

    async def run(seeded_rows: bool):
        loop = asyncio.get_running_loop()
        batcher = Batcher(linear, buckets=(16,), max_batch=8, max_delay_s=0.0, max_queue=10_000)
        started = time.perf_counter()  # timed as the worker's warmup does: one row, then four
        linear([[1]])
        one = time.perf_counter() - started
        started = time.perf_counter()
        linear([[1]] * 4)
        batcher.seed_timing(one, time.perf_counter() - started if seeded_rows else None, 4)
        admitted, refused = _flood(batcher, 400, loop.time() + 1.0)
        outcomes = await asyncio.gather(*(_timed(f, loop) for f in admitted))
        await batcher.close()
        return refused, [o for o, _ in outcomes], batcher.counters

    refused, outcomes, counters = asyncio.run(run(seeded_rows=True))
    ran = [o for o in outcomes if o == 3]  # (a few at the edge may be shed: the timing is real, so noisy)
    assert 250 <= refused <= 340 and len(ran) >= len(outcomes) - 8, (refused, outcomes[-3:])
    assert counters["shed"] == len(outcomes) - len(ran) and "dropped_expired" not in counters
    refused, outcomes, counters = asyncio.run(run(seeded_rows=False))  # the one-row estimate, for contrast
    assert refused < 100 and counters["shed"] > 200, (refused, counters["shed"])


async def _timed(future, loop):
    try:
        outcome = await future
    except Exception as exc:
        outcome = exc
    return outcome, loop.time()


def test_admission_bound_without_deadline_and_without_an_estimate():
    async def run():
        bounded = Batcher(_sleeping(0.001), buckets=(16,), max_batch=4, max_delay_s=0.0, max_queue=10_000,
                          max_wait_s=0.52)
        bounded.seed_timing(0.05)
        first = _flood(bounded, 100, None)  # 0.52 s less headroom: 6 batches, its own included = 23 waiting
        untimed = Batcher(_sleeping(0.001), buckets=(16,), max_batch=4, max_delay_s=0.0, max_queue=10_000)
        second = _flood(untimed, 100, None)  # no estimate yet: only max_queue bounds admission
        for batcher, (admitted, _) in ((bounded, first), (untimed, second)):
            await asyncio.gather(*admitted)
            await batcher.close()
        return first, second

    (admitted, refused), (admitted_untimed, refused_untimed) = asyncio.run(run())
    assert (len(admitted), refused) == (24, 76)
    assert (len(admitted_untimed), refused_untimed) == (100, 0)


def test_a_bucket_emptied_by_shedding_while_waiting_for_the_engine_does_not_stop_the_batcher():
    """The owner task waits for a free engine slot with a bucket due; meanwhile the running batch's
    slowness sheds every request of that bucket. With the slot, nothing is due: the batcher must go
    on waiting for work (it once cut the bucket None and its task died, silently: every later request
    queued forever, the queue filled, and the worker refused all misses until restarted)."""
    async def run():
        loop = asyncio.get_running_loop()
        batcher = Batcher(_sleeping(0.3), buckets=(16,), max_batch=4, max_delay_s=0.0, max_queue=100)
        batcher.seed_timing(0.005)
        first = batcher.enqueue([101, 1, 102], None)  # holds the only slot for 0.3 s
        await asyncio.sleep(0.01)
        doomed = [batcher.enqueue([101, i, 102], loop.time() + 0.2) for i in range(4)]
        outcomes = await asyncio.gather(first, *doomed, return_exceptions=True)
        later = await asyncio.wait_for(batcher.enqueue([101, 9, 102], None), 5)
        await batcher.close()
        return outcomes, later, batcher

    outcomes, later, batcher = asyncio.run(run())
    assert outcomes[0] == 3 and all(isinstance(o, Overloaded) for o in outcomes[1:]), outcomes
    assert batcher.counters["shed"] == 4
    assert later == 3
