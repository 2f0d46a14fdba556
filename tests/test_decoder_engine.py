"""The decoders behind generation, driven step by step as the scheduler drives them: ONNX Runtime and torch
on the CPU with SmolLM2's real weights (the repository's prepared model), and torch on a GPU with random
weights of SmolLM2's shape (skipped without one, saying so).

Continuous batching must not change an answer: sequences that join a running batch at different steps,
read their prompts in chunks beside running ones, and reuse slots others left, answer exactly as each
does alone.
"""

from __future__ import annotations

import pytest

from server.engines.decoding import Chunk, Step, StepRow
from harness.servers import REPO

GEN_VERSION_DIR = REPO / "models" / "smollm2" / "1"
PROMPTS = [  # token ids of several lengths (SmolLM2's vocabulary)
    [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 2, 198, 1, 4093, 198, 1836, 564, 339, 719, 253, 10429, 47, 2,
     198, 1, 520, 9531, 198],
    [1, 4093, 198, 6121, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198],
    [1, 4093, 198] + [4237, 28, 1836, 5213, 314, 260, 1789, 30] * 9 + [2, 198, 1, 520, 9531, 198],
    [1, 4093, 198, 19556, 2, 198, 1, 520, 9531, 198],
]
NEW = 12

needs_model = pytest.mark.skipif(not (GEN_VERSION_DIR / "decoder.safetensors").is_file(),
                                 reason="the generative model is not prepared: run `make model` (make test does)")


def alone(decoder, prompt: list[int], new: int) -> list[int]:
    """Greedy tokens of one sequence in slot 0, its prompt in one chunk."""
    got = decoder.collect(decoder.launch(Step(chunks=[Chunk(0, list(prompt), 0, last=True)]))).tokens
    while len(got) < new:
        got += decoder.collect(decoder.launch(Step(rows=[StepRow(0, len(prompt) + len(got) - 1)]))).tokens
    decoder.release(0)
    return got


def together(decoder, prompts: list[list[int]], new: int, budget: int, joins: list[int]) -> list[list[int]]:
    """Greedy tokens of every prompt, run as the scheduler runs them: prompt i is admitted at step joins[i]
    (or once a slot is free) into the lowest free slot, prompts are read within `budget` tokens a step,
    every answering sequence advances each step, and a finished sequence's slot is released and reused. A
    pipelined decoder gets step n+1 before step n is read."""
    free = list(range(decoder.slots))
    seated: dict[int, dict] = {}   # prompt index -> slot, fed, planned (tokens launched steps give), got
    pending = None
    number = 0
    while len(seated) < len(prompts) or any(s["slot"] is not None for s in seated.values()):
        for i, at in enumerate(joins):
            if at <= number and i not in seated and free:
                seated[i] = {"slot": free.pop(0), "fed": 0, "planned": 0, "got": []}
        step, chunked, rows, left = Step(), [], [], budget
        for i, s in seated.items():
            prompt = prompts[i]
            if s["slot"] is None:
                continue
            if s["fed"] < len(prompt):
                if left > 0:
                    n = min(left, len(prompt) - s["fed"])
                    last = s["fed"] + n == len(prompt)
                    step.chunks.append(Chunk(s["slot"], prompt[s["fed"]:s["fed"] + n], s["fed"], last=last))
                    chunked.append(i if last else None)
                    s["fed"] += n
                    s["planned"] += last
                    left -= n
            elif s["planned"] < new:
                step.rows.append(StepRow(s["slot"], len(prompt) + s["planned"] - 1))
                rows.append(i)
                s["planned"] += 1
        entries = chunked + rows
        handle = decoder.launch(step) if step else None
        number += 1
        if decoder.pipelined:
            done, pending = pending, ((handle, entries) if step else None)
        else:
            done = (handle, entries) if step else None
        if done is not None:
            outcome = decoder.collect(done[0])
            for index, i in enumerate(done[1]):
                if i is not None:
                    seated[i]["got"].append(outcome.tokens[index])
        for s in seated.values():
            if s["slot"] is not None and len(s["got"]) == s["planned"] == new:
                decoder.release(s["slot"])
                free.append(s["slot"])
                free.sort()
                s["slot"] = None
        assert number < 10_000, "no progress"
    return [seated[i]["got"] for i in range(len(prompts))]


@needs_model
@pytest.mark.parametrize("runtime", ["onnxruntime", "torch"])
def test_a_batch_that_changes_every_step_answers_as_each_sequence_alone(runtime):
    decoder = _cpu_decoder(runtime, slots=3)
    expected = [alone(decoder, p, NEW) for p in PROMPTS]
    # Four prompts through three slots: the fourth waits for a slot; prompts read 7 tokens a step.
    got = together(decoder, PROMPTS, NEW, budget=7, joins=[0, 2, 3, 5])
    assert got == expected
    assert len({tuple(a) for a in expected}) == len(PROMPTS)  # the prompts give different answers


@needs_model
def test_torch_and_onnx_runtime_decoders_answer_alike():
    """The same weights through both runtimes (both fp32 on the CPU): the same greedy answers."""
    ort, torch_cpu = _cpu_decoder("onnxruntime", 1), _cpu_decoder("torch", 1)
    for prompt in PROMPTS:
        assert alone(torch_cpu, prompt, NEW) == alone(ort, prompt, NEW)


@needs_model
def test_scores_are_given_where_asked():
    import numpy as np

    decoder = _cpu_decoder("torch", 2)
    outcome = decoder.collect(decoder.launch(Step(chunks=[Chunk(0, PROMPTS[1], 0, last=True, scores=True),
                                                          Chunk(1, PROMPTS[3], 0, last=True)])))
    assert set(outcome.scores) == {0}
    assert outcome.scores[0].shape == (49152,) and int(np.argmax(outcome.scores[0])) == outcome.tokens[0]


def _cpu_decoder(runtime: str, slots: int):
    if runtime == "onnxruntime":
        from server.engines.ort_decoder import OrtDecoder

        return OrtDecoder(GEN_VERSION_DIR, threads=2, slots=slots, context=256)
    pytest.importorskip("torch")
    from server.engines import torch_decoder

    return torch_decoder.load(GEN_VERSION_DIR, slots, 256, "cpu")


# -- on a GPU --------------------------------------------------------------------------------------------

def _cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (torch sees none); runs on the lent H200 through bench/device.sh")
    return torch


def _random_decoder(torch, dtype, slots: int, context: int, graphs: bool):
    from server.engines.llama import SMOLLM2_135M, Llama, random_weights
    from server.engines.torch_decoder import TorchDecoder

    module = Llama.from_hf_state(SMOLLM2_135M, random_weights(SMOLLM2_135M, torch.float32, "cuda", seed=3), dtype,
                                 "cuda")
    return TorchDecoder(module, slots, context, graphs=graphs)


def test_gpu_decode_graphs_replay_what_the_eager_steps_compute():
    torch = _cuda()
    graphed = _random_decoder(torch, torch.bfloat16, 8, 512, graphs=True)
    eager = _random_decoder(torch, torch.bfloat16, 8, 512, graphs=False)
    assert graphed.pipelined and graphed.counters() == {}
    prompts = [list(range(10 + i, 10 + i + 40 * (i + 1))) for i in range(4)]
    assert together(graphed, prompts, 40, budget=64, joins=[0, 1, 1, 6]) == \
        together(eager, prompts, 40, budget=64, joins=[0, 1, 1, 6])
    assert graphed.counters()["graph_replays"] > 30
    assert graphed.counters()["chunk_graph_replays"] > 0  # steps whose only chunk is short


def test_gpu_continuous_batching_answers_as_each_sequence_alone(monkeypatch):
    """fp32 without TF32, so that a batch's size does not change the arithmetic's rounding."""
    torch = _cuda()
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    decoder = _random_decoder(torch, torch.float32, 4, 512, graphs=True)
    prompts = [list(range(100 + 7 * i, 100 + 7 * i + 30 + 50 * i)) for i in range(5)]
    expected = [alone(decoder, p, 24) for p in prompts]
    assert together(decoder, prompts, 24, budget=48, joins=[0, 0, 3, 4, 9]) == expected


def test_gpu_model_matches_transformers_llama_on_the_same_weights(monkeypatch):
    """The module's logits against transformers' LlamaForCausalLM (fp32, same random weights)."""
    torch = _cuda()
    transformers = pytest.importorskip("transformers")
    from server.engines.llama import SMOLLM2_135M, Llama, random_weights

    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    arch = SMOLLM2_135M
    state = random_weights(arch, torch.float32, "cuda", seed=5)
    config = transformers.LlamaConfig(
        vocab_size=arch.vocab, hidden_size=arch.hidden, intermediate_size=arch.intermediate,
        num_hidden_layers=arch.layers, num_attention_heads=arch.heads, num_key_value_heads=arch.kv_heads,
        head_dim=arch.head_dim, rms_norm_eps=arch.rms_eps, tie_word_embeddings=arch.tie_embeddings,
        max_position_embeddings=arch.max_positions, rope_theta=arch.rope_theta)
    reference = transformers.LlamaForCausalLM(config).to("cuda").eval()
    reference.load_state_dict(state, strict=False)
    if arch.tie_embeddings:
        reference.tie_weights()
    ids = torch.tensor([list(range(200, 264))], device="cuda")
    from server.engines.torch_decoder import TorchDecoder

    decoder = TorchDecoder(Llama.from_hf_state(arch, state, torch.float32, "cuda"), 1, 128, graphs=False)
    outcome = decoder.collect(decoder.launch(Step(chunks=[Chunk(0, ids[0].tolist(), 0, last=True, scores=True)])))
    with torch.no_grad():
        expected = reference(ids).logits[0, -1].float().cpu().numpy()
    got = outcome.scores[0]
    import numpy as np

    assert np.abs(got - expected).max() <= 1e-3 * np.abs(expected).max()


def test_gpu_server_streams_from_the_torch_decoder(tmp_path):
    """A real server on the GPU with a SmolLM2-shaped model (random bf16 weights): the worker runs it on
    torch; eight generations at once all stream their answers; one alone answers as the engine alone does."""
    torch = _cuda()
    from bench.generate_gpu import write_random_model
    from server.engines import torch_decoder
    from harness.servers import ServerProcess

    version = write_random_model(tmp_path / "models", "smollm2-135m", 8)
    prompts = [[(7 * i + 13 * j) % 40000 + 5 for j in range(60 + 20 * i)] for i in range(8)]
    engine = torch_decoder.load(version, 1, 1024, "cuda")
    expected = alone(engine, prompts[0], 24)
    del engine
    torch.cuda.empty_cache()
    (tmp_path / "server").mkdir()
    with ServerProcess(tmp_path / "server", tmp_path / "models", frontends=2) as server:
        import threading

        def ask(i: int) -> list:
            words = " ".join(f"w{t}" for t in prompts[i])
            with server.client(timeout_s=120) as client:
                return list(client.generate_stream("smollm2-135m", messages=[{"role": "user", "content": words}],
                                                   max_new_tokens=24, mode="NO_STORE"))

        results: list = [None] * len(prompts)
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, ask(i))) for i in range(len(prompts))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        for messages in results:
            assert messages[-1].end.completion_tokens == 24 and messages[-1].end.finish_reason == pb_length()
            assert sum(len(m.token_ids) for m in messages) == 24
        assert [t for m in ask(0) for t in m.token_ids] == expected  # alone: the same arithmetic as the engine's
        engines = {e.model: e for e in server.stats().worker.engines}
        assert engines["smollm2-135m"].runtime == "torch" and engines["smollm2-135m"].precision == "bf16"
        assert engines["smollm2-135m"].device.startswith("cuda:0")


def pb_length() -> int:
    from infercache.v1 import infercache_pb2 as pb

    return pb.GenerationEnd.LENGTH


def test_gpu_prefix_blocks_kept_exported_and_restored_give_the_same_answer(monkeypatch):
    """Blocks kept from one slot, copied out to host memory and to bytes (the disk tier's form), then
    restored into other slots from device memory, pinned host memory and bytes: each continues as the
    prompt computed whole does (fp32 without TF32: other slots decode in other batch classes)."""
    torch = _cuda()
    from server.engines.decoding import Keep, Restore

    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    decoder = _random_decoder(torch, torch.float32, 4, 512, graphs=True)
    block = 16
    assert decoder.open_blocks(block, 8 * decoder.block_bytes(block)) == 8
    prompt = list(range(300, 364))  # 4 blocks
    expected = alone(decoder, prompt, 12)
    keeps = [Keep(0, i * block, i) for i in range(3)]
    decoder.collect(decoder.launch(Step(chunks=[Chunk(0, prompt, 0, last=True)], keeps=keeps)))
    exported = decoder.collect(decoder.launch(Step(exports=[(1, "one"), (2, "two")]))).exports
    host = dict(exported)
    disk = decoder.host_block(bytes(decoder.host_bytes(host["two"])))
    decoder.release(0)
    for slot, sources in ((1, [0, 1, 2]), (2, [0, host["one"], disk])):
        restores = [Restore(slot, i * block, source) for i, source in enumerate(sources)]
        got = decoder.collect(decoder.launch(Step(restores=restores, chunks=[Chunk(slot, prompt[48:], 48, last=True)]))).tokens
        while len(got) < 12:
            got += decoder.collect(decoder.launch(Step(rows=[StepRow(slot, len(prompt) + len(got) - 1)]))).tokens
        assert got == expected, slot
