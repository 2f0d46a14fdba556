"""Models computed by another server (`runtime: upstream`), through real servers on both sides: a second
infercache serving MiniLM is the upstream, called through its native API (kind infercache), its
OpenAI-compatible door (kind openai) and its KServe v2 door (kind kserve), with a token. The front server
has no MiniLM files: every miss it answers was computed upstream."""

from __future__ import annotations

import http.server
import json
import os
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
import yaml

from tests.conftest import MINILM_CONFIG, MODEL_VERSION_DIR
from tests.helpers import serving_upstream, unique, wait_cached, wait_for
from harness.servers import ServerProcess, free_port

TOKEN = f"upstream-{os.urandom(16).hex()}"
KINDS = ("infercache", "openai", "kserve")
SHORT_TTL_S = 1
TEXTS_ASKED = ("frontend.hit_exact", "frontend.forwarded")  # the texts the upstream has been asked


def _front_config(kind: str, grpc_port: int, http_port: int, cache: dict | None = None) -> str:
    url = f"http://127.0.0.1:{http_port}/v1" if kind == "openai" else f"http://127.0.0.1:{grpc_port}"
    upstream = {"kind": kind, "urls": [url], "model": "minilm", "credential_file": "TOKEN_FILE",
                "timeout_s": 10, "retries": 1, "retry_backoff_ms": 20, "breaker_failures": 2,
                "breaker_open_s": 1.0}
    return yaml.safe_dump({"task": "embedding", "serving_version": "1", "runtime": "upstream",
                           "upstream": upstream, "cache": cache or {"ttl_s": 600}})


@pytest.fixture(scope="module")
def upstream(tmp_path_factory, engines_dir):
    yield from serving_upstream(tmp_path_factory, engines_dir, TOKEN, "minilm", MINILM_CONFIG, MODEL_VERSION_DIR)


@pytest.fixture(scope="module")
def front(tmp_path_factory, upstream, engines_dir):
    """An infercache with one model per kind, all computed by `upstream`; no model files of its own."""
    work = tmp_path_factory.mktemp("front")
    token_file = work / "upstream.token"
    token_file.write_text(TOKEN + "\n")
    models = work / "models"
    for name, kind, cache in [*((f"up-{kind}", kind, None) for kind in KINDS),
                              ("up-stale", "infercache", {"ttl_s": SHORT_TTL_S, "stale_if_error_s": 600})]:
        config = _front_config(kind, upstream.grpc_port, upstream.http_port, cache).replace("TOKEN_FILE", str(token_file))
        (models / name).mkdir(parents=True)
        (models / name / "config.yaml").write_text(config)
    metrics_port = free_port()
    server = ServerProcess(work, models, engines_dir=engines_dir, frontends=1,
                           settings=(f"server.metrics_port={metrics_port}",))
    server.metrics_port = metrics_port
    yield server
    server.stop()


def _metric(server, line_start: str) -> float:
    """The sum of /metrics samples whose line starts with `line_start` (series name and labels)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10) as response:
        lines = response.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(line_start))


@pytest.mark.parametrize("kind", KINDS)
def test_answers_equal_the_upstreams_and_a_repeat_is_a_hit(front, upstream, kind):
    text = unique(f"How do I return an item ({kind})?")
    with upstream.server.client() as direct:
        expected = direct.infer("minilm", text).outputs["embedding"]
    with front.client() as client:
        first = client.infer(f"up-{kind}", text)
        assert first.source == "MISS"
        np.testing.assert_allclose(first.outputs["embedding"], expected, rtol=1e-5, atol=1e-6)
        wait_cached(client, f"up-{kind}", text)
        again = client.infer(f"up-{kind}", text)
        assert again.source == "RESULT_EXACT"
        np.testing.assert_array_equal(again.outputs["embedding"], first.outputs["embedding"])
        batch = client.infer_batch(f"up-{kind}", [unique("first of a batch"), text, unique("third of a batch")])
        assert [r.source for r in batch] == ["MISS", "RESULT_EXACT", "MISS"]
    assert f"upstream-{kind}" in {e.runtime for e in front.stats().worker.engines}
    model = f'model="up-{kind}"'
    wait_for(lambda: _metric(front, 'infercache_upstream_calls_total{' + model) >= 2, 10, "the calls in /metrics")
    assert _metric(front, 'infercache_upstream_call_seconds_count{' + model) >= 2
    assert _metric(front, 'infercache_upstream_in_rotation{' + model) == 1


@pytest.mark.parametrize("kind", ("infercache", "openai"))
def test_identical_concurrent_calls_make_one_upstream_call(front, upstream, kind):
    text = unique(f"thirty-two callers at once ({kind})")
    before = upstream.asked(*TEXTS_ASKED)
    with front.client(timeout_s=30) as client, ThreadPoolExecutor(32) as pool:
        answers = list(pool.map(lambda _: client.infer(f"up-{kind}", text), range(32)))
    assert {a.source for a in answers} <= {"MISS", "COALESCED", "RESULT_EXACT"}
    assert upstream.asked(*TEXTS_ASKED) - before == 1


def test_tenants_never_share_and_the_upstream_keeps_them_apart(front, upstream):
    text = unique("a tenant's own question")
    with front.client() as client:
        client.infer("up-infercache", text, tenant="acme")
        wait_cached(client, "up-infercache", text, tenant="acme")
        assert client.infer("up-infercache", text, tenant="acme").source == "RESULT_EXACT"
        assert client.infer("up-infercache", text, tenant="globex").source == "MISS"
    with upstream.server.client() as direct:  # the upstream stored it under each tenant too
        wait_cached(direct, "minilm", text, tenant="acme")
        wait_cached(direct, "minilm", text, tenant="globex")


def test_the_upstream_down_cached_answers_still_served_misses_refused_fast_then_recovery(front, upstream):
    cached = unique("asked before the upstream went down")
    expired = unique("expired while the upstream is down")
    with front.client(timeout_s=30) as client:
        client.infer("up-infercache", cached)
        wait_cached(client, "up-infercache", cached)
        first = client.infer("up-stale", expired)
        wait_cached(client, "up-stale", expired)
        time.sleep(SHORT_TTL_S + 0.2)
        assert client.infer("up-stale", expired).source == "MISS"  # expired, and the upstream answers: computed
        wait_cached(client, "up-stale", expired)
        time.sleep(SHORT_TTL_S + 0.2)
        assert upstream.server.stop() == 0
        stale = client.infer("up-stale", expired)  # expired, and the upstream is down: the entry, marked stale
        assert stale.source == "RESULT_EXACT" and stale.stale and stale.age_s > SHORT_TTL_S
        np.testing.assert_array_equal(stale.outputs["embedding"], first.outputs["embedding"])
        with pytest.raises(grpc.RpcError) as never_cached:  # nothing to fall back on: the upstream's error
            client.infer("up-stale", unique("never asked before"))
        assert never_cached.value.code() == grpc.StatusCode.UNAVAILABLE
        assert client.infer("up-infercache", cached).source == "RESULT_EXACT"
        refusals = []
        for n in range(4):
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as refused:
                client.infer("up-infercache", unique(f"a miss while it is down {n}"))
            refusals.append(time.monotonic() - started)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert f"127.0.0.1:{upstream.grpc_port}" in refused.value.details()
        assert "out of rotation" in refused.value.details()  # the breaker answers without calling
        wait_for(lambda: _metric(front, 'infercache_upstream_in_rotation{model="up-infercache"') == 0, 10,
                 "the server out of rotation in /metrics")
        assert _metric(front, 'infercache_upstream_calls_total{model="up-infercache"') > \
            _metric(front, 'infercache_upstream_calls_total{model="up-infercache",outcome="ok"')
        upstream.start()
        wait_for(lambda: _answers(client, "up-infercache"), 30, "a miss answered once the upstream is back")


def _answers(client, model: str) -> bool:
    try:
        return client.infer(model, unique("after the upstream came back")).source == "MISS"
    except grpc.RpcError:
        return False


def test_a_wrong_credential_is_a_clear_error_and_no_credential_is_logged_or_stored(tmp_path, upstream, engines_dir):
    models = tmp_path / "models"
    (models / "up-wrong").mkdir(parents=True)
    (tmp_path / "wrong.token").write_text("not-the-token")
    (models / "up-wrong" / "config.yaml").write_text(
        _front_config("openai", upstream.grpc_port, upstream.http_port).replace("TOKEN_FILE", str(tmp_path / "wrong.token")))
    server = ServerProcess(tmp_path, models, engines_dir=engines_dir, frontends=1)
    try:
        with server.client() as client, pytest.raises(grpc.RpcError) as refused:
            client.infer("up-wrong", unique("with the wrong token"))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "credential" in refused.value.details() and "not-the-token" not in refused.value.details()
    finally:
        server.stop()
    assert "not-the-token" not in server.log_text()
    for path in (tmp_path / "cache").rglob("*"):
        if path.is_file():
            assert b"not-the-token" not in path.read_bytes(), path


def test_an_unreadable_credential_stops_the_start_with_one_line(tmp_path, engines_dir):
    import subprocess
    import sys

    from harness.servers import REPO

    models = tmp_path / "models"
    (models / "up").mkdir(parents=True)
    config = _front_config("openai", 1, 2).replace('credential_file: TOKEN_FILE', "credential_env: INFERCACHE_TEST_UNSET")
    (models / "up" / "config.yaml").write_text(config)
    env = {k: v for k, v in os.environ.items() if k != "INFERCACHE_TEST_UNSET"}
    done = subprocess.run([sys.executable, "-m", "server", "serve", "--models-dir", str(models), "--port", str(free_port())],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "$INFERCACHE_TEST_UNSET" in done.stderr and "Traceback" not in done.stderr


class _Faulty(http.server.BaseHTTPRequestHandler):
    """An OpenAI-compatible embeddings route that fails as its model's name says: `status-N` answers HTTP N
    with OpenAI's error object, `malformed` a body that is not JSON, `short` one embedding too few, `slow`
    nothing for 5 s. Real servers fail these ways now and then; none does on demand."""

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        model, texts = body["model"], body["input"]
        if model.startswith("status-"):
            status, payload = int(model[7:]), json.dumps({"error": {"message": f"upstream says {model}"}}).encode()
        elif model == "malformed":
            status, payload = 200, b"<html>not json"
        elif model == "short":
            status, payload = 200, json.dumps({"data": [{"index": 0, "embedding": [0.5, 0.5]}] * (len(texts) - 1)}).encode()
        else:
            time.sleep(5)
            status, payload = 200, b"{}"
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


def test_each_upstream_failure_is_a_clear_status_with_its_reason(tmp_path, engines_dir):
    faulty = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Faulty)
    threading.Thread(target=faulty.serve_forever, daemon=True).start()
    models = tmp_path / "models"
    cases = {"status-429": (grpc.StatusCode.RESOURCE_EXHAUSTED, "429"),
             "status-500": (grpc.StatusCode.UNAVAILABLE, "HTTP 500: upstream says status-500"),
             "status-400": (grpc.StatusCode.INVALID_ARGUMENT, "refused the input"),
             "malformed": (grpc.StatusCode.UNAVAILABLE, "not JSON"),
             "short": (grpc.StatusCode.UNAVAILABLE, "embeddings for"),
             "slow": (grpc.StatusCode.DEADLINE_EXCEEDED, "no answer within")}
    for name in cases:
        config = yaml.safe_load(_front_config("openai", 1, faulty.server_port))
        config["upstream"].update(model=name, timeout_s=1.5, retries=0, breaker_failures=100)
        del config["upstream"]["credential_file"]
        (models / name).mkdir(parents=True)
        (models / name / "config.yaml").write_text(yaml.safe_dump(config))
    server = ServerProcess(tmp_path, models, engines_dir=engines_dir, frontends=1)
    try:
        with server.client(timeout_s=30) as client:
            for name, (code, says) in cases.items():
                with pytest.raises(grpc.RpcError) as failed:
                    client.infer_batch(name, [unique("one"), unique("two")])
                assert failed.value.code() == code and says in failed.value.details(), (name, failed.value)
                assert f"127.0.0.1:{faulty.server_port}" in failed.value.details()
    finally:
        server.stop()
        faulty.shutdown()
    assert "Traceback" not in server.log_text()
