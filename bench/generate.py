"""Generate section (`make bench ARGS="--sections generate"`): SmolLM2-135M-Instruct on this machine.

1. Misses, one caller: time to first token and decode tokens/s of the served model (a fresh question
   each call), against transformers' own greedy `generate` on the same weights in this process (the
   ceiling the issue names), rounds alternating.
2. Hits: the whole answer of a cached 128-token generation, streamed, against an embedding exact hit
   (Infer on minilm) through the same grpc.aio client, rounds alternating; and a hit's time to first
   token against a miss's.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from pathlib import Path

import grpc

from bench.sections import Run
from harness.servers import REPO, ServerProcess, link_model
from infercache.v1 import infercache_pb2 as pb
from infercache.v1 import infercache_pb2_grpc

GEN_DIR = REPO / "models" / "smollm2" / "1"
NEW_TOKENS = 128


def _models(root: Path) -> Path:
    link_model(root, "minilm", (REPO / "models" / "minilm" / "config.yaml").read_text(),
               {"1": REPO / "models" / "minilm" / "1"})
    link_model(root, "smollm2", (REPO / "models" / "smollm2" / "config.yaml").read_text(), {"1": GEN_DIR})
    return root


def _request(text: str, new: int = NEW_TOKENS) -> pb.GenerateRequest:
    return pb.GenerateRequest(model="smollm2", messages=[pb.ChatMessage(role="user", content=text)], max_new_tokens=new)


def _stream(stub, request: pb.GenerateRequest) -> tuple[float, float, int, int]:
    """(seconds to the first text, to the end, tokens, source) of one Generate call."""
    started = time.perf_counter()
    first = None
    tokens = 0
    for message in stub.Generate(request, timeout=600):
        if message.text and first is None:
            first = time.perf_counter()
        tokens += len(message.token_ids)
        if message.HasField("end"):
            source = message.end.cache.source
    done = time.perf_counter()
    return (first or done) - started, done - started, tokens, source


def _reference():
    """transformers' model from the same GGUF: (seconds to the first token, to the end, tokens) of greedy generate."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from server.tools.export_decoder import default_gguf

    gguf = default_gguf()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    torch.set_num_threads(os.cpu_count() or 1)

    def run(text: str, new: int) -> tuple[float, float, int]:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True, return_dict=True, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            started = time.perf_counter()
            model.generate(ids, max_new_tokens=1, do_sample=False)
            first = time.perf_counter() - started
            started = time.perf_counter()
            out = model.generate(ids, max_new_tokens=new, do_sample=False)
            total = time.perf_counter() - started
        return first, total, out.shape[1] - ids.shape[1]

    return run


async def _hits(address: str, cached: pb.GenerateRequest, embed: pb.InferRequest, rounds: int, hits: int):
    """Hit latencies through one grpc.aio channel (the client the load generators use), rounds
    alternating: (whole Generate answers, their first text, Infer exact hits), seconds."""
    whole, first, embedded = [], [], []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = infercache_pb2_grpc.InferenceCacheStub(channel)
        for _ in range(rounds):
            for _ in range(hits):
                started = time.perf_counter()
                seen = None
                async for message in stub.Generate(cached, timeout=10):
                    seen = seen or time.perf_counter()
                    assert message.end.cache.source == pb.CacheInfo.RESULT_EXACT
                done = time.perf_counter()
                whole.append(done - started)
                first.append(seen - started)
            for _ in range(hits):
                started = time.perf_counter()
                response = await stub.Infer(embed, timeout=10)
                embedded.append(time.perf_counter() - started)
                assert response.cache.source == pb.CacheInfo.RESULT_EXACT
    return whole, first, embedded


def _p50(values: list[float]) -> float:
    return statistics.median(values)


def bench_generate(workdir: Path, texts: list[str], rounds: int, quick: bool, new_tokens: int = NEW_TOKENS) -> dict:
    """new_tokens: each miss's answer, and the cached one (the dry run's few)."""
    if not (GEN_DIR / "decoder.onnx").is_file():
        print("generate section skipped: the generative model is not prepared (make model)", flush=True)
        return {"skipped": "models/smollm2/1 is not prepared (make model)"}
    misses_per_round = 2 if quick else 4
    hits = 50 if quick else 300
    reference = _reference()
    (workdir / "server").mkdir(parents=True)
    server = ServerProcess(workdir / "server", _models(workdir / "models"), frontends=os.cpu_count() or 1,
                           engines_dir=workdir / "engines")
    questions = iter(texts)
    served: dict[str, list] = {"ttft_s": [], "decode_tok_s": [], "tokens": []}
    ceiling: dict[str, list] = {"ttft_s": [], "decode_tok_s": [], "tokens": []}
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = infercache_pb2_grpc.InferenceCacheStub(channel)
            _stream(stub, _request(next(questions), 8))  # warm
            for _ in range(rounds):
                for _ in range(misses_per_round):  # alternating: the server, then transformers, on new questions
                    first, total, tokens, _ = _stream(stub, _request(next(questions), new_tokens))
                    served["ttft_s"].append(first)
                    served["decode_tok_s"].append((tokens - 1) / max(1e-9, total - first))
                    served["tokens"].append(tokens)
                    first, total, tokens = reference(next(questions), new_tokens)
                    ceiling["ttft_s"].append(first)
                    ceiling["decode_tok_s"].append((tokens - 1) / max(1e-9, total - first))
                    ceiling["tokens"].append(tokens)
            # A 128-token answer to cache: greedy, as long as the model makes it for this question.
            cached = _request("Write a detailed, step by step guide to disputing a card payment.", new_tokens)
            _, _, answer_tokens, _ = _stream(stub, cached)
            deadline = time.monotonic() + 10
            while _stream(stub, cached)[3] != pb.CacheInfo.RESULT_EXACT and time.monotonic() < deadline:
                time.sleep(0.05)
            embed = pb.InferRequest(model="minilm", text="how do I dispute a card payment")
            stub.Infer(embed, timeout=10)
            time.sleep(1.0)  # its write-behind
            hit_whole, hit_first, embed_hit = asyncio.run(_hits(server.address, cached, embed, rounds, hits))
    finally:
        server.stop()
    miss_ttft, ceiling_ttft = _p50(served["ttft_s"]), _p50(ceiling["ttft_s"])
    return {
        "model": "SmolLM2-135M-Instruct (real weights, GGUF Q4_1 dequantized to fp32), ONNX Runtime CPU",
        "new_tokens": new_tokens, "cpus": os.cpu_count(),
        "misses": {
            "served": {"ttft_p50_ms": round(miss_ttft * 1e3, 1),
                       "decode_tokens_per_s_p50": round(_p50(served["decode_tok_s"]), 1),
                       "calls": len(served["ttft_s"])},
            "transformers_generate": {"ttft_p50_ms": round(ceiling_ttft * 1e3, 1),
                                      "decode_tokens_per_s_p50": round(_p50(ceiling["decode_tok_s"]), 1),
                                      "calls": len(ceiling["ttft_s"])},
            "decode_ratio": round(_p50(served["decode_tok_s"]) / _p50(ceiling["decode_tok_s"]), 2),
            "ttft_ratio": round(miss_ttft / ceiling_ttft, 2),
        },
        "hits": {
            "answer_tokens": answer_tokens,
            "whole_answer_p50_ms": round(_p50(hit_whole) * 1e3, 3),
            "embedding_exact_hit_p50_ms": round(_p50(embed_hit) * 1e3, 3),
            "ratio_to_embedding_hit": round(_p50(hit_whole) / _p50(embed_hit), 2),
            "ttft_p50_ms": round(_p50(hit_first) * 1e3, 3),
            "miss_ttft_over_hit_ttft": round(miss_ttft / _p50(hit_first), 1),
            "calls": len(hit_whole),
        },
    }


def print_generate(report: dict) -> None:
    if "skipped" in report:
        print(f"generate: skipped ({report['skipped']})")
        return
    misses, hits = report["misses"], report["hits"]
    print(f"generate misses ({report['new_tokens']} new tokens, one caller): served TTFT "
          f"{misses['served']['ttft_p50_ms']} ms, decode {misses['served']['decode_tokens_per_s_p50']} tok/s; "
          f"transformers generate TTFT {misses['transformers_generate']['ttft_p50_ms']} ms, decode "
          f"{misses['transformers_generate']['decode_tokens_per_s_p50']} tok/s (decode {misses['decode_ratio']}x, "
          f"TTFT {misses['ttft_ratio']}x)")
    print(f"generate hits: a {hits['answer_tokens']}-token answer whole {hits['whole_answer_p50_ms']} ms p50 vs an "
          f"embedding exact hit {hits['embedding_exact_hit_p50_ms']} ms ({hits['ratio_to_embedding_hit']}x); hit TTFT "
          f"{hits['ttft_p50_ms']} ms, miss TTFT {hits['miss_ttft_over_hit_ttft']}x that")


def section(run: Run) -> None:
    from bench.probes import gpu_available

    if gpu_available():
        from bench.generate_gpu import bench_generate_gpu, print_generate_gpu

        print("benchmarking generation on the GPU (the server against the engine's raw decode loop) ...", flush=True)
        run.report["generate"] = {}
        bench_generate_gpu(run.workdir / "generate", run.rounds, run.quick, tuple(run.args.generate_models.split(",")),
                           report=run.report["generate"], checkpoint=run.save)
        print_generate_gpu(run.report["generate"])
        return
    print("benchmarking generation (SmolLM2: misses against transformers' generate, hits) ...", flush=True)
    run.report["generate"] = bench_generate(run.workdir / "generate", run.texts, run.rounds, run.quick,
                                            **({"new_tokens": 8} if run.dry else {}))
    print_generate(run.report["generate"])
