"""A generative model computed by another server (`runtime: upstream`, kind openai), through real servers on
both sides: a second infercache serving SmolLM2 is the upstream, called through its OpenAI-compatible chat
and text completions routes (streamed), with a token. The front server has no SmolLM2 files: every answer
it gives was generated upstream, and it is called through its own doors (native gRPC, and OpenAI's API with
the `openai` package)."""

from __future__ import annotations

import http.server
import json
import os
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest
import yaml

from infercache.v1 import infercache_pb2 as pb
from tests.helpers import serving_upstream, unique, wait_for
from harness.servers import ServerProcess, free_port
from tests.test_generate import GEN_CONFIG, GEN_VERSION_DIR

TOKEN = f"upstream-{os.urandom(16).hex()}"
MODEL = "chat"  # through the upstream's OpenAI door (kind openai)
NATIVE = "chat-native"  # through its native API (kind infercache)
GENERATIONS_ASKED = ("frontend.generate_hits", "frontend.generate_forwarded")  # what the upstream was asked


@pytest.fixture(scope="module")
def upstream(tmp_path_factory, engines_dir):
    yield from serving_upstream(tmp_path_factory, engines_dir, TOKEN, "smollm2", GEN_CONFIG, GEN_VERSION_DIR)


@pytest.fixture(scope="module")
def front(tmp_path_factory, upstream, engines_dir):
    """An infercache whose one generative model is computed by `upstream`; no model files of its own."""
    work = tmp_path_factory.mktemp("front")
    token_file = work / "upstream.token"
    token_file.write_text(TOKEN + "\n")
    models = work / "models"
    for name, kind, url in ((MODEL, "openai", f"http://127.0.0.1:{upstream.http_port}/v1"),
                            (NATIVE, "infercache", f"http://127.0.0.1:{upstream.grpc_port}")):
        (models / name).mkdir(parents=True)
        (models / name / "config.yaml").write_text(yaml.safe_dump({
            "task": "generate", "serving_version": "1", "runtime": "upstream",
            "upstream": {"kind": kind, "urls": [url], "model": "smollm2", "credential_file": str(token_file),
                         "timeout_s": 20, "retries": 1, "retry_backoff_ms": 20, "breaker_failures": 2,
                         "breaker_open_s": 1.0},
            "generate": {"max_new_tokens": 32}, "cache": {"ttl_s": 600}}))
    config = yaml.safe_load((models / MODEL / "config.yaml").read_text())
    config["upstream"].update(input_cost_per_mtok=1000.0, output_cost_per_mtok=4000.0)
    (models / MODEL / "config.yaml").write_text(yaml.safe_dump(config))
    http_port, metrics_port = free_port(), free_port()
    server = ServerProcess(work, models, engines_dir=engines_dir, frontends=1,
                           settings=(f"server.http_port={http_port}", f"server.metrics_port={metrics_port}"))
    server.http_port, server.metrics_port = http_port, metrics_port
    yield server
    server.stop()


def _metric(server, series: str) -> float:
    """A series' value in the server's /metrics (0 where it has none yet)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10) as response:
        for line in response.read().decode().splitlines():
            if line.startswith(series + " "):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def _openai(server, **options) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="unused", max_retries=0,
                         timeout=60, **options)


def test_answers_equal_the_upstreams_streamed_as_it_streams_and_a_repeat_replays_whole(front, upstream):
    question = unique("How do I reset my password?")
    before = upstream.asked(*GENERATIONS_ASKED)
    with front.client(timeout_s=60) as client:
        pieces = list(client.generate_stream(MODEL, question, max_new_tokens=16))
        assert len(pieces) >= 3  # the upstream's pieces, passed on as they came (a miss there too), then the end
        with upstream.server.client() as direct:  # (its answer stored there by now: a hit, the same text)
            expected = direct.generate("smollm2", question, max_new_tokens=16)
        first = "".join(p.text for p in pieces)
        end = pieces[-1].end
        assert first == expected.text and end.cache.source == 0  # MISS
        assert end.completion_tokens > 0 and end.prompt_tokens > 0  # the upstream's usage
        assert pb.GenerationEnd.FinishReason.Name(end.finish_reason) == expected.finish_reason
        wait_for(lambda: client.generate(MODEL, question, max_new_tokens=16).source == "RESULT_EXACT", 10,
                 "the answer to be stored")
        again = list(client.generate_stream(MODEL, question, max_new_tokens=16))
        assert len(again) == 1 and again[0].text == first  # a hit: the whole answer in one message
    assert upstream.asked(*GENERATIONS_ASKED) - before == 2  # the front's one call, and the direct one
    series = 'infercache_upstream_tokens_saved_total{kind="%s",model="chat"}'
    wait_for(lambda: _metric(front, series % "output") >= 2 * end.completion_tokens, 15, "the hits in /metrics")
    saved = {kind: _metric(front, series % kind) for kind in ("input", "output")}  # (the two hits, at least)
    assert saved["input"] >= 2 * end.prompt_tokens
    cost = _metric(front, 'infercache_upstream_cost_saved_total{model="chat"}')
    assert cost == pytest.approx((saved["input"] * 1000 + saved["output"] * 4000) / 1e6)
    assert "upstream-openai" in {e.runtime for e in front.stats().worker.engines}


def test_the_openai_door_in_front_of_an_openai_upstream_chat_and_completions(front, upstream):
    client = _openai(front)
    question = unique("What is the capital of France?")
    messages = [{"role": "system", "content": "Answer in one sentence."}, {"role": "user", "content": question}]
    streamed = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices)
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12)
    assert whole.choices[0].message.content == text and text
    up = openai.OpenAI(base_url=f"http://127.0.0.1:{upstream.http_port}/v1", api_key=TOKEN, max_retries=0, timeout=60)
    assert up.chat.completions.create(model="smollm2", messages=messages, max_tokens=12).choices[0].message.content == text
    prompt = unique("Once upon a time")
    completion = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8)
    assert completion.choices[0].text == up.completions.create(model="smollm2", prompt=prompt, max_tokens=8).choices[0].text


def test_through_the_upstreams_native_api_streamed_with_the_tenant_passed_on(front, upstream):
    question = unique("Which cards do you accept?")
    with front.client(timeout_s=60) as client:
        pieces = list(client.generate_stream(NATIVE, question, max_new_tokens=16, tenant="acme"))
        text = "".join(p.text for p in pieces)
        assert len(pieces) >= 2 and pieces[-1].end.cache.source == 0 and text  # as the upstream streamed it
        wait_for(lambda: client.generate(NATIVE, question, max_new_tokens=16, tenant="acme").source == "RESULT_EXACT",
                 10, "the answer to be stored")
    with upstream.server.client() as direct:  # stored upstream under the caller's tenant, as generated
        stored = direct.generate("smollm2", question, max_new_tokens=16, tenant="acme")
        assert stored.source == "RESULT_EXACT" and stored.text == text
        assert direct.generate("smollm2", question, max_new_tokens=16, tenant="globex").source == "MISS"


def test_identical_concurrent_generations_make_one_upstream_call(front, upstream):
    question = unique("sixteen callers ask at once")
    before = upstream.asked(*GENERATIONS_ASKED)
    with front.client(timeout_s=60) as client, ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda _: client.generate(MODEL, question, max_new_tokens=16), range(16)))
    assert {a.source for a in answers} <= {"MISS", "COALESCED", "RESULT_EXACT"}
    assert len({a.text for a in answers}) == 1
    assert upstream.asked(*GENERATIONS_ASKED) - before == 1


def test_tenants_never_share(front, upstream):
    question = unique("a tenant's own question")
    with front.client(timeout_s=60) as client:
        client.generate(MODEL, question, max_new_tokens=8, tenant="acme")
        wait_for(lambda: client.generate(MODEL, question, max_new_tokens=8, tenant="acme").source == "RESULT_EXACT",
                 10, "the answer to be stored")
        assert client.generate(MODEL, question, max_new_tokens=8, tenant="globex").source == "MISS"


def test_the_upstream_down_cached_answers_still_served_misses_refused_fast_then_recovery(front, upstream):
    cached = unique("asked before the upstream went down")
    with front.client(timeout_s=60) as client:
        answer = client.generate(MODEL, cached, max_new_tokens=8)
        wait_for(lambda: client.generate(MODEL, cached, max_new_tokens=8).source == "RESULT_EXACT", 10,
                 "the answer to be stored")
        assert upstream.server.stop() == 0
        assert client.generate(MODEL, cached, max_new_tokens=8).text == answer.text
        for n in range(3):
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as refused:
                client.generate(MODEL, unique(f"a miss while it is down {n}"), max_new_tokens=8)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert f"127.0.0.1:{upstream.http_port}" in refused.value.details()
            assert time.monotonic() - started < 10
        with pytest.raises(openai.APIStatusError) as over_http:
            _openai(front).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": unique("down")}],
                                                    max_tokens=8)
        assert over_http.value.status_code == 503
        upstream.start()
        wait_for(lambda: _answers(client), 60, "a miss answered once the upstream is back")
    assert TOKEN not in front.log_text()


def _answers(client) -> bool:
    try:
        return client.generate(MODEL, unique("after the upstream came back"), max_new_tokens=4).source == "MISS"
    except grpc.RpcError:
        return False


class _FaultyChat(http.server.BaseHTTPRequestHandler):
    """An OpenAI-compatible chat completions route that fails as its model's name says: `status-N` answers
    HTTP N with OpenAI's error object, `malformed` a page that is no event stream, `cut` two pieces and then
    closes the connection, `slow` nothing for 5 s. Real servers fail these ways now and then; none does on
    demand. It counts the calls of each model."""

    calls: dict[str, int] = {}

    def do_POST(self):
        model = json.loads(self.rfile.read(int(self.headers["content-length"])))["model"]
        self.calls[model] = self.calls.get(model, 0) + 1
        if model == "slow":
            time.sleep(5)
        if model.startswith("status-"):
            status, kind = int(model[7:]), "application/json"
            payload = json.dumps({"error": {"message": f"upstream says {model}"}}).encode()
        elif model == "malformed":
            status, kind, payload = 200, "text/html", b"<html>not an event stream</html>\n"
        else:
            piece = {"choices": [{"index": 0, "delta": {"content": "Half an"}, "finish_reason": None}]}
            status, kind, payload = 200, "text/event-stream", b"data: %s\n\n" % json.dumps(piece).encode() * 2
        self.send_response(status)
        self.send_header("content-type", kind)
        self.end_headers()
        self.wfile.write(payload)  # (HTTP/1.0: the connection closes after it)

    def log_message(self, *args):
        pass


def test_each_upstream_failure_is_a_clear_status_and_a_cut_answer_is_never_stored(tmp_path, engines_dir):
    faulty = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FaultyChat)
    threading.Thread(target=faulty.serve_forever, daemon=True).start()
    models = tmp_path / "models"
    cases = {"status-429": (grpc.StatusCode.RESOURCE_EXHAUSTED, "429"),
             "status-500": (grpc.StatusCode.UNAVAILABLE, "HTTP 500: upstream says status-500"),
             "status-400": (grpc.StatusCode.INVALID_ARGUMENT, "refused the input"),
             "malformed": (grpc.StatusCode.UNAVAILABLE, "no event"),
             "cut": (grpc.StatusCode.UNAVAILABLE, "before its [DONE]"),
             "slow": (grpc.StatusCode.DEADLINE_EXCEEDED, "no answer within")}
    for name in cases:
        (models / name).mkdir(parents=True)
        (models / name / "config.yaml").write_text(yaml.safe_dump({
            "task": "generate", "serving_version": "1", "runtime": "upstream", "cache": {"ttl_s": 600},
            "upstream": {"kind": "openai", "urls": [f"http://127.0.0.1:{faulty.server_port}/v1"], "model": name,
                         "timeout_s": 1.5, "retries": 0, "breaker_failures": 100}}))
    server = ServerProcess(tmp_path, models, engines_dir=engines_dir, frontends=1)
    try:
        with server.client(timeout_s=30) as client:
            for name, (code, says) in cases.items():
                received = []
                with pytest.raises(grpc.RpcError) as failed:
                    for message in client.generate_stream(name, "the same question each time"):
                        received.append(message.text)
                assert failed.value.code() == code and says in failed.value.details(), (name, failed.value)
                assert f"127.0.0.1:{faulty.server_port}" in failed.value.details()
                assert "".join(received) == ("Half anHalf an" if name == "cut" else ""), name  # what it streamed
            with pytest.raises(grpc.RpcError):  # the cut answer was not stored: asked again, it is computed again
                client.generate("cut", "the same question each time")
            assert _FaultyChat.calls["cut"] == 2
    finally:
        server.stop()
        faulty.shutdown()
    assert "Traceback" not in server.log_text()
