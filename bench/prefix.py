"""Prefix section (`make bench ARGS="--sections prefix"`): the prefix key/value cache against computing the
whole prompt, in the same server and run.

On a CPU host (SmolLM2's real weights on ONNX Runtime): a 1,024-token system prompt before short Banking77
questions; time to first token with its blocks cached against a model of the same weights with the cache
off, rounds alternating.

On a GPU host (a Llama-3-8B-shaped model, random bf16 weights: speed does not depend on them):
1. Tiers: a 4,096-token prefix plus 64 new tokens; TTFT of a fresh prefix (the whole prompt computed)
   against the same prefix cached in device memory, in pinned host memory (pushed out of device memory by
   other prefixes), and on disk after the server was stopped and started again (a model whose demoted
   blocks go straight to disk). Each hit against the fresh prefixes of the same server process. Then the
   decoder alone, in a process of its own, runs the same steps (computed, device and host hits): what the
   server adds to each is the rest of its TTFT.
2. No reuse: waves of 64 streams of distinct 512-token prompts and 256 new tokens, prefix cache on against
   off (two model names, the same weights), rounds alternating: decode tokens/s and wall time.
3. Conversations: 64 at once, 10 turns each, every turn re-sending the conversation (a system prompt of
   512 tokens, questions of 32, answers of 64): mean TTFT with the cache on against off.
"""

from __future__ import annotations

import asyncio
import csv
import random
import statistics
import time
from pathlib import Path

import grpc

from infercache.v1 import infercache_pb2 as pb
from infercache.v1 import infercache_pb2_grpc
from bench.generate_gpu import fan_out, model_config
from bench.sections import Run
from harness.servers import REPO, ServerProcess, link_model

NO_STORE = pb.CachePolicy(mode=pb.CachePolicy.NO_STORE)


# -- CPU: SmolLM2, a long system prompt ----------------------------------------------------------------------

def _first_token_s(stub, request: pb.GenerateRequest) -> float:
    started = time.perf_counter()
    for message in stub.Generate(request, timeout=600):
        if message.token_ids or message.HasField("end"):
            return time.perf_counter() - started
    raise RuntimeError("no message")


def bench_prefix_cpu(workdir: Path, rounds: int, quick: bool) -> dict:
    from tokenizers import Tokenizer

    from bench import BANKING77

    version = REPO / "models" / "smollm2" / "1"
    config = (REPO / "models" / "smollm2" / "config.yaml").read_text()
    root = workdir / "models"
    link_model(root, "cached", config, {"1": version})
    link_model(root, "plain", config + "prefix_cache: {enabled: false}\n", {"1": version})
    tokenizer = Tokenizer.from_file(str(version / "tokenizer.json"))
    rules, n = [], 0
    while len(tokenizer.encode("\n".join(rules)).ids) < 1024:
        n += 1
        rules.append(f"Rule {n}: a card payment older than {n + 30} days cannot be disputed in the app; call us.")
    system = "\n".join(rules)
    with open(BANKING77, newline="") as f:
        questions = [row["text"] for row in csv.DictReader(f)][:200]
    random.Random(3).shuffle(questions)
    count = 4 if quick else 8
    (workdir / "server").mkdir(parents=True)
    with ServerProcess(workdir / "server", root, frontends=1) as server:
        channel, stub = server.stub()

        def request(model: str, question: str) -> pb.GenerateRequest:
            return pb.GenerateRequest(model=model, max_new_tokens=4, cache=NO_STORE, messages=[
                pb.ChatMessage(role="system", content=system), pb.ChatMessage(role="user", content=question)])

        _first_token_s(stub, request("cached", "Hello"))  # its blocks, kept
        system_tokens = len(tokenizer.encode(system).ids)
        times: dict[str, list[float]] = {"cached": [], "plain": []}
        for r in range(max(1, rounds)):
            for question in questions[r * count:(r + 1) * count]:
                for model in ("cached", "plain"):
                    times[model].append(_first_token_s(stub, request(model, question)))
        channel.close()
        counters = server.stats().worker.counters
    cached, plain = statistics.median(times["cached"]), statistics.median(times["plain"])
    return {"system_prompt_tokens": system_tokens, "calls_each": len(times["cached"]),
            "ttft_cached_p50_ms": round(1000 * cached, 1), "ttft_plain_p50_ms": round(1000 * plain, 1),
            "ratio": round(cached / plain, 3), "reused_tokens": counters.get("prefix.cached.1.prefix_tokens_memory", 0),
            "samples_ms": {k: [round(1000 * t, 1) for t in v] for k, v in times.items()}}


# -- GPU: an 8B shape, random weights --------------------------------------------------------------------------

PREFIX_TOKENS, SUFFIX_TOKENS, BLOCK = 4096, 64, 64
TIERS_CONTEXT, TIERS_STREAMS = 4352, 16  # the tiers' model: a prefix, its suffix and the answer; its streams
PREFIX_MB = 1100  # device (and host) memory for two 4,096-token prefixes of the 8B shape (64 blocks of 8 MiB each)


def _words(ids) -> str:
    return " ".join(f"w{t}" for t in ids)


def _ttft(stub, model: str, prompt: str) -> float:
    return _first_token_s(stub, pb.GenerateRequest(model=model, prompt=prompt, max_new_tokens=4, cache=NO_STORE))


def bench_tiers(root: Path, workdir: Path, rounds: int, vocab: int) -> dict:
    rng = random.Random(5)

    def fresh() -> list[int]:
        return [rng.randrange(1, vocab) for _ in range(PREFIX_TOKENS)]

    def suffix() -> list[int]:
        return [rng.randrange(1, vocab) for _ in range(SUFFIX_TOKENS)]

    out: dict = {"computed": [], "device": [], "host": [], "disk": [], "computed_after_restart": []}
    cache = workdir / "cache"
    (workdir / "one").mkdir(parents=True)
    server = ServerProcess(workdir / "one", root, frontends=2, cache_dir=cache, wait=False)
    try:
        server.wait_ready(timeout=600)
        channel, stub = server.stub()
        _ttft(stub, "host", _words(fresh() + suffix()))  # warm-up (and the channel's connection)
        for _ in range(max(2, rounds)):
            prefix = fresh()
            out["computed"].append(_ttft(stub, "host", _words(prefix + suffix())))
            out["device"].append(_ttft(stub, "host", _words(prefix + suffix())))
            for _ in range(2):  # two other prefixes fill device memory: this one goes to host memory
                out["computed"].append(_ttft(stub, "host", _words(fresh() + suffix())))
            out["host"].append(_ttft(stub, "host", _words(prefix + suffix())))
        on_disk = [fresh() for _ in range(max(3, rounds))]
        for prefix in on_disk + [fresh(), fresh()]:  # the last two push the others out to disk
            _ttft(stub, "disk", _words(prefix + suffix()))
        deadline = time.monotonic() + 120
        while server.stats().worker.counters.get("kv.backlog", 0) and time.monotonic() < deadline:
            time.sleep(0.2)
        counters = dict(server.stats().worker.counters)
        channel.close()
    finally:
        server.stop()
    (workdir / "two").mkdir()
    server = ServerProcess(workdir / "two", root, frontends=2, cache_dir=cache, wait=False)
    try:
        server.wait_ready(timeout=600)
        channel, stub = server.stub()
        _ttft(stub, "disk", _words(fresh() + suffix()))  # warm-up (and the channel's connection)
        for prefix in on_disk:
            out["computed_after_restart"].append(_ttft(stub, "disk", _words(fresh() + suffix())))
            out["disk"].append(_ttft(stub, "disk", _words(prefix + suffix())))
        after = dict(server.stats().worker.counters)
        channel.close()
    finally:
        server.stop()
    report = {tier: [round(1000 * t, 2) for t in times] for tier, times in out.items()}
    p50 = {tier: statistics.median(times) for tier, times in report.items()}
    return {"samples_ms": report, "ttft_p50_ms": p50,
            "ratios": {"device": round(p50["device"] / p50["computed"], 3),
                       "host": round(p50["host"] / p50["computed"], 3),
                       "disk": round(p50["disk"] / p50["computed_after_restart"], 3)},
            "reused_tokens": {t: counters.get(f"prefix.host.1.prefix_tokens_{t}", 0) for t in ("memory", "host")}
            | {"disk": after.get("prefix.disk.1.prefix_tokens_disk", 0)},
            # from a disk hit's lookup until its blocks are in host memory (the worker's own timing)
            "disk_read_ms_mean": round(after.get("prefix.disk.1.prefix_disk_read_us", 0) / 1000 / len(on_disk), 2),
            "worker_counters": {"first": _worker_figures(counters), "after_restart": _worker_figures(after)}}


def _decoder_child(version: str, context: int, slots: int, device: str, rounds: int, vocab: int, out) -> None:
    """In a child process, the decoder alone (no server): the tiers' steps timed from launch to the first
    token, so that the server's own cost per request is the rest of its TTFT."""
    import torch

    from server.engines import torch_decoder
    from server.engines.decoding import Chunk, Keep, Restore, Step

    decoder = torch_decoder.load(Path(version), slots, context, device)  # as the server's
    blocks = PREFIX_TOKENS // BLOCK
    decoder.open_blocks(BLOCK, blocks * decoder.block_bytes(BLOCK))
    rng = random.Random(9)

    def ids(n: int) -> list[int]:
        return [rng.randrange(1, vocab) for _ in range(n)]

    def timed(*steps: Step) -> float:
        if device == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        for step in steps:
            decoder.collect(decoder.launch(step))
        return 1000 * (time.perf_counter() - started)

    out_ms: dict[str, list[float]] = {"computed": [], "device": [], "host": []}
    for _ in range(max(2, rounds) + 1):  # the first round warms
        prefix = ids(PREFIX_TOKENS)
        out_ms["computed"].append(timed(  # as the server reads it: one step of its prefill budget, then the rest
            Step(chunks=[Chunk(0, prefix, 0)], keeps=[Keep(0, i * BLOCK, i) for i in range(blocks)]),
            Step(chunks=[Chunk(0, ids(SUFFIX_TOKENS), PREFIX_TOKENS, last=True)])))
        out_ms["device"].append(timed(Step(restores=[Restore(1, i * BLOCK, i) for i in range(blocks)],
                                           chunks=[Chunk(1, ids(SUFFIX_TOKENS), PREFIX_TOKENS, last=True)])))
        exported = decoder.collect(decoder.launch(Step(exports=[(i, i) for i in range(blocks)]))).exports
        host = [block for _, block in sorted(exported, key=lambda e: e[0])]
        out_ms["host"].append(timed(Step(restores=[Restore(2, i * BLOCK, host[i]) for i in range(blocks)],
                                         chunks=[Chunk(2, ids(SUFFIX_TOKENS), PREFIX_TOKENS, last=True)])))
    out.put({tier: round(statistics.median(times[1:]), 2) for tier, times in out_ms.items()})


def decoder_alone(version: Path, context: int, slots: int, device: str, rounds: int, vocab: int) -> dict:
    """_decoder_child's figures: p50 ms by tier (computed, device, host)."""
    from bench.load import run_children

    return run_children(_decoder_child, [(str(version), context, slots, device, rounds, vocab)], 900)[0]


def _worker_figures(counters: dict) -> dict:
    return {k: v for k, v in sorted(counters.items()) if k.startswith(("prefix.", "kv.", "decoder."))}


def _conversations(address: str, model: str, conversations: list[dict], start_at: float, out) -> None:
    """A client process: its conversations, all at once, turn after turn; each turn's TTFT."""
    async def run() -> list[float]:
        channel = grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
        await channel.channel_ready()
        stub = infercache_pb2_grpc.InferenceCacheStub(channel)

        async def talk(conversation: dict) -> list[float]:
            history = [pb.ChatMessage(role="system", content=conversation["system"])]
            ttfts = []
            for question in conversation["questions"]:
                history.append(pb.ChatMessage(role="user", content=question))
                request = pb.GenerateRequest(model=model, messages=history, max_new_tokens=64, cache=NO_STORE)
                started, first, text = time.perf_counter(), None, []
                async for message in stub.Generate(request, timeout=600):
                    if first is None and (message.token_ids or message.HasField("end")):
                        first = time.perf_counter()
                    text.append(message.text)
                ttfts.append(first - started)
                history.append(pb.ChatMessage(role="assistant", content="".join(text)))
            return ttfts

        await asyncio.sleep(max(0.0, start_at - time.perf_counter()))
        results = await asyncio.gather(*(talk(c) for c in conversations))
        await channel.close()
        return [t for ttfts in results for t in ttfts]

    out.send(asyncio.run(run()))


def _chat_replay(address: str, model: str, count: int, turns: int, vocab: int, seed: int) -> list[float]:
    rng = random.Random(seed)
    conversations = [{"system": _words(rng.randrange(1, vocab) for _ in range(512)),
                      "questions": [_words(rng.randrange(1, vocab) for _ in range(32)) for _ in range(turns)]}
                     for _ in range(count)]
    return fan_out(_conversations, address, model, conversations)


def bench_reuse(root: Path, workdir: Path, rounds: int, vocab: int, quick: bool, frontends: int = 8) -> dict:
    from bench.generate_gpu import _prompts, _wave, wave_figures

    (workdir / "three").mkdir(parents=True)
    server = ServerProcess(workdir / "three", root, frontends=frontends, wait=False)
    try:
        server.wait_ready(timeout=600)
        channel, stub = server.stub()
        with channel:
            for _ in range(3):  # (a worker busy at that moment is left out of one answer)
                models = stub.ListModels(pb.ListModelsRequest(), timeout=30).models
                unloaded = [m.name for m in models if not m.engines]
                if not unloaded:
                    break
                time.sleep(5.0)
        if unloaded:
            reason = (f"no worker reports an engine for model(s) {', '.join(unloaded)} (their log says why; on "
                      "an 80 GB GPU two 8B models with 64 streams each beside a prefix cache do not fit)")
            print(f"  reuse parts skipped: {reason}", flush=True)
            return {"reuse_skipped": reason}
        waves: dict[str, list[dict]] = {"on": [], "off": []}
        _wave(server.address, "on", [_words(p) for p in _prompts(4, vocab, seed=7)])  # warm-up
        _wave(server.address, "off", [_words(p) for p in _prompts(4, vocab, seed=8)])
        for r in range(max(1, rounds)):
            for model in ("on", "off"):
                prompts = [_words(p) for p in _prompts(64, vocab, seed=100 * r + (model == "on"))]
                figures = wave_figures(_wave(server.address, model, prompts))
                figures.pop("window")
                waves[model].append(figures)
        turns = 4 if quick else 10
        chat = {model: _chat_replay(server.address, model, 64, turns, vocab, seed=11) for model in ("off", "on")}
        counters = dict(server.stats().worker.counters)
    finally:
        server.stop()
    tok = {m: statistics.median(w["decode_tokens_per_s"] for w in waves[m]) for m in waves}
    wall = {m: statistics.median(w["wall_s"] for w in waves[m]) for m in waves}
    mean = {m: statistics.mean(t) for m, t in chat.items()}
    return {
        "no_reuse": {"waves": waves, "decode_tokens_per_s": tok, "wall_s": wall,
                     "decode_ratio_on_off": round(tok["on"] / tok["off"], 3),
                     "wall_ratio_on_off": round(wall["on"] / wall["off"], 3)},
        "conversations": {"conversations": 64, "turns": turns, "mean_ttft_ms": {m: round(1000 * v, 1) for m, v in mean.items()},
                          "p99_ttft_ms": {m: round(1000 * sorted(t)[int(0.99 * len(t))], 1) for m, t in chat.items()},
                          "off_over_on": round(mean["off"] / mean["on"], 2),
                          "reused_tokens": counters.get("prefix.on.1.prefix_tokens_memory", 0),
                          "ttft_ms_by_turn": {m: _by_turn(t, turns) for m, t in chat.items()},
                          "worker_counters": _worker_figures(counters)},
    }


def _by_turn(ttfts: list[float], turns: int) -> list[float]:
    """Mean TTFT of each turn (a client's list holds each conversation's turns in order)."""
    return [round(1000 * statistics.mean(ttfts[i::turns]), 1) for i in range(turns)]


def bench_prefix_gpu(workdir: Path, rounds: int, quick: bool, report: dict, checkpoint=lambda: None,
                     arch_name: str = "llama3-8b", device: str = "cuda", parts: tuple[str, ...] = ("tiers", "reuse")
                     ) -> dict:
    """arch_name "tiny" with device "cpu": the tests' dry run of every step. `parts`: tiers (1), reuse (2, 3)."""
    from bench.generate_gpu import _architecture, write_random_model

    arch = _architecture(arch_name)
    report.update({"model": f"{arch_name} shape", "weights": "random (bf16); speed does not depend on them",
                   "prefix_tokens": PREFIX_TOKENS, "suffix_tokens": SUFFIX_TOKENS, "block_tokens": BLOCK})
    # device memory for two of the prompts (and their suffix block), host memory for four times that
    per_block = 2 * arch.layers * arch.kv_heads * arch.head_dim * 2 * BLOCK  # bf16
    two = -(-2 * (PREFIX_TOKENS // BLOCK + 2) * per_block // 2**20)
    root = workdir / "models-tiers"
    generate = (f"context_length: {TIERS_CONTEXT}, max_new_tokens: 64, max_streams: {TIERS_STREAMS}, max_waiting: 64, "
                "prefill_tokens: 4096")
    version = write_random_model(root, arch_name, 16, device, generate=generate)
    (root / arch_name).rename(root / "host")
    version = root / "host" / "1"
    (root / "host" / "config.yaml").write_text(
        model_config(16, device, generate=generate, prefix_cache=f"block_tokens: {BLOCK}, device_mb: {two}, "
                                                                 f"host_mb: {4 * two}"))
    # (on a CPU, host_mb is the memory tier: the dry run gives it the device's share)
    link_model(root, "disk", model_config(16, device, generate=generate, prefix_cache=f"block_tokens: {BLOCK}, "
                                          f"device_mb: {two}, host_mb: {0 if device == 'cuda' else two}"),
               {"1": version})
    if "tiers" in parts:
        report["tiers"] = bench_tiers(root, workdir / "tiers", rounds, arch.vocab)
        alone = decoder_alone(version, TIERS_CONTEXT, TIERS_STREAMS, device, rounds, arch.vocab)
        served = report["tiers"]["ttft_p50_ms"]
        report["tiers"]["decoder_alone_ms"] = alone  # the decoder's steps with no server around them
        report["tiers"]["server_adds_ms"] = {tier: round(served[tier] - alone[tier], 2) for tier in alone}
        checkpoint()
    if "reuse" not in parts:
        return report
    reuse = workdir / "models-reuse"
    generate = "context_length: 2048, max_new_tokens: 256, max_streams: 64, max_waiting: 256, prefill_tokens: 4096"
    link_model(reuse, "on", model_config(64, device, generate=generate, prefix_cache=f"block_tokens: {BLOCK}"),
               {"1": version})
    link_model(reuse, "off", model_config(64, device, generate=generate, prefix_cache="enabled: false"), {"1": version})
    report.update(bench_reuse(reuse, workdir / "reuse", rounds, arch.vocab, quick, frontends=8 if device == "cuda" else 2))
    checkpoint()
    return report


def print_prefix(report: dict) -> None:
    if "ttft_cached_p50_ms" in report:
        print(f"\n== prefix cache (CPU): {report['system_prompt_tokens']}-token system prompt, TTFT p50 "
              f"{report['ttft_cached_p50_ms']} ms cached vs {report['ttft_plain_p50_ms']} ms computed: "
              f"{report['ratio']}x ==")
        return
    print(f"\n== prefix cache (GPU, {report.get('model')}; {report.get('weights')}) ==")
    if "tiers" in report:
        tiers = report["tiers"]
        print(f"TTFT p50 ms: {tiers['ttft_p50_ms']}; ratios to computing the whole prompt: {tiers['ratios']}")
        if "decoder_alone_ms" in tiers:
            print(f"the decoder alone, ms: {tiers['decoder_alone_ms']}; the server adds {tiers['server_adds_ms']}")
    if "no_reuse" in report:
        print(f"no reuse: decode tok/s on/off {report['no_reuse']['decode_ratio_on_off']}, "
              f"wall on/off {report['no_reuse']['wall_ratio_on_off']}")
        print(f"conversations: mean TTFT ms {report['conversations']['mean_ttft_ms']}, off/on "
              f"{report['conversations']['off_over_on']}x")


def section(run: Run) -> None:
    from bench.probes import gpu_available

    print("benchmarking the prefix cache ...", flush=True)
    if gpu_available():
        run.report["prefix"] = {}
        bench_prefix_gpu(run.workdir / "prefix", run.rounds, run.quick, run.report["prefix"], checkpoint=run.save,
                         parts=tuple(run.args.prefix_parts.split(",")))
    else:
        run.report["prefix"] = bench_prefix_cpu(run.workdir / "prefix", run.rounds, run.quick)
    print_prefix(run.report["prefix"])
