"""The generation scheduler (server/worker/generation/scheduler.py) without a model: the real Generations and
schedulers over the fake decoder (server/engines/fake_decoder.py), whose tokens hash everything its slot holds
and which refuses any step that breaks the decoder interface. Continuous batching, the prefill budget,
cancellation, deadlines, slot reuse, pipelining and coalescing, each in a fraction of a second."""

from __future__ import annotations

import asyncio

import pytest

from infercache.v1 import infercache_pb2 as pb
from server.shared.errors import DeadlineExceeded, Overloaded
from tests.fake_generation import FakeWorker, Sink, prompt

CONFIG = """
generate: {context_length: 256, max_new_tokens: 64, max_streams: 4, max_waiting: 8, prefill_tokens: 16}
prefix_cache: {enabled: false}
"""
ONE_SEAT = CONFIG.replace("max_streams: 4, max_waiting: 8", "max_streams: 1, max_waiting: 1")
TWO_SEATS = CONFIG.replace("max_streams: 4", "max_streams: 2")
STOP = pb.GenerationEnd.STOP


def _run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 60))


def _slots(step) -> set[int]:
    return {c.slot for c in step.chunks} | {r.slot for r in step.rows}


def test_generations_that_join_a_running_batch_answer_as_each_alone(tmp_path):
    async def scenario():
        async with FakeWorker(tmp_path, {"m": CONFIG}) as worker:
            decoder = worker.decoder("m")
            prompts = [prompt(1, 7), prompt(2, 12), prompt(3, 5)]
            decoder.pause()
            decoder.allow(4)  # the first reads its prompt and answers four tokens alone
            first = worker.submit("m", prompts[0], max_new_tokens=20)
            await worker.until(lambda: len(worker.sink.streamed(first)) == 4, "four steps of the first generation")
            others = [worker.submit("m", p, max_new_tokens=10) for p in prompts[1:]]
            decoder.resume()
            answers = [await worker.sink.answer(i) for i in (first, *others)]
            return decoder, answers, worker.counters

    decoder, answers, counters = _run(scenario())
    expected = [decoder.answer(prompt(1, 7), 20), decoder.answer(prompt(2, 12), 10), decoder.answer(prompt(3, 5), 10)]
    assert [list(answer.token_ids) for _, answer in answers] == expected
    assert [source for source, _ in answers] == ["MISS"] * 3
    assert all(a.end.finish_reason == a.end.LENGTH for _, a in answers)
    joined = next(step for step in decoder.steps[1:] if step.chunks)  # the newcomers' prompts, read beside
    assert {c.slot for c in joined.chunks} == {1, 2} and {r.slot for r in joined.rows} == {0}
    assert any(len({r.slot for r in step.rows}) == 3 for step in decoder.steps)  # all three answer together
    assert counters["generated"] == 3 and counters["tokens_generated"] == 40
    assert sorted(decoder.released) == [0, 1, 2]


def test_a_long_prompt_is_read_within_the_prefill_budget_while_running_streams_go_on(tmp_path):
    async def scenario():
        async with FakeWorker(tmp_path, {"m": CONFIG}) as worker:
            decoder = worker.decoder("m")
            decoder.pause()
            decoder.allow(2)
            running = worker.submit("m", prompt(4, 10), max_new_tokens=30)
            await worker.until(lambda: len(decoder.steps) == 2, "the first two steps")
            long = worker.submit("m", prompt(5, 40), max_new_tokens=5)
            decoder.resume()
            answers = [await worker.sink.answer(i) for i in (running, long)]
            return decoder, answers

    decoder, answers = _run(scenario())
    assert [list(a.token_ids) for _, a in answers] == [decoder.answer(prompt(4, 10), 30), decoder.answer(prompt(5, 40), 5)]
    assert all(sum(len(c.ids) for c in step.chunks) <= 16 for step in decoder.steps)  # generate.prefill_tokens
    reading = [step for step in decoder.steps if any(c.slot == 1 for c in step.chunks)]
    assert [[len(c.ids) for c in step.chunks] for step in reading] == [[16], [16], [8]]
    assert [c.start for step in reading for c in step.chunks] == [0, 16, 32]
    assert all([r.slot for r in step.rows] == [0] for step in reading)  # the running stream has a row in each


def test_a_generation_all_its_callers_left_is_dropped_and_one_a_caller_still_waits_for_goes_on(tmp_path):
    async def scenario():
        async with FakeWorker(tmp_path, {"m": CONFIG}) as worker:
            decoder, scheduler = worker.decoder("m"), worker.scheduler("m")
            other = Sink()
            decoder.pause()
            decoder.allow(3)
            alone = worker.submit("m", prompt(6, 6), max_new_tokens=50)
            shared = worker.submit("m", prompt(7, 6), max_new_tokens=12)
            joiner = worker.submit("m", prompt(7, 6), max_new_tokens=12, sink=other)
            await worker.until(lambda: len(decoder.steps) == 3, "three steps")
            worker.cancel(alone)
            worker.cancel(shared)
            decoder.resume()
            source, answer = await other.answer(joiner)
            await worker.until(lambda: scheduler.idle and len(decoder.released) == 2, "both slots released")
            again = worker.submit("m", prompt(6, 6), max_new_tokens=50)  # a new flight: the dropped one is gone
            await worker.sink.answer(again)
            return decoder, worker, source, answer, alone, shared

    decoder, worker, source, answer, alone, shared = _run(scenario())
    assert source == "COALESCED" and list(answer.token_ids) == decoder.answer(prompt(7, 6), 12)
    assert alone not in worker.sink.ends and shared not in worker.sink.ends  # who left hears nothing
    rows_of_alone = sum(r.slot == 0 for step in decoder.steps[:8] for r in step.rows)
    assert rows_of_alone < 10  # dropped at the next steps, not run to its 50 tokens
    assert worker.counters["generate_cancelled"] == 1 and worker.counters["generated"] == 2


def test_a_passed_deadline_fails_its_generation_waiting_or_running_and_frees_its_slot(tmp_path):
    async def scenario():
        async with FakeWorker(tmp_path, {"m": CONFIG}) as worker:
            decoder, loop = worker.decoder("m"), asyncio.get_running_loop()
            decoder.pause()
            decoder.allow(3)
            running = worker.submit("m", prompt(8, 6), max_new_tokens=40)
            other = worker.submit("m", prompt(9, 6), max_new_tokens=20)
            await worker.until(lambda: len(decoder.steps) == 3, "three steps")
            worker.sink.waiting[running].deadline = loop.time()  # its deadline passes while it answers
            late = worker.submit("m", prompt(10, 6), deadline=loop.time() - 1)  # passed before it is seated
            decoder.resume()
            outcomes = await asyncio.gather(*(worker.sink.answer(i) for i in (running, late, other)),
                                            return_exceptions=True)
            await worker.until(lambda: len(decoder.released) == 2, "both slots released")
            return decoder, outcomes

    decoder, (running, late, other) = _run(scenario())
    assert isinstance(running, DeadlineExceeded) and isinstance(late, DeadlineExceeded)
    assert list(other[1].token_ids) == decoder.answer(prompt(9, 6), 20)
    assert all(2 not in _slots(step) for step in decoder.steps)  # `late` was never seated
    assert sorted(decoder.released) == [0, 1]


def test_slots_are_reused_as_generations_end_and_a_full_queue_is_refused(tmp_path):
    async def scenario():
        async with FakeWorker(tmp_path, {"m": TWO_SEATS, "one": ONE_SEAT}) as worker:
            items = [worker.submit("m", prompt(20 + n, 3 + n), max_new_tokens=4 + 2 * n) for n in range(6)]
            answers = [await worker.sink.answer(i) for i in items]
            one = worker.decoder("one")
            one.pause()
            seated = worker.submit("one", prompt(30, 5))
            await worker.until(lambda: worker.scheduler("one").running, "the first seated")
            queued = worker.submit("one", prompt(31, 5))
            with pytest.raises(Overloaded, match="generate.max_waiting"):
                worker.submit("one", prompt(32, 5))
            one.resume()
            await worker.sink.answer(seated)
            await worker.sink.answer(queued)
            return worker.decoder("m"), answers

    decoder, answers = _run(scenario())
    assert [list(a.token_ids) for _, a in answers] == [decoder.answer(prompt(20 + n, 3 + n), 4 + 2 * n)
                                                       for n in range(6)]
    assert set().union(*(_slots(step) for step in decoder.steps)) == {0, 1}  # two seats, six generations
    assert len(decoder.released) == 6 and all(len(_slots(step)) <= 2 for step in decoder.steps)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded-sample"])
def test_a_pipelined_decoder_gives_the_answers_a_step_by_step_one_gives(tmp_path, sampled):
    """Step n+1 is launched before step n is read: greedy rows take the decoder's own last token, a
    sampled generation waits for the token it chose; a generation that ended computed one token more."""
    async def answers(pipelined: bool, root):
        async with FakeWorker(root, {"m": CONFIG}, pipelined=pipelined, ends=True) as worker:
            options = {"temperature": 0.8, "seed": 11} if sampled else {}
            items = [worker.submit("m", prompt(40 + n, 4 + 5 * n), max_new_tokens=6 + 4 * n, **options)
                     for n in range(4)]
            got = [await worker.sink.answer(i) for i in items]
            return [(list(a.token_ids), a.end.finish_reason) for _, a in got], worker.decoder("m")

    plain, stepwise = _run(answers(False, tmp_path / "plain"))
    piped, pipelined = _run(answers(True, tmp_path / "piped"))
    assert piped == plain and len({tuple(ids) for ids, _ in plain}) == 4
    if not sampled:
        assert plain == [(stepwise.answer(prompt(40 + n, 4 + 5 * n), 6 + 4 * n)[:len(ids)], reason)
                         for n, (ids, reason) in enumerate(plain)]
        assert any(reason == STOP for _, reason in plain)  # an end token, before max_new_tokens:
        assert pipelined.counters()["rows"] > stepwise.counters()["rows"]  # the unused token after it


def test_identical_generations_compute_once_and_a_late_joiner_gets_the_answer_so_far_then_the_rest(tmp_path):
    async def scenario():
        async with FakeWorker(tmp_path, {"m": CONFIG}) as worker:
            decoder = worker.decoder("m")
            late = Sink()
            decoder.pause()
            decoder.allow(4)
            first = worker.submit("m", prompt(50, 8), max_new_tokens=16)
            await worker.until(lambda: len(worker.sink.streamed(first)) == 4, "four tokens sent")
            joiner = worker.submit("m", prompt(50, 8), max_new_tokens=16, sink=late)
            assert late.streamed(joiner) == worker.sink.streamed(first)  # the answer so far, at once
            decoder.resume()
            return (await worker.sink.answer(first), await late.answer(joiner), late.streamed(joiner), decoder,
                    worker.counters)

    (source, answer), (joined_source, joined), streamed, decoder, counters = _run(scenario())
    assert (source, joined_source) == ("MISS", "COALESCED")
    assert list(answer.token_ids) == list(joined.token_ids) == streamed == decoder.answer(prompt(50, 8), 16)
    assert sum(len(c.ids) for step in decoder.steps for c in step.chunks) == 8  # its prompt read once
    assert counters["generated"] == 1 and counters["generate_coalesced"] == 1
