"""TTL classes (server/shared/ttl_classes.py) and expiry jitter, through a real server and a real store."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request

import grpc
import pytest

from cachestore import records, results
from cachestore.env import DB_RESULTS, Store, StoreSettings
from cachestore.keys import Namespace, entry_key
from cachestore.writer import WriteBehind
from server.shared import ttl_classes
from server.shared.models import ModelConfigError, load_model
from tests.conftest import MINILM_CONFIG, MODEL_VERSION_DIR
from harness.servers import REPO, free_port, link_model
from tests.helpers import unique, wait_cached

CLASSES = "cache:\n  classes: {static: 3600, dynamic: 2, realtime: 0}\n  default_class: static\n"
CLASSY_CONFIG = MINILM_CONFIG.split("cache:")[0] + CLASSES


@pytest.fixture(scope="module")
def classy_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("classy-models")
    link_model(root, "classy", CLASSY_CONFIG, {"1": MODEL_VERSION_DIR})
    return root


def _metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return response.read().decode()


def _until(condition, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, "not true in time"
        time.sleep(0.1)
    return value


def test_a_request_picks_its_class_and_the_store_counts_entries_by_class(start_server, classy_models):
    metrics_port = free_port()
    server = start_server(classy_models, frontends=1, settings=(f"server.metrics_port={metrics_port}",))
    with server.client() as client:
        [info] = client.models()
        assert dict(info.ttl_classes) == {"static": 3600, "dynamic": 2, "realtime": 0}
        assert info.default_ttl_class == "static" and info.ttl_s == 3600

        static, dynamic = unique("a fact that holds for hours"), unique("a price that moves")
        assert client.infer("classy", static).source == "MISS"  # the default class: static
        assert client.infer("classy", dynamic, ttl_class="dynamic").source == "MISS"
        wait_cached(client, "classy", static)
        wait_cached(client, "classy", dynamic, ttl_class="dynamic")
        by_class = _until(lambda: dict(server.stats().store.entries_by_class)
                          if len(server.stats().store.entries_by_class) == 2 else None)
        assert by_class == {"static": 1, "dynamic": 1}
        scraped = _until(lambda: text if 'ttl_class="dynamic"' in (text := _metrics(metrics_port)) else None)
        assert 'infercache_store_class_entries{store="results",ttl_class="static"} 1.0' in scraped

        # realtime: never looked up, never stored
        live = unique("the stock price right now")
        assert [client.infer("classy", live, ttl_class="realtime").source for _ in range(2)] == ["MISS", "MISS"]
        with pytest.raises(grpc.RpcError) as refused:
            client.infer("classy", live, ttl_class="realtime", mode="ONLY_IF_CACHED")
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION

        # A class the model does not define
        with pytest.raises(grpc.RpcError) as unknown:
            client.infer("classy", live, ttl_class="weekly")
        assert unknown.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "static, dynamic, realtime" in unknown.value.details()

        time.sleep(2.2)
        # The dynamic entry expired (its class's TTL, less jitter); the static one answers a static
        # request but not a dynamic one: a class also bounds the age of what answers it.
        assert client.infer("classy", dynamic, ttl_class="dynamic", mode="NO_STORE").source == "MISS"
        assert client.infer("classy", static).source == "RESULT_EXACT"
        assert client.infer("classy", static, ttl_class="dynamic", mode="NO_STORE").source == "MISS"
        # The sweep (every second in tests) removes the expired entry, and its class's count goes with it.
        assert _until(lambda: dict(server.stats().store.entries_by_class) == {"static": 1})
    shown = subprocess.run([sys.executable, "-m", "server", "cache", "stats", "--cache-dir", str(server.cache_dir)],
                           cwd=REPO, capture_output=True, text=True, timeout=120)
    assert "1 entries (by TTL class: static 1)" in shown.stdout, shown.stdout + shown.stderr


def test_the_retention_cap_caps_every_class(start_server, classy_models):
    server = start_server(classy_models, frontends=1, settings=("cache.max_ttl_s=60",))
    with server.client() as client:
        [info] = client.models()
    assert dict(info.ttl_classes) == {"static": 60, "dynamic": 2, "realtime": 0} and info.ttl_s == 60


@pytest.mark.parametrize("cache, error", [
    ("cache: {ttl_s: 60, classes: {a: 1}, default_class: a}", "not both"),
    ("cache: {classes: {a: 1}}", "default_class is required"),
    ("cache: {classes: {a: 1}, default_class: b}", "'b' is not one of"),
    ("cache: {classes: {Bad Name: 1}, default_class: a}", "is not a class name"),
    ("cache: {classes: {a: -1}, default_class: a}", "whole number of seconds"),
    ("cache: {ttl_s: 60, default_class: a}", "sets none"),
])
def test_class_settings_are_checked(tmp_path, cache, error):
    link_model(tmp_path, "m", MINILM_CONFIG.split("cache:")[0] + cache + "\n", {"1": MODEL_VERSION_DIR})
    with pytest.raises(ModelConfigError, match=error):
        load_model(tmp_path / "m")


def test_ten_thousand_entries_written_together_expire_spread_over_the_jitter_window(tmp_path):
    """10,000 answers made in one second, TTL 100 s, jitter 0.2: sweeps at successive seconds find them
    expiring from 80 s to 100 s after they were made, about 500 a second, never all at once."""
    ttl_s, jitter, count = 100, 0.2, 10_000
    lifetimes = ttl_classes.TtlClasses((("static", ttl_s),), "static", jitter)
    ns = Namespace("t", "m", "1")
    started = results.now_us()
    made = [records.Record(now := results.now_us(), lifetimes.expires_us("static", now), b"answer")
            for _ in range(count)]
    assert made[-1].created_us - started < 1_000_000  # written in one second
    store = Store(StoreSettings(tmp_path / "store", 256 << 20, 128 << 20, sync=False), readonly=False)
    writer = WriteBehind(store, threaded=False, sweep_interval_s=3600)
    for n, record in enumerate(made):
        writer.put(entry_key(ns.ns_id, f"text {n}"), ns, record, ttl_class="static")
    writer.drain()
    assert store.stats()["entries_by_class"] == {"static": count}
    per_second = []
    for second in range(int(ttl_s * (1 - jitter)) - 1, ttl_s + 2):
        with store.begin(write=True) as txn:
            per_second.append(results.sweep_expired(store, txn, started + second * 1_000_000, limit=count))
    assert sum(per_second) == count and store.stats()["entries_by_class"] == {}
    assert per_second[0] == 0  # nothing expired before 80 s
    spread = [n for n in per_second if n]
    assert len(spread) >= 20 and max(spread) < 0.1 * count, per_second  # ~500 a second over 20 seconds
    with store.begin() as txn:
        assert txn.stat(store.dbs[DB_RESULTS])["entries"] == 0
    store.close()


def test_jitter_spreads_stored_entries_locally_and_in_the_fleet(start_server, tmp_path):
    """Through the server (null engine: the answers cost nothing): 2,000 texts in 8 calls; their L1
    records' lifetimes and their Redis keys' remaining TTLs cover the jitter window."""
    from harness import redis_servers

    why = redis_servers.available()
    if why is not None:
        pytest.skip(why)
    import redis

    redis_server = redis_servers.RedisProcess(tmp_path / "redis")
    try:
        models = tmp_path / "models"
        link_model(models, "minilm", MINILM_CONFIG.split("cache:")[0] + "cache: {ttl_s: 100}\n",
                   {"1": MODEL_VERSION_DIR})
        server = start_server(models, frontends=1, settings=(
            "engines.runtime=null", "cache.ttl_jitter=0.5", f"fleet.redis={redis_server.url}",
            "fleet.timeout_ms=200"))
        texts = [unique(f"jitter {n}") for n in range(2000)]
        with server.client() as client:
            for start in range(0, len(texts), 250):
                client.infer_batch("minilm", texts[start:start + 250])
            wait_cached(client, "minilm", texts[-1])
        assert server.stop() == 0
        store = Store(StoreSettings(server.cache_dir, 2048 << 20, 1536 << 20), readonly=True)
        with store.begin() as txn:
            lifetimes = [(e - c) / 1e6 for c, e in (records.decode_times(raw) for _, raw
                                                    in txn.cursor(db=store.dbs[DB_RESULTS]))]
        store.close()
        assert len(lifetimes) == len(texts)
        assert 50 <= min(lifetimes) < 55 and 95 < max(lifetimes) <= 100  # spread over [50 s, 100 s]
        assert sum(lifetimes) / len(lifetimes) == pytest.approx(75, abs=3)
        client = redis.Redis(port=redis_server.port)
        remaining = [client.pttl(key) / 1000 for key in client.scan_iter(match="icache:r:*", count=1000)]
        client.close()
        assert len(remaining) == len(texts)
        assert min(remaining) < 55 and max(remaining) > 90
    finally:
        redis_server.stop()
