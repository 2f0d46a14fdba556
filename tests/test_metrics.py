"""/metrics end to end: a real server (2 frontends, 1 worker) scraped by a real Prometheus every second;
after known traffic, Prometheus' HTTP API must report exactly it. Also the alert rules evaluated against
those series, every dashboard panel's query, hot keys (GetHotKeys, `cache hot`) and `cache warm`.
"""

from __future__ import annotations

import json
import os
from collections import Counter
import signal
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest

from cachestore.keys import KEY_BYTES
from harness import prometheus_server
from harness.servers import ServerProcess, free_port, link_model
from harness.prometheus_server import PrometheusProcess, sample_value
from server.frontend.metrics import FrontendMetrics
from server.frontend.hot_keys import HotKeys, merge_tops
from server.shared.telemetry import Recorder
from tests.conftest import MINILM_CONFIG, MODEL_VERSION_DIR, REPO
from tests.test_generate import GEN_CONFIG, GEN_VERSION_DIR
from tests.helpers import unique, wait_cached, wait_for

sys.path.insert(0, str(REPO / "deploy" / "grafana"))
from queries import panel_queries  # noqa: E402
from render import render  # noqa: E402

needs_prometheus = pytest.mark.skipif(prometheus_server.available() is not None,
                                      reason=prometheus_server.available() or "")
ALERTS = REPO / "deploy" / "prometheus" / "alerts.yml"
DASHBOARD = REPO / "deploy" / "grafana" / "infercache.json"


@pytest.fixture(scope="module")
def observed(tmp_path_factory, faq_models, engines_dir):
    """(server, prometheus): /metrics on, hot keys with texts for `minilm`, scraped every second."""
    root = tmp_path_factory.mktemp("metrics-models")
    link_model(root, "minilm", MINILM_CONFIG + "hot_keys:\n  keep_text: true\n", {"1": MODEL_VERSION_DIR})
    link_model(root, "faq", (faq_models / "faq" / "config.yaml").read_text(), {"1": faq_models / "faq" / "1"})
    if (GEN_VERSION_DIR / "decoder.onnx").is_file():  # the generation and prefix cache panels' series
        link_model(root, "smollm2", GEN_CONFIG + "prefix_cache: {block_tokens: 16}\n", {"1": GEN_VERSION_DIR})
    port = free_port()
    server = ServerProcess(tmp_path_factory.mktemp("metrics-server"), root, engines_dir=engines_dir,
                           settings=(f"server.metrics_port={port}",))
    prometheus = PrometheusProcess(tmp_path_factory.mktemp("prometheus"), [f"127.0.0.1:{port}"], rule_files=[ALERTS])
    yield server, prometheus, port
    prometheus.stop()
    assert server.stop() == 0, server.log_text()


def value(prometheus: PrometheusProcess, expr: str) -> float:
    found = prometheus.query(expr)
    return sum(sample_value(s) for s in found)


def settled(prometheus: PrometheusProcess, expr: str, expected: float, timeout: float = 20.0) -> float:
    """Waits until the expression's value (summed over series) is `expected` (figures lag ~2 s)."""
    found = prometheus.wait_for(expr, lambda r: abs(sum(sample_value(s) for s in r) - expected) < 1e-9,
                                timeout=timeout)
    return sum(sample_value(s) for s in found)


@needs_prometheus
def test_traffic_is_counted_as_sent(observed):
    server, prometheus, port = observed
    prometheus.wait_for('up{job="infercache"}', lambda r: bool(r) and r[0]["value"][1] == "1", timeout=30)
    texts = [unique(f"metrics text {n}") for n in range(6)]
    with server.client() as client:
        for text in texts:  # 6 misses, not cached
            assert client.infer("minilm", text).source == "MISS"
        for text in texts:  # 6 exact hits
            wait_cached(client, "minilm", text)  # (ONLY_IF_CACHED hits: 6 more, counted below)
            assert client.infer("minilm", text).source == "RESULT_EXACT"
        fresh = [unique("metrics batch a"), unique("metrics batch b")]
        batch = client.infer_batch("minilm", texts[:2] + fresh)  # 2 hits + 2 misses
        assert [r.source for r in batch] == ["RESULT_EXACT"] * 2 + ["MISS"] * 2
        for _ in range(2):
            assert client.infer("minilm", texts[0], mode="BYPASS").source == "MISS"
        assert client.infer("minilm", texts[1], max_age_s=0).source == "MISS"  # too old for this request
        with pytest.raises(grpc.RpcError) as refused:
            client.infer("no-such-model", "x")
        assert refused.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.RpcError) as not_cached:
            client.infer("minilm", unique("never sent"), mode="ONLY_IF_CACHED")
        assert not_cached.value.code() == grpc.StatusCode.FAILED_PRECONDITION

    ok = 'infercache_requests_total{model="minilm",code="OK"'
    assert settled(prometheus, f'{ok},source="miss"}}', 6 + 2 + 2 + 1) == 11
    assert settled(prometheus, f'{ok},source="result_exact"}}', 6 + 6 + 2) == 14
    assert settled(prometheus, 'infercache_requests_total{model="unknown",code="NOT_FOUND",source="none"}', 1) == 1
    # (wait_cached polls with ONLY_IF_CACHED until the write-behind committed: some of those failed too)
    assert prometheus.wait_for('infercache_requests_total{model="minilm",code="FAILED_PRECONDITION",source="none"}',
                               lambda r: bool(r) and sample_value(r[0]) >= 1)
    misses = {s["metric"]["reason"]: sample_value(s)
              for s in prometheus.query('infercache_misses_total{model="minilm"}')}
    assert misses == {"not_cached": 8, "bypass": 2, "too_old": 1}
    # One latency observation per call: 6 + 6 + 1 + 2 + 1 miss/hit calls, labelled by costliest source.
    assert value(prometheus, 'infercache_request_duration_seconds_count{model="minilm",source="miss"}') == 6 + 1 + 2 + 1
    assert value(prometheus, 'infercache_request_duration_seconds_count{model="minilm",source="result_exact"}') == 12
    # Engine work: every miss computed once, in launches of at least one text.
    assert settled(prometheus, 'infercache_batch_size_sum{model="minilm"}', 11) == 11  # (the worker's figures)
    assert value(prometheus, 'infercache_compute_seconds_total{model="minilm"}') > 0
    saved = prometheus.wait_for('infercache_compute_seconds_saved_total{model="minilm"}',
                                lambda r: bool(r) and sample_value(r[0]) > 0)
    per_hit = sample_value(saved[0]) / 14
    per_miss = value(prometheus, 'infercache_compute_seconds_total{model="minilm"}') / 11
    assert 0.05 * per_miss < per_hit < 20 * per_miss  # the same engine's times, estimated per bucket
    # (the entries gauge is read off the store behind the writes: it reaches the 8 answers stored)
    prometheus.wait_for('infercache_store_entries{store="results"}', lambda r: bool(r) and sample_value(r[0]) >= 8)
    assert value(prometheus, 'infercache_store_budget_bytes{store="results"}') > 0
    for series in ('infercache_store_write_backlog{store="results"}', 'infercache_store_writes_dropped_total{store="results"}'):
        assert prometheus.query(series), series  # exposed, and 0 once every write is committed, none dropped
        assert settled(prometheus, series, 0) == 0
    assert value(prometheus, 'infercache_queue_depth{model="minilm"}') == 0
    assert value(prometheus, 'infercache_processes{role="frontend"}') == 2
    assert value(prometheus, 'infercache_processes{role="worker"}') == 1
    phases = {r["metric"]["phase"] for r in prometheus.query('infercache_engine_warmup_seconds{model="minilm"}')}
    assert {"load", "warmup"} <= phases, phases
    start = {r["metric"]["phase"]: sample_value(r) for r in prometheus.query('infercache_worker_start_seconds{worker="0"}')}
    assert {"imports", "runtime_import", "device_init", "ready", "warm"} <= set(start), start
    assert 0 < start["imports"] < start["ready"] <= start["warm"], start


@needs_prometheus
def test_semantic_searches_and_rejections(observed):
    server, prometheus, _ = observed
    with server.client() as client:
        assert client.infer("faq", "How do I return an item?").source == "MISS"
        deadline = time.monotonic() + 20
        while server.stats().worker.counters["semantic.indexed"] < 1:
            assert time.monotonic() < deadline, "the FAQ answer was never indexed"
            time.sleep(0.05)
        # Nothing like it is cached: the nearest neighbour is found, and not trusted.
        assert client.infer("faq", unique("the migration patterns of arctic terns")).source == "MISS"
        # BYPASS searches too (its result is indexed), but nothing was rejected: the call said bypass.
        assert client.infer("faq", unique("the migration of swifts"), mode="BYPASS").source == "MISS"
    assert settled(prometheus, 'infercache_misses_total{model="faq",reason="semantic_rejected"}', 1) == 1
    assert settled(prometheus, 'infercache_misses_total{model="faq",reason="bypass"}', 1) == 1
    # (the worker's own figures: published a second after the frontend's, so waited for too)
    prometheus.wait_for('infercache_semantic_nearest_similarity_count{model="faq"}',
                        lambda r: bool(r) and sum(sample_value(x) for x in r) >= 1)
    prometheus.wait_for("infercache_semantic_index_entries", lambda r: bool(r) and sample_value(r[0]) >= 1)


@needs_prometheus
def test_counters_survive_a_frontend_restart(observed):
    server, prometheus, _ = observed
    with server.client() as client:
        for _ in range(5):
            client.infer("minilm", unique("before the kill"))
    time.sleep(2.5)  # published (each second) and scraped
    before = value(prometheus, "sum(infercache_requests_total)")
    frontend = server.stats().frontend.pid
    os.kill(frontend, signal.SIGKILL)
    settled(prometheus, 'infercache_process_restarts_total{role="frontend"}', 1)
    prometheus.wait_for('infercache_processes{role="frontend"}', lambda r: bool(r) and sample_value(r[0]) == 2)
    time.sleep(2.5)  # the new frontend has published what it adopted
    assert value(prometheus, "sum(infercache_requests_total)") == before
    assert value(prometheus, "sum(resets(infercache_requests_total[1m]))") == 0


@needs_prometheus
def test_alert_rules_evaluate_on_real_series(observed):
    _, prometheus, _ = observed
    with urllib.request.urlopen(f"{prometheus.url}/api/v1/rules", timeout=10) as response:
        groups = json.load(response)["data"]["groups"]
    rules = [rule for group in groups for rule in group["rules"]]
    assert rules, "alerts.yml loaded no rules"
    deadline = time.monotonic() + 10
    while any(rule.get("health") == "unknown" for rule in rules) and time.monotonic() < deadline:
        time.sleep(0.5)  # evaluated each second
        with urllib.request.urlopen(f"{prometheus.url}/api/v1/rules", timeout=10) as response:
            rules = [r for g in json.load(response)["data"]["groups"] for r in g["rules"]]
    assert [(r["name"], r.get("lastError")) for r in rules if r.get("health") != "ok"] == []


@needs_prometheus
def test_every_dashboard_panel_returns_data(observed):
    server, prometheus, _ = observed
    with server.client(timeout_s=120) as client:  # traffic in the last minute for the rate() panels
        for _ in range(3):
            client.infer("minilm", unique("dashboard"))
        if (GEN_VERSION_DIR / "decoder.onnx").is_file():
            system = {"role": "system", "content": "You answer a bank's customers in one sentence. " * 8}
            question = [system, {"role": "user", "content": unique("Can I freeze my card?")}]
            client.generate("smollm2", messages=question, max_new_tokens=4)  # a miss, streamed
            client.generate("smollm2", messages=[system, {"role": "user", "content": "And unfreeze it?"}],
                            max_new_tokens=4)  # the system prompt's blocks reused
            wait_for(lambda: client.generate("smollm2", messages=question, max_new_tokens=4).source == "RESULT_EXACT",
                     10, "the answer stored")
    time.sleep(3)
    empty = []
    for title, expr in panel_queries(json.loads(DASHBOARD.read_text())):
        if not prometheus.query(expr):  # a query that does not parse raises PrometheusError
            empty.append((title, expr))
    assert empty == []


@needs_prometheus
def test_dashboard_renders_from_real_series(observed, tmp_path):
    """deploy/grafana/render.py (what draws the README's picture) on this run's series."""
    _, prometheus, _ = observed
    now = time.time()
    out = render(prometheus.query_range, json.loads(DASHBOARD.read_text()), now - 120, now, tmp_path / "board.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 50_000


@needs_prometheus
def test_hot_keys_and_warm(observed, tmp_path):
    server, _, _ = observed
    hot, cold = unique("the hottest question"), unique("a colder question")
    with server.client() as client:
        for _ in range(25):  # hotter than any text of the other tests (wait_cached's polls count too)
            client.infer("minilm", hot)
        for _ in range(2):
            client.infer("minilm", cold)
        deadline = time.monotonic() + 10
        while True:  # the other frontend's share is published each second
            keys = client.hot_keys("minilm", 100)
            counts = {key.text: key.count for key in keys}
            if counts.get(hot) == 7 and counts.get(cold) == 2 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert keys[0].text == hot, keys[0]
        assert counts.get(hot) == 25 and counts.get(cold) == 2, counts
        assert keys[0].version == "1" and len(keys[0].key) == 2 * KEY_BYTES
        faq_keys = client.hot_keys("faq", 5)
        assert faq_keys and all(key.text == "" for key in faq_keys)  # faq keeps no texts
        with pytest.raises(grpc.RpcError) as unknown:
            client.hot_keys("no-such-model")
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND

    cli = [sys.executable, "-m", "server", "cache"]
    shown = subprocess.run([*cli, "hot", "--model", "minilm", "--texts", "--limit", "3", "--address", server.address],
                           cwd=REPO, capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert hot in shown.stdout.splitlines()[0]

    warm_file = tmp_path / "warm.txt"
    new = [unique(f"warm text {n}") for n in range(40)]
    warm_file.write_text("\n".join([*new, "", hot]) + "\n")
    first = subprocess.run([*cli, "warm", str(warm_file), "--model", "minilm", "--batch", "16",
                            "--address", server.address], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr
    assert "41 texts" in first.stdout and "40 computed, 1 already cached, 0 failed" in first.stdout, first.stdout
    assert "warm: 41/41 texts (100%)" in first.stderr  # progress
    with server.client() as client:
        assert wait_cached(client, "minilm", new[-1]).source == "RESULT_EXACT"

    csv_file = tmp_path / "warm.csv"
    csv_file.write_text("id,question\n1,\"" + new[0] + "\"\n2," + "x" * 100_000 + "\n")
    second = subprocess.run([*cli, "warm", str(csv_file), "--model", "minilm", "--column", "question",
                             "--address", server.address], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert second.returncode == 1, second.stdout + second.stderr  # the over-long text failed, the other warmed
    assert "1 already cached, 1 failed" in second.stdout and "characters" in second.stderr
    wrong = subprocess.run([*cli, "warm", str(csv_file), "--model", "minilm", "--column", "text",
                            "--address", server.address], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert wrong.returncode == 2 and "no column 'text'" in wrong.stderr and "question" in wrong.stderr
    no_token = subprocess.run([*cli, "hot", "--model", "minilm", "--token-file", str(tmp_path / "absent"),
                               "--address", server.address], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert no_token.returncode == 2 and "--token-file" in no_token.stderr


def test_metrics_and_hot_keys_off_record_nothing(start_server):
    server = start_server(settings=("server.hot_keys=0",))
    with server.client() as client:
        client.infer("minilm", unique("no metrics"))
        time.sleep(1.5)
        assert list((server.workdir / "run" / "metrics").iterdir()) == []  # nobody publishes anything
        with pytest.raises(grpc.RpcError) as off:
            client.hot_keys("minilm")
        assert off.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "server.hot_keys" in off.value.details()


# ---- units -------------------------------------------------------------------------------------------

def _bounded(found: list, true: dict) -> None:
    for key, count, error, *_ in found:
        assert count - error <= true.get(bytes.fromhex(key), 0) <= count, (key, count, error)


def test_hot_key_sketch_keeps_heavy_hitters_within_its_bound():
    sketch = HotKeys(capacity=8)
    stream = [f"k{n % 50}".encode() for n in range(2000)] + [b"heavy"] * 300 + [b"warm"] * 120
    true = Counter(stream)
    for key in stream:
        sketch.add("m", "1", key, "", "")
    top = sketch.top("m")
    _bounded(top["keys"], true)
    held = [bytes.fromhex(entry[0]) for entry in top["keys"]]
    assert held[0] == b"heavy" and b"warm" in held  # above len(stream) / capacity: always held
    merged = merge_tops([top, top], 2)
    assert merged[0][0] == b"heavy".hex() and merged[0][1] == 2 * top["keys"][0][1]


def test_hot_key_bounds_hold_across_frontends_and_restarts():
    one, other = HotKeys(capacity=1), HotKeys(capacity=1)
    for key in (b"x", b"y", b"y", b"z", b"z", b"z"):  # x, then y and z evict one another in `one`
        one.add("m", "1", key, "", "")
    other.add("m", "1", b"x", "", "")
    merged = merge_tops([one.top("m"), other.top("m")], 5)
    _bounded(merged, {b"x": 2, b"y": 2, b"z": 3})  # x is counted by `other`, and up to the floor by `one`
    restarted = HotKeys(capacity=2)
    before = HotKeys(capacity=2)
    stream = [b"a", b"a", b"b", b"b", b"c", b"c", b"d", b"e", b"f"]
    for key in stream:
        before.add("m", "1", key, "", "")
    restarted.adopt(before.published())
    for key in (b"c", b"d"):
        restarted.add("m", "1", key, "", "")
    _bounded(restarted.top("m")["keys"], Counter(stream + [b"c", b"d"]))


def test_time_saved_uses_the_bucket_of_the_length_class():
    metrics = FrontendMetrics({"m"})
    for _ in range(3):
        metrics.tokenized("m", "1", chars=10, bucket=16)   # short texts fall in the 16-token bucket
        metrics.tokenized("m", "1", chars=300, bucket=128)  # long ones in 128
    metrics.hit("m", "1", chars=12)
    metrics.hit("m", "1", chars=290)
    metrics.hit("other", "1", chars=12)  # no times published for it: stays pending
    metrics.settle({("m", "1"): {16: 0.001, 128: 0.010}})
    assert metrics.recorder.counters[("infercache_compute_seconds_saved_total", "m")] == pytest.approx(0.011)
    assert ("infercache_compute_seconds_saved_total", "other") not in metrics.recorder.counters
    metrics.settle({("other", "1"): {16: 0.002, 128: 0.004}})  # no misses seen: the buckets' mean
    assert metrics.recorder.counters[("infercache_compute_seconds_saved_total", "other")] == pytest.approx(0.003)


def test_recorder_adopts_a_predecessor_and_adds_histograms():
    first = Recorder()
    first.inc(("infercache_requests_total", "m", "miss", "OK"), 3)
    first.observe(("infercache_batch_size", "m"), 4, count=2)
    first.inc(("infercache_unknown_metric",), 1)
    second = Recorder()
    second.adopt(first.snapshot())
    second.observe(("infercache_batch_size", "m"), 300)
    total = second.plus(first)
    assert total.counters[("infercache_requests_total", "m", "miss", "OK")] == 6
    sizes = total.histograms[("infercache_batch_size", "m")]
    assert sizes[2] == 4 and sizes[-2] == 1 and sizes[-1] == 4 * 4 + 300
    assert ("infercache_unknown_metric",) not in second.counters  # a name not in the schema is dropped
