"""Generate section on a GPU host (`make bench ARGS="--sections generate"` where a GPU is visible): the torch
decoder (server/engines/torch_decoder.py) under the server, against the same engine's raw batched decode
loop without the server, in the same run.

Models: a Llama-3-8B-shaped decoder and a SmolLM2-135M-shaped one, in bf16 with random weights (speed does
not depend on the weights; the real SmolLM2 file is over the device's carry limit), each with a word-level
tokenizer of its vocabulary size ("w0" .. "wN", so a prompt of 512 words is 512 tokens), no end token (every
answer runs its 256 tokens).

For each model, N in `STREAMS`:
- raw (a child process, so its memory is gone before the server starts): the engine alone prefills N
  prompts of 512 tokens, `prefill_tokens` per step as the server reads them (the prefill time alone), then
  runs 255 decode steps of N rows back to back, each feeding its argmax to the next, under the same CUDA
  graphs (the ceiling: tokens/s = N x 255 / that time);
- server: N concurrent Generate calls (distinct prompts, greedy, NO_STORE) start together from client
  processes over several connections; each message's arrival time is recorded. Aggregate decode tokens/s:
  the tokens received while all N streams were decoding (from the last stream's first token to the first
  stream's end) over that window. TTFT p50/p99 from the calls' start. Waves alternate `rounds` times;
  medians. Also the GPU's busy fraction (nvidia-smi) in that window and the server's CPU seconds per token by
  role.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import random
import statistics
import time
from pathlib import Path

PROMPT_TOKENS = 512
NEW_TOKENS = 256
CONTEXT = 1024
STREAMS = (1, 16, 64, 256)
PREFILL_TOKENS = 4096
MODELS = ("llama3-8b", "smollm2-135m")
CLIENT_PROCESSES = 4
CHANNELS_PER_PROCESS = 4


def _architecture(name: str):
    from server.engines.llama import LLAMA3_8B, SMOLLM2_135M, LlamaArchitecture

    tiny = LlamaArchitecture(vocab=1000, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=128,
                             rope_theta=10000.0, rms_eps=1e-5, tie_embeddings=True, max_positions=8192)
    return {"llama3-8b": LLAMA3_8B, "smollm2-135m": SMOLLM2_135M, "tiny": tiny}[name]


def write_random_model(root: Path, name: str, max_streams: int, device: str = "cuda", **config) -> Path:
    """A model repository entry with random weights of the named shape ("tiny": the tests' dry run on a
    CPU, served by the torch decoder there), bf16, made on `device`; its config the generate section's,
    with `config`'s sections instead where given (model_config says how)."""
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    from server.engines.llama import random_weights
    from server.shared.generation_spec import DECODER_WEIGHTS_FILE, GENERATION_FILE
    from server.shared.models import TOKENIZER_FILE

    arch = _architecture(name)
    version = root / name / "1"
    version.mkdir(parents=True)
    started = time.perf_counter()
    state = {k: v.cpu() for k, v in random_weights(arch, torch.bfloat16, device, seed=1).items()}
    save_file(state, str(version / DECODER_WEIGHTS_FILE))
    del state
    arch.write(version, {"source": "random weights (benchmark)"})
    tokenizer = Tokenizer(WordLevel({f"w{i}": i for i in range(arch.vocab)}, unk_token="w0"))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    tokenizer.save(str(version / TOKENIZER_FILE))
    # The turns' words one after another: a conversation's next prompt starts with the tokens of the last
    # prompt and its answer (what the prefix cache's multi-turn replay needs).
    template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    (version / GENERATION_FILE).write_text(json.dumps({"chat_template": template, "end_ids": [],
                                                       "max_positions": arch.max_positions}))
    (root / name / "config.yaml").write_text(model_config(max_streams, device, **config))
    print(f"  {name}: {arch.parameters() / 1e9:.2f}B random bf16 weights written in "
          f"{time.perf_counter() - started:.1f} s", flush=True)
    return version


def model_config(max_streams: int, device: str = "cuda", *, generate: str = "", prefix_cache: str = "") -> str:
    """config.yaml of a benchmark model: the generate section's settings (or `generate`, a YAML flow
    mapping's inside), and a prefix_cache section where given."""
    generate = generate or (f"context_length: {CONTEXT}, max_new_tokens: {NEW_TOKENS}, max_streams: {max_streams}, "
                            f"max_waiting: {4 * max_streams}, prefill_tokens: {PREFILL_TOKENS}")
    if device != "cuda":
        generate += ", runtime: torch"
    return ("task: generate\nserving_version: \"1\"\n"
            f"generate: {{{generate}}}\n" + (f"prefix_cache: {{{prefix_cache}}}\n" if prefix_cache else "")
            + "cache: {ttl_s: 600}\n")


def _prompts(count: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(PROMPT_TOKENS)] for _ in range(count)]


def _raw_child(version: str, streams: tuple[int, ...], device: str, out) -> None:
    """In a child process: the engine's prefill time and raw decode loop for each N."""
    import torch

    from server.engines import torch_decoder
    from server.engines.decoding import Chunk, Step
    from server.engines.llama import LlamaArchitecture

    arch = LlamaArchitecture.read(Path(version))
    decoder = torch_decoder.load(Path(version), max(streams), CONTEXT, device)
    rows = {"capture_s": round(decoder.capture_s, 2)}
    for n in streams:
        chunks = [Chunk(i, p, 0, last=True) for i, p in enumerate(_prompts(n, arch.vocab, seed=n))]
        prefill = []
        for _ in range(3):
            started = time.perf_counter()
            step, budget = Step(), PREFILL_TOKENS
            for chunk in chunks:  # prompts in steps of at most PREFILL_TOKENS tokens, as the server reads them
                step.chunks.append(chunk)
                budget -= len(chunk.ids)
                if budget <= 0:
                    decoder.collect(decoder.launch(step))
                    step, budget = Step(), PREFILL_TOKENS
            if step:
                decoder.collect(decoder.launch(step))
            prefill.append(time.perf_counter() - started)
        seconds = statistics.median(decoder.raw_decode_loop(n, NEW_TOKENS - 1, PROMPT_TOKENS) for _ in range(3))
        rows[str(n)] = {"prefill_s": round(statistics.median(prefill), 4), "decode_s": round(seconds, 4),
                        "decode_tokens_per_s": round(n * (NEW_TOKENS - 1) / seconds, 1),
                        "step_ms": round(1000 * seconds / (NEW_TOKENS - 1), 3)}
        print(f"    raw N={n}: prefill {rows[str(n)]['prefill_s'] * 1000:.1f} ms, "
              f"{rows[str(n)]['decode_tokens_per_s']:.0f} tok/s ({rows[str(n)]['step_ms']:.2f} ms/step)", flush=True)
    del decoder
    if device == "cuda":
        torch.cuda.empty_cache()
    out.put(rows)


def raw_baseline(version: Path, streams: tuple[int, ...], device: str = "cuda") -> dict:
    from bench.load import run_children

    return run_children(_raw_child, [(str(version), streams, device)], 1800)[0]


# -- the server ------------------------------------------------------------------------------------------

def _client(address: str, model: str, prompts: list[str], start_at: float, out) -> None:
    """A client process: its share of the wave's calls, all started at `start_at`; per call its start and
    each message's (arrival, tokens)."""
    import grpc

    from infercache.v1 import infercache_pb2 as pb
    from infercache.v1 import infercache_pb2_grpc

    async def run() -> list:
        channels = [grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
                    for _ in range(CHANNELS_PER_PROCESS)]
        for channel in channels:
            await channel.channel_ready()
        stubs = [infercache_pb2_grpc.InferenceCacheStub(c) for c in channels]

        async def call(i: int, prompt: str) -> dict:
            request = pb.GenerateRequest(model=model, prompt=prompt, max_new_tokens=NEW_TOKENS,
                                         cache=pb.CachePolicy(mode=pb.CachePolicy.NO_STORE))
            started = time.perf_counter()
            arrivals = []
            async for message in stubs[i % len(stubs)].Generate(request, timeout=600):
                if message.token_ids:
                    arrivals.append((time.perf_counter(), len(message.token_ids)))
            return {"start": started, "arrivals": arrivals}

        await asyncio.sleep(max(0.0, start_at - time.perf_counter()))
        results = await asyncio.gather(*(call(i, p) for i, p in enumerate(prompts)))
        for channel in channels:
            await channel.close()
        return results

    out.send(asyncio.run(run()))


def fan_out(target, address: str, model: str, items: list, processes: int = CLIENT_PROCESSES) -> list:
    """target(address, model, its share of items, start_at, pipe) in client processes that start their
    calls together; what they send back, joined."""
    ctx = multiprocessing.get_context("spawn")
    processes = min(processes, len(items))
    start_at = time.perf_counter() + 3.0  # the clients have started and connected by then
    pipes, children = [], []
    for k in range(processes):
        receive, send = ctx.Pipe(duplex=False)
        child = ctx.Process(target=target, args=(address, model, items[k::processes], start_at, send))
        child.start()
        pipes.append(receive)
        children.append(child)
    out = [result for pipe in pipes for result in pipe.recv()]
    for child in children:
        child.join()
    return out


def _wave(address: str, model: str, prompts: list[str]) -> list[dict]:
    return fan_out(_client, address, model, prompts)


def wave_figures(calls: list[dict]) -> dict:
    """Aggregate decode tokens/s while every stream decoded, TTFT percentiles, tokens."""
    firsts = [c["arrivals"][0][0] for c in calls]
    ends = [c["arrivals"][-1][0] for c in calls]
    ttft = sorted(f - c["start"] for f, c in zip(firsts, calls))
    window = (max(firsts), min(ends))
    inside = sum(n for c in calls for t, n in c["arrivals"] if window[0] < t <= window[1])
    tokens = sum(n for c in calls for _, n in c["arrivals"])
    span = window[1] - window[0]
    return {
        "tokens": tokens, "messages": sum(len(c["arrivals"]) for c in calls),
        "decode_window_s": round(span, 4),
        "decode_tokens_per_s": round(inside / span, 1) if span > 0 else None,
        "ttft_p50_ms": round(1000 * ttft[len(ttft) // 2], 2),
        "ttft_p99_ms": round(1000 * ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))], 2),
        "wall_s": round(max(ends) - min(c["start"] for c in calls), 3),
        "window": window,
    }


def bench_server(root: Path, workdir: Path, name: str, streams: tuple[int, ...], rounds: int, vocab: int,
                 frontends: int = 8) -> dict:
    from bench.probes import GpuSampler, cpu_seconds, server_roles
    from harness.servers import ServerProcess

    workdir.mkdir(parents=True, exist_ok=True)
    server = ServerProcess(workdir, root, frontends=frontends, settings=("server.drain_s=5",), wait=False)
    try:
        server.wait_ready(timeout=600)
        print(f"  server ready after {server.ready_after:.1f} s", flush=True)
        roles = server_roles(server)
        out: dict = {"ready_s": round(server.ready_after, 1)}
        _wave(server.address, name, [" ".join(f"w{t}" for t in p) for p in _prompts(2, vocab, seed=99)])  # warm-up
        for n in streams:
            rows = []
            for r in range(rounds):
                prompts = [" ".join(f"w{t}" for t in p) for p in _prompts(n, vocab, seed=1000 * r + n)]
                cpu_before = {pid: cpu_seconds(pid) for pid in roles}
                gpu = GpuSampler()
                calls = _wave(server.address, name, prompts)
                figures = wave_figures(calls)
                busy = gpu.stop(between=figures.pop("window"))  # while every stream decoded
                cpu: dict[str, float] = {}
                for pid, role in roles.items():
                    cpu[role] = cpu.get(role, 0.0) + cpu_seconds(pid) - cpu_before[pid]
                figures["cpu_ms_per_token"] = {role: round(1000 * s / figures["tokens"], 3) for role, s in cpu.items()}
                figures["gpu_busy_percent"] = round(statistics.mean(busy.values()), 1) if busy else None
                assert figures["tokens"] == n * NEW_TOKENS, f"{figures['tokens']} tokens, expected {n * NEW_TOKENS}"
                rows.append(figures)
            keys = ("decode_tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "gpu_busy_percent", "wall_s")
            out[str(n)] = {k: round(statistics.median(values), 2) if (values := [r[k] for r in rows if r[k] is not None]) else None
                           for k in keys}
            out[str(n)]["cpu_ms_per_token"] = rows[len(rows) // 2]["cpu_ms_per_token"]
            out[str(n)]["rounds"] = rows
            print(f"    server N={n}: {out[str(n)]['decode_tokens_per_s']:.0f} tok/s decoding, TTFT p99 "
                  f"{out[str(n)]['ttft_p99_ms']:.0f} ms, GPU busy {out[str(n)]['gpu_busy_percent']}%, CPU ms/token "
                  f"{out[str(n)]['cpu_ms_per_token']}", flush=True)
        return out
    finally:
        server.stop()


def bench_generate_gpu(workdir: Path, rounds: int, quick: bool, models: tuple[str, ...] = MODELS,
                       streams: tuple[int, ...] = STREAMS,
                       device: str = "cuda", report: dict | None = None, checkpoint=lambda: None) -> dict:
    """Fills `report` model by model (checkpoint() after each part: a run cut short keeps what it
    measured). device "cpu" (with the "tiny" model): a dry run of every step, the tests'."""
    streams = streams[:3] if quick else streams
    report = {} if report is None else report
    report.update({"prompt_tokens": PROMPT_TOKENS, "new_tokens": NEW_TOKENS, "context": CONTEXT,
                   "prefill_tokens": PREFILL_TOKENS, "weights": "random (bf16); speed does not depend on them"})
    for name in models:
        print(f"  {name} ...", flush=True)
        root = workdir / f"models-{name}"
        version = write_random_model(root, name, max(streams), device)
        raw = raw_baseline(version, streams, device)
        report[name] = {"raw": raw}
        checkpoint()
        served = bench_server(root, workdir / f"server-{name}", name, streams, max(1, rounds), _architecture(name).vocab,
                              frontends=8 if device == "cuda" else 2)
        (version / "decoder.safetensors").unlink()
        ratios = {}
        for n in streams:
            base = raw[str(n)]
            ratios[str(n)] = {
                "decode_vs_raw": round(served[str(n)]["decode_tokens_per_s"] / base["decode_tokens_per_s"], 3),
                "ttft_p99_vs_prefill": round(served[str(n)]["ttft_p99_ms"] / (1000 * base["prefill_s"]), 2),
            }
        report[name].update(server=served, ratios=ratios)
        checkpoint()
    return report


def print_generate_gpu(report: dict) -> None:
    print(f"\n== generation on the GPU ({report['prompt_tokens']}-token prompts, {report['new_tokens']} new tokens; "
          f"{report['weights']}) ==")
    print(f"{'model':<14} {'N':>4} {'server tok/s':>13} {'raw tok/s':>10} {'ratio':>6} {'TTFT p99':>9} "
          f"{'prefill':>8} {'ratio':>6} {'GPU busy':>8}")
    for name, part in report.items():
        if not isinstance(part, dict) or "server" not in part:
            continue
        raw = part["raw"]
        for n, ratios in part["ratios"].items():
            s = part["server"][n]
            print(f"{name:<14} {n:>4} {s['decode_tokens_per_s']:>13.0f} {raw[n]['decode_tokens_per_s']:>10.0f} "
                  f"{ratios['decode_vs_raw']:>6.2f} {s['ttft_p99_ms']:>8.0f}ms {raw[n]['prefill_s'] * 1000:>7.0f}ms "
                  f"{ratios['ttft_p99_vs_prefill']:>6.2f} {s['gpu_busy_percent']!s:>8}")
