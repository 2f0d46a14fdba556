"""Upstream section (`make bench ARGS="--sections upstream"`): infercache in front of a model server it does
not run, against LiteLLM's proxy with its documented exact cache on Redis. The same upstream is behind both
(an infercache serving MiniLM and SmolLM2 through its OpenAI-compatible door, one frontend: a real
OpenAI-compatible server that answers a repeated call from its own cache, so a miss at either cache costs
the upstream's exact hit, not a model run), called with the same requests by the same load generator
(bench/http_load.py: pre-built HTTP/1.1 requests, raw answers) on the OpenAI routes both serve:

- exact hits: /v1/embeddings and /v1/chat/completions, p50 at 1 caller and throughput at 32, rounds
  alternating; the upstream's call count is checked unchanged (every call a hit). Targets: p50 at most
  0.5x LiteLLM's, throughput at least 3x;
- 64 identical calls at once that neither cache holds (an embedding, a chat question): the calls the
  upstream received (goal: 1);
- a miss's overhead: embedding misses at the cache that the upstream answers from its own cache, one
  caller, p50 against calling the upstream directly with the call infercache makes (see _overhead).
  Target: at most 1 ms;
- the upstream down (30 s): the share of repeated (cached) calls answered, a miss's status and how fast it
  came; then the upstream started again, how long until each cache's first miss succeeds;
- routing (infercache alone): multi-turn conversations through two upstream infercache servers serving
  SmolLM2, routed by their first turns (upstream.routing key) against in turn (round_robin): the share of
  prompt tokens the upstreams' prefix caches held.

Both caches run as many server processes as the machine has cores (infercache's frontends, LiteLLM's
uvicorn workers), beside the upstream, Redis and the generator on the same cores. Semantic answers of an
upstream chat model are not measured here (the result says so)."""

from __future__ import annotations

import http.client
import json
import os
import statistics
import time
import uuid
from pathlib import Path

import uvloop
import yaml

from bench.http_load import post, run_http_for, run_http_load
from bench.peer_envs import PeerServer, litellm_env
from bench.sections import Run
from harness.servers import REPO, ServerProcess, UpstreamServer, free_port, link_model, worker_counters
from harness.redis_servers import RedisProcess
from harness.redis_servers import available as redis_missing

TARGETS = {"hit_p50_ratio_max": 0.5, "hit_throughput_ratio_min": 3.0, "identical_misses_upstream_calls": 1,
           "miss_overhead_ms_max": 1.0}
CALLERS = (1, 32)
IDENTICAL = 64
CHAT_TOKENS = 16
TTL_S = 3600  # both caches' entries (LiteLLM's Redis entries live 60 s unless told)
SIZES = {  # texts and questions cached, calls per load at 1 and 32 callers, overhead texts, seconds down,
           # conversations and their turns (routing)
    "dry": {"texts": 4, "questions": 2, 1: 8, 32: 32, "overhead": 3, "down_s": 1.0, "conversations": 2, "turns": 2},
    "quick": {"texts": 50, "questions": 10, 1: 200, 32: 800, "overhead": 30, "down_s": 10.0, "conversations": 4,
              "turns": 4},
    "full": {"texts": 200, "questions": 40, 1: 1000, 32: 4000, "overhead": 200, "down_s": 30.0, "conversations": 8,
             "turns": 5}}
ROUTINGS = ("key", "round_robin")
TURN_TOKENS = 8  # each answer's tokens in the routing part
NOT_MEASURED = {"semantic": "semantic answers of an upstream chat model on Banking77 (against GPTCache and "
                            "LiteLLM's semantic caches) are not part of this section yet"}


def _embedding(text: str) -> bytes:
    return post("/v1/embeddings", json.dumps({"model": "minilm", "input": text}).encode())


def _chat(question: str) -> bytes:
    return post("/v1/chat/completions", json.dumps({"model": "smollm2", "max_tokens": CHAT_TOKENS, "temperature": 0,
                                                    "messages": [{"role": "user", "content": question}]}).encode())


def _exchange(port: int, request: bytes, timeout_s: float = 60.0) -> tuple[int, str, bytes]:
    """One pre-built request on a connection of its own: (status, x-infercache-source, body); status 0
    where no answer came (refused, reset, timed out)."""
    head, body = request.split(b"\r\n\r\n", 1)
    path = head.split(b" ", 2)[1].decode()
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        connection.request("POST", path, body, {"content-type": "application/json"})
        response = connection.getresponse()
        answer = response.read()
        return response.status, response.getheader("x-infercache-source") or "", answer
    except (OSError, http.client.HTTPException):
        return 0, "", b""
    finally:
        connection.close()


def _upstream_models(root: Path) -> Path:
    for name in ("minilm", "smollm2"):
        link_model(root, name, (REPO / "models" / name / "config.yaml").read_text(), {"1": REPO / "models" / name / "1"})
    return root


def _front_models(root: Path, url: str) -> Path:
    for name, task in (("minilm", "embedding"), ("smollm2", "generate")):
        (root / name).mkdir(parents=True)
        (root / name / "config.yaml").write_text(yaml.safe_dump({
            "task": task, "serving_version": "1", "runtime": "upstream", "cache": {"ttl_s": TTL_S},
            "upstream": {"kind": "openai", "urls": [url], "model": name}}))
    return root


def _litellm_config(path: Path, url: str, redis_port: int) -> Path:
    """Both models through LiteLLM's OpenAI provider, its exact cache on Redis for the routes measured,
    entries kept as long as infercache's."""
    path.write_text(yaml.safe_dump({
        "model_list": [{"model_name": name, "litellm_params": {"model": f"openai/{name}", "api_base": url,
                                                               "api_key": "none"}} for name in ("minilm", "smollm2")],
        "litellm_settings": {"cache": True, "cache_params": {
            "type": "redis", "host": "127.0.0.1", "port": redis_port, "ttl": TTL_S,
            "supported_call_types": ["acompletion", "atext_completion", "aembedding"]}}}))
    return path


# The upstream's frontend counters that count the calls it answered (hits and misses), by route.
ASKED = {"embeddings": ("frontend.hit_exact", "frontend.forwarded"),
         "chat": ("frontend.generate_hits", "frontend.generate_forwarded")}


def _calls(upstream: UpstreamServer) -> dict[str, int]:
    return {route: upstream.asked(*counters) for route, counters in ASKED.items()}


def bench_upstream(workdir: Path, rounds: int, trial: str) -> dict:
    """trial: dry, quick or full (SIZES)."""
    why = redis_missing()
    env = litellm_env() if why is None else why
    if isinstance(env, str):
        print(f"  skipped: {env}", flush=True)
        return {"skipped": env}
    sizes = SIZES[trial]
    processes = os.cpu_count() or 1
    (workdir / "upstream").mkdir()
    upstream = UpstreamServer(workdir / "upstream", _upstream_models(workdir / "upstream" / "models"),
                              workdir / "upstream" / "engines")
    upstream.start()
    url = f"http://127.0.0.1:{upstream.http_port}/v1"
    redis = RedisProcess(workdir)
    litellm_port, front_http = free_port(), free_port()
    litellm = PeerServer([str(env.python.parent / "litellm"), "--config",
                          str(_litellm_config(workdir / "litellm.yaml", url, redis.port)), "--host", "127.0.0.1",
                          "--port", str(litellm_port), "--num_workers", str(processes)], env.env, workdir / "litellm")
    front = None
    run = uuid.uuid4().hex[:8]  # (texts no earlier run cached)
    try:
        (workdir / "front").mkdir()
        front = ServerProcess(workdir / "front", _front_models(workdir / "front-models", url), frontends=processes,
                              settings=(f"server.http_port={front_http}",))
        litellm.wait_until(lambda: _exchange(litellm_port, _embedding("ready?"), 5)[0] == 200, "LiteLLM's proxy")
        targets = {"infercache": front_http, "litellm": litellm_port}
        report = {"setup": {"processes_each": processes, "litellm": "1.81.16, exact cache on Redis", "ttl_s": TTL_S,
                            "upstream": "infercache (MiniLM, SmolLM2) through its OpenAI door, one frontend"},
                  "targets": TARGETS, "not_measured": NOT_MEASURED}
        print("  exact hits ...", flush=True)
        report["hits"], cached = _hits(targets, upstream, sizes, rounds, run)
        print("  identical misses at once ...", flush=True)
        report["identical_misses"] = _identical(targets, upstream, run)
        print("  a miss's overhead over the upstream ...", flush=True)
        report["miss_overhead"] = _overhead(targets, upstream, sizes, rounds, run)
        print(f"  the upstream down for {sizes['down_s']:.0f} s ...", flush=True)
        report["upstream_down"] = _down(targets, upstream, cached, sizes["down_s"], run)
        report["ratios"] = _ratios(report)
    finally:
        if front is not None:
            front.stop()
        litellm.stop()
        redis.stop()
        upstream.server.stop()
    print("  routing conversations by their start against in turn ...", flush=True)
    report["routing"] = _routing(workdir / "routing", sizes, run)
    return report


def _hits(targets: dict[str, int], upstream: UpstreamServer, sizes: dict, rounds: int, run: str) -> tuple[dict, list[bytes]]:
    routes = {"embeddings": [_embedding(f"{run} a text to embed, number {i}") for i in range(sizes["texts"])],
              "chat": [_chat(f"{run} question {i}: how do I change my card's PIN?") for i in range(sizes["questions"])]}
    for port in targets.values():  # each cache's misses, then its entries (infercache stores behind the reply)
        for requests in routes.values():
            for request in requests:
                _answered(port, request)
    for requests in routes.values():
        _settled(targets["infercache"], requests[-1])
    time.sleep(1.0)  # (LiteLLM writes Redis behind its reply too)
    before = _calls(upstream)
    runs: dict = {route: {name: {c: [] for c in CALLERS} for name in targets} for route in routes}
    for _ in range(rounds):
        for route, requests in routes.items():
            for callers in CALLERS:
                for name, port in targets.items():
                    result = uvloop.run(run_http_load("127.0.0.1", port, requests, concurrency=callers,
                                                      total=sizes[callers]))
                    runs[route][name][callers].append(result.summary())
    after = _calls(upstream)
    out: dict = {"upstream_calls_during": {route: after[route] - before[route] for route in routes}}
    for route in routes:
        out[route] = {name: {str(c): _median(runs[route][name][c]) for c in CALLERS} for name in targets}
    return out, routes["embeddings"]


def _answered(port: int, request: bytes) -> None:
    status, _, _ = _exchange(port, request)
    if status != 200:
        raise RuntimeError(f"the server on port {port} answered {status or 'nothing'} to {request[-120:]!r}")


def _settled(port: int, request: bytes, timeout_s: float = 30.0) -> None:
    """Until infercache answers `request` from L1 (its entry committed)."""
    deadline = time.monotonic() + timeout_s
    while _exchange(port, request)[1] != "RESULT_EXACT":
        if time.monotonic() > deadline:
            raise RuntimeError("an answer was not stored within 30 s")
        time.sleep(0.05)


def _median(summaries: list[dict]) -> dict:
    return {"p50_ms": statistics.median(s["p50_ms"] for s in summaries),
            "p99_ms": statistics.median(s["p99_ms"] for s in summaries),
            "throughput_rps": statistics.median(s["throughput_rps"] for s in summaries),
            "errors": sum(s["errors"] for s in summaries), "rounds": [s["p50_ms"] for s in summaries]}


def _identical(targets: dict[str, int], upstream: UpstreamServer, run: str) -> dict:
    out: dict = {}
    for route, make in (("embeddings", _embedding), ("chat", _chat)):
        out[route] = {}
        for name, port in targets.items():
            request = make(f"{run} {IDENTICAL} callers ask this at once through {name}: what is my balance?")
            before = _calls(upstream)[route]
            result = uvloop.run(run_http_load("127.0.0.1", port, [request], concurrency=IDENTICAL, total=IDENTICAL))
            time.sleep(0.2)
            out[route][name] = {"calls": IDENTICAL, "errors": result.errors,
                                "upstream_calls": _calls(upstream)[route] - before,
                                "p50_ms": result.summary()["p50_ms"]}
    return out


def _overhead(targets: dict[str, int], upstream: UpstreamServer, sizes: dict, rounds: int, run: str) -> dict:
    """Embedding misses at each cache (each its own texts, cached upstream first) against calling the upstream
    directly, one caller. The direct call ("direct") is the one infercache makes on a miss (the text in a
    list, base64 asked), each the first of its bytes: the upstream does the same work for both. A repeat of
    the very bytes it was primed with ("direct_repeat") skips its parsing and its answer's rendering (an
    infercache keeps both per request body); that figure is reported beside it, not subtracted."""
    ports = {"direct": upstream.http_port, "direct_repeat": upstream.http_port, **targets}
    p50: dict[str, list[float]] = {name: [] for name in ports}
    for n in range(rounds):
        texts = {name: [f"{run} round {n}: a miss through {name}, text {i}" for i in range(sizes["overhead"])]
                 for name in ports}
        for requests in texts.values():
            for text in requests:
                _answered(upstream.http_port, _embedding(text))
            _settled(upstream.http_port, _embedding(requests[-1]))
        calls = {name: [_as_infercache_asks(text) if name == "direct" else _embedding(text) for text in requests]
                 for name, requests in texts.items()}
        for name, port in ports.items():
            result = uvloop.run(run_http_load("127.0.0.1", port, calls[name], concurrency=1, total=len(calls[name])))
            p50[name].append(result.summary()["p50_ms"])
    direct = statistics.median(p50["direct"])
    return {name: {"p50_ms": statistics.median(values), "rounds": values,
                   **({"overhead_ms": round(statistics.median(values) - direct, 3)} if name in targets else {})}
            for name, values in p50.items()}


def _as_infercache_asks(text: str) -> bytes:
    """The upstream call an infercache miss makes (server/worker/upstream/clients.py, OpenAIClient.embed)."""
    return post("/v1/embeddings", json.dumps({"model": "minilm", "input": [text], "encoding_format": "base64"}).encode())


def _down(targets: dict[str, int], upstream: UpstreamServer, cached: list[bytes], seconds: float, run: str) -> dict:
    out: dict = {name: {} for name in targets}
    assert upstream.server.stop() == 0
    for name, port in targets.items():
        answered, errors = uvloop.run(run_http_for("127.0.0.1", port, cached, concurrency=4, seconds=seconds))
        began = time.monotonic()
        status, _, _ = _exchange(port, _embedding(f"{run} a miss while the upstream is down ({name})"))
        out[name].update(repeated_calls=answered + errors, repeated_answered_share=round(answered / max(1, answered + errors), 4),
                         miss_status=status, miss_answered_in_s=round(time.monotonic() - began, 3))
    upstream.start()
    back = time.monotonic()
    waiting, attempt = dict(targets), 0
    while waiting and time.monotonic() - back < 120:
        for name, port in list(waiting.items()):
            attempt += 1
            if _exchange(port, _embedding(f"{run} after the upstream came back, attempt {attempt}"), 10)[0] == 200:
                out[name]["first_miss_after_return_s"] = round(time.monotonic() - back, 3)
                del waiting[name]
        time.sleep(0.05)
    for name in waiting:
        out[name]["first_miss_after_return_s"] = None  # not within 120 s
    return out


def _routing(workdir: Path, sizes: dict, run: str) -> dict:
    """The same conversations (a long system prompt of their own, then turns) through one infercache in
    front of two upstream infercache servers, once per upstream.routing; the upstreams' prefix caches'
    counters say how much of each prompt they held."""
    models = _upstream_models(workdir / "models")
    upstreams = []
    for n in range(2):
        (workdir / f"upstream{n}").mkdir(parents=True)
        port = free_port()
        upstreams.append((ServerProcess(workdir / f"upstream{n}", models, frontends=1, engines_dir=workdir / "engines",
                                        settings=(f"server.http_port={port}",)), port))
    front_models, front = workdir / "front-models", None
    for routing in ROUTINGS:
        (front_models / routing).mkdir(parents=True)
        (front_models / routing / "config.yaml").write_text(yaml.safe_dump({
            "task": "generate", "serving_version": "1", "runtime": "upstream", "cache": {"ttl_s": TTL_S},
            "upstream": {"kind": "openai", "urls": [f"http://127.0.0.1:{port}/v1" for _, port in upstreams],
                         "model": "smollm2", "routing": routing}}))
    try:
        (workdir / "front").mkdir()
        http_port = free_port()
        front = ServerProcess(workdir / "front", front_models, frontends=1, settings=(f"server.http_port={http_port}",))
        out = {"conversations": sizes["conversations"], "turns": sizes["turns"], "answer_tokens": TURN_TOKENS}
        for routing in ROUTINGS:
            before = [_prefix_tokens(server) for server, _ in upstreams]
            for c in range(sizes["conversations"]):
                _conversation(http_port, routing, f"{run} {routing} {c}", sizes["turns"])
            after = [_prefix_tokens(server) for server, _ in upstreams]
            queried = sum(a["queried"] - b["queried"] for a, b in zip(after, before))
            held = sum(a["held"] - b["held"] for a, b in zip(after, before))
            out[routing] = {"prompt_tokens": queried, "held_tokens": held, "held_share": round(held / max(1, queried), 4),
                            "by_upstream": [a["queried"] - b["queried"] for a, b in zip(after, before)]}
        return out
    finally:
        if front is not None:
            front.stop()
        for server, _ in upstreams:
            server.stop()


def _conversation(port: int, model: str, name: str, turns: int) -> None:
    """One conversation of `turns` questions, each asked with every turn before it and their answers."""
    system = (f"You are the assistant of account {name}. " + "Answer briefly, politely and only about the "
              "account's cards, payments, transfers and fees; never give advice on anything else. " * 4)
    messages = [{"role": "system", "content": system}]
    for turn in range(turns):
        messages.append({"role": "user", "content": f"Question {turn}: what happens to my card payment number {turn}?"})
        status, _, body = _exchange(port, post("/v1/chat/completions", json.dumps(
            {"model": model, "messages": messages, "max_tokens": TURN_TOKENS, "temperature": 0}).encode()), 120)
        if status != 200:
            raise RuntimeError(f"a conversation's turn answered {status or 'nothing'}: {body[:300]!r}")
        messages.append({"role": "assistant", "content": json.loads(body)["choices"][0]["message"]["content"]})


def _prefix_tokens(server: ServerProcess) -> dict[str, int]:
    """The server's prefix caches' prompt tokens looked up, and those a tier held."""
    counters = worker_counters(server)
    queried = sum(v for k, v in counters.items() if k.endswith("prefix_tokens_queried"))
    held = sum(v for k, v in counters.items() if k.rsplit(".", 1)[-1] in
               ("prefix_tokens_memory", "prefix_tokens_host", "prefix_tokens_disk"))
    return {"queried": queried, "held": held}


def _ratios(report: dict) -> dict:
    hits = report["hits"]
    out: dict = {}
    for route in ("embeddings", "chat"):
        ours, theirs = hits[route]["infercache"], hits[route]["litellm"]
        out[f"{route}_hit_p50_ratio_1"] = round(ours["1"]["p50_ms"] / theirs["1"]["p50_ms"], 3)
        out[f"{route}_hit_throughput_ratio_32"] = round(ours["32"]["throughput_rps"] / theirs["32"]["throughput_rps"], 2)
    out["miss_overhead_ms"] = report["miss_overhead"]["infercache"]["overhead_ms"]
    out["litellm_miss_overhead_ms"] = report["miss_overhead"]["litellm"]["overhead_ms"]
    return out


def print_upstream(report: dict) -> None:
    if "skipped" in report:
        print(f"upstream: skipped: {report['skipped']}")
        return
    print("\nIn front of an upstream (infercache vs LiteLLM's proxy, exact cache on Redis)")
    for route in ("embeddings", "chat"):
        for name, by in report["hits"][route].items():
            print(f"  {route} hits {name:10s}: p50 {by['1']['p50_ms']:.2f} ms at 1 caller, "
                  f"{by['32']['throughput_rps']:,.0f}/s at 32")
    ratios = report["ratios"]
    print(f"  hit p50 ratio (target <= {TARGETS['hit_p50_ratio_max']}): embeddings {ratios['embeddings_hit_p50_ratio_1']}x, "
          f"chat {ratios['chat_hit_p50_ratio_1']}x; throughput ratio at 32 (target >= "
          f"{TARGETS['hit_throughput_ratio_min']}): embeddings {ratios['embeddings_hit_throughput_ratio_32']}x, "
          f"chat {ratios['chat_hit_throughput_ratio_32']}x")
    for route, by in report["identical_misses"].items():
        print(f"  {IDENTICAL} identical {route} misses at once: upstream calls " +
              ", ".join(f"{name} {row['upstream_calls']}" for name, row in by.items()))
    print(f"  a miss's overhead over the upstream at p50: infercache {ratios['miss_overhead_ms']} ms, "
          f"LiteLLM {ratios['litellm_miss_overhead_ms']} ms (target <= {TARGETS['miss_overhead_ms_max']} ms)")
    routing = report["routing"]
    print(f"  {routing['conversations']} conversations of {routing['turns']} turns over two upstreams: prompt tokens "
          f"their prefix caches held, routed by the conversation's start {routing['key']['held_share']:.1%}, in turn "
          f"{routing['round_robin']['held_share']:.1%}")
    for name, row in report["upstream_down"].items():
        print(f"  upstream down, {name}: {row['repeated_answered_share']:.1%} of {row['repeated_calls']} repeated calls "
              f"answered; a miss: status {row['miss_status']} in {row['miss_answered_in_s']} s; first miss after "
              f"it returned: {row['first_miss_after_return_s']} s")


def section(run: Run) -> None:
    print("benchmarking infercache in front of an upstream server against LiteLLM's proxy cache ...", flush=True)
    (run.workdir / "upstream").mkdir()
    run.report["upstream"] = bench_upstream(run.workdir / "upstream", run.rounds, run.size)
    print_upstream(run.report["upstream"])
