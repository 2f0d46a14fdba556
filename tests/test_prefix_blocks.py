"""The prefix cache (server/worker/prefix/prefix_cache.py) without a model: its keys, and blocks kept, reused,
demoted and evicted through memory, host memory and a real block store on disk, under the real scheduler
over the fake decoder (server/engines/fake_decoder.py). The fake's tokens hash everything its slot
holds, so an answer that reused blocks equals the one computed from scratch only if every restored block
held what it stands for."""

from __future__ import annotations

import asyncio
from collections import Counter

from cachestore.env import StoreSettings
from cachestore.keys import NS_ID_BYTES, namespace
from server.worker.generation.request import Generation
from server.worker.prefix.prefix_disk import BlockStore
from tests.fake_generation import FakeWorker, prompt

BLOCK = 4
CONFIG = f"""
generate: {{context_length: 512, max_new_tokens: 32, max_streams: 4, prefill_tokens: 64}}
prefix_cache: {{block_tokens: {BLOCK}}}
"""


def _reused(worker: FakeWorker, model: str = "m") -> Counter:
    """Prompt tokens reused so far, by tier."""
    counters = worker.runtime(model).prefix.counters
    return Counter({tier: counters[f"prefix_tokens_{tier}"] for tier in ("memory", "host", "disk")})


def test_a_blocks_key_chains_every_block_before_it_in_its_tenants_namespace(tmp_path):
    async def scenario():
        async with FakeWorker(tmp_path, {"m": CONFIG}) as worker:
            runtime = worker.runtime("m")

            def keys(tokens: list[int], tenant: str = "", public: int = 0) -> list[bytes]:
                generation = Generation(worker.item("m", tokens, tenant=tenant, public_prefix=public), runtime, None)
                return runtime.prefix.keys(generation, tokens, len(tokens) // BLOCK)

            base = prompt(1, 16)
            first = base[:]
            first[0] = base[0] % 63 + 1  # another first token
            third = base[:]
            third[9] = base[9] % 63 + 1  # another token in the third block
            return (keys(base), keys(list(base)), keys(first), keys(third), keys(base, tenant="a"),
                    keys(base, tenant="a", public=8), keys(base, tenant="b", public=8))

    base, again, first, third, tenant_a, public_a, public_b = asyncio.run(scenario())
    assert base == again and len(set(base)) == 4
    assert all(a != b for a, b in zip(base, first))       # a block's key follows every block before it
    assert third[:2] == base[:2] and all(a != b for a, b in zip(base[2:], third[2:]))
    assert not set(tenant_a) & set(base)                  # tenants never share a key
    assert public_a[:2] == public_b[:2]                   # a public system prompt's blocks: every tenant's,
    assert not set(public_a[:2]) & set(base)              # and no tenant's own, not even the tenant ""'s
    assert not set(public_b[2:]) & set(public_a[2:])      # past it, each tenant's own
    # Invalidate finds them by the store's namespace id (public blocks: the tenant "")
    assert {k[:NS_ID_BYTES] for k in tenant_a + public_a[2:]} == {namespace("a", "m", "1").ns_id}
    assert {k[:NS_ID_BYTES] for k in base + public_a[:2]} == {namespace("", "m", "1").ns_id}


def test_a_prompt_reuses_earlier_prompts_and_answers_and_answers_as_computed_from_scratch(tmp_path):
    async def scenario():
        async with FakeWorker(tmp_path, {"m": CONFIG}) as worker:
            one = prompt(2, 30)
            two = one[:20] + prompt(3, 10)  # shares five blocks with `one`
            first = await worker.ask("m", one, store=False, cached_ok=False)
            after_one = _reused(worker)
            turn = one + list(first.token_ids) + prompt(4, 6)  # the conversation's next turn
            second = await worker.ask("m", turn, store=False, cached_ok=False)
            after_turn = _reused(worker)
            third = await worker.ask("m", two, store=False, cached_ok=False)
            decoder = worker.decoder("m")
            return decoder, (one, turn, two), (first, second, third), (after_one, after_turn, _reused(worker))

    decoder, prompts, answers, reused = asyncio.run(scenario())
    assert [list(a.token_ids) for a in answers] == [decoder.answer(p, 8) for p in prompts]
    # the turn: 9 blocks of the first prompt and its answer (all but the last token computed); then 5
    assert [r["memory"] for r in reused] == [0, 36, 36 + 20]
    read = sum(len(c.ids) for step in decoder.steps for c in step.chunks)
    assert read == 30 + (44 - 36) + (30 - 20)  # only what was not reused is read


def test_tenants_reuse_only_their_own_blocks_but_share_a_public_system_prompts(tmp_path):
    async def scenario():
        async with FakeWorker(tmp_path, {"m": CONFIG}) as worker:
            question = prompt(5, 30)
            steps = []
            for tenant, public in (("a", 8), ("b", 8), ("b", 8), ("c", 0)):
                before = _reused(worker)["memory"]
                answer = await worker.ask("m", question, tenant=tenant, public_prefix=public, store=False,
                                          cached_ok=False)
                steps.append((list(answer.token_ids), _reused(worker)["memory"] - before))
            return worker.decoder("m"), question, steps

    decoder, question, steps = asyncio.run(scenario())
    assert all(ids == decoder.answer(question, 8) for ids, _ in steps)
    # a: nothing yet; b: the public blocks of a's prompt; b again: its own; c (no public part): nothing of a's
    assert [reused for _, reused in steps] == [0, 8, 28, 0]


def test_blocks_are_demoted_to_host_memory_then_disk_within_each_tiers_cap_and_reused_from_there(tmp_path):
    disk = BlockStore(StoreSettings(tmp_path / "kv", 64 << 20, 48 << 20, sync=False), ttl_s=600, queue_bytes=1 << 20)

    async def scenario():
        async with FakeWorker(tmp_path, {"m": CONFIG}, token_bytes=64, memory_blocks=2, host_blocks=2,
                              disk=disk) as worker:
            prefix = worker.runtime("m").prefix
            prompts = [prompt(10 + n, 17) for n in range(3)]
            held = []
            for each in prompts:  # each keeps 4 prompt blocks: the earlier ones move down a tier
                await worker.ask("m", each, max_new_tokens=4, store=False, cached_ok=False)
                held.append((len(prefix.memory), len(prefix.host)))
            await worker.until(lambda: not prefix.writing, "the demoted blocks written to disk")
            before = _reused(worker)
            again = await worker.ask("m", prompts[0], max_new_tokens=4, store=False, cached_ok=False)
            return worker.decoder("m"), prefix, prompts, held, _reused(worker) - before, again, dict(prefix.counters)

    decoder, prefix, prompts, held, reused, again, counters = asyncio.run(scenario())
    disk.close()
    assert (prefix.capacity, prefix.host_capacity) == (2, 2)
    assert held == [(2, 2)] * 3  # each tier full, none past its cap
    assert reused == Counter(disk=16)  # all four blocks of the first prompt, read back from disk
    assert list(again.token_ids) == decoder.answer(prompts[0], 4)
    assert counters["prefix_demoted_host"] > 0 and counters["prefix_evicted_host"] > 0
    assert counters["prefix_demoted_disk"] == counters["prefix_evicted_host"] and counters["prefix_disk_reads"] == 4
    assert disk.counters["written"] >= 4
