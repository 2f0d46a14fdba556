"""The fleet tier (server/fleet/) against real redis-server processes: one Redis, and a Redis Cluster of
three masters with a replica each. Two servers with their own LMDB directories stand for two pods."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from cachestore import records
from cachestore.env import DB_RESULTS, Store, StoreSettings
from cachestore.keys import entry_key, namespace_id
from harness import redis_servers
from harness.servers import ServerProcess
from server.config import ConfigError
from server.config import load as load_config
from server.fleet import generations
from server.fleet.generations import NamespaceGenerations
from server.shared.normalize import DEFAULT_STEPS, Normalizer

pytestmark = pytest.mark.skipif(redis_servers.available() is not None, reason=redis_servers.available() or "")

redis = pytest.importorskip("redis")

TEST_BUDGET_MS = 200


def worker_counter(server: ServerProcess, name: str) -> int:
    return sum(int(w.counters.get(name, 0)) for w in server.stats().workers)


def fleet_hits(server: ServerProcess) -> int:
    """Found in the fleet by the frontend (the usual way) or by a worker (when the frontend did not look)."""
    stats = server.stats()
    return int(stats.frontend.counters.get("fleet.hits", 0)) + sum(int(w.counters.get("fleet.hits", 0))
                                                                  for w in stats.workers)


def fleet_usable(server: ServerProcess) -> bool:
    """Frontend and workers subscribed, their breakers closed."""
    stats = server.stats()
    return all(group.counters.get("fleet.ready") == 1 and group.counters.get("fleet.breaker_open") == 0
               for group in (stats.frontend, *stats.workers))


def until(condition, timeout: float = 10.0, every: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not true after {timeout} s")
        time.sleep(every)


def entry(text: str, tenant: str = "", model: str = "minilm", version: str = "1") -> bytes:
    return entry_key(namespace_id(tenant, model, version), Normalizer(DEFAULT_STEPS)(text))


@pytest.fixture
def redis_server(tmp_path):
    server = redis_servers.RedisProcess(tmp_path / "redis")
    yield server
    server.stop()


@pytest.fixture
def pods(start_server):
    """start(url, n=2, settings=()) -> n servers on one fleet, each with its own cache directory."""

    def start(url: str, n: int = 2, settings: tuple[str, ...] = ()) -> list[ServerProcess]:
        # A budget far above the 5 ms default: this 2-core host runs up to 10 processes here, and a
        # lookup that a scheduling hiccup pushes past its budget is (rightly) a miss, which these
        # tests of what the tier does would read as a failure.
        common = (f"fleet.redis={url}", f"fleet.timeout_ms={TEST_BUDGET_MS}")
        servers = [start_server(frontends=1, settings=(*common, *settings)) for _ in range(n)]
        for server in servers:  # subscribed and generations read: the tier is in use (worker and frontend)
            until(lambda: fleet_usable(server))
        return servers

    return start


class Load:
    """Callers on each server until the block ends: half the calls repeat `known` texts (hits), half are
    new (misses); every answer's source and every error code is kept."""

    def __init__(self, servers: list[ServerProcess], known: list[str], prefix: str) -> None:
        self.errors: list = []
        self.answered: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(s, f"{prefix} {n}", known))
                         for n, s in enumerate(servers)]

    def _run(self, server: ServerProcess, prefix: str, known: list[str]) -> None:
        with server.client() as client:
            n = 0
            while not self._stop.is_set():
                text = known[n % len(known)] if n % 2 else f"{prefix}: new {n}"
                try:
                    self.answered.append(client.infer("minilm", text).source)
                except grpc.RpcError as exc:
                    self.errors.append(exc.code())
                n += 1

    def __enter__(self) -> "Load":
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()


# ---- units -------------------------------------------------------------------------------------------

def test_generations_cover_each_selector_and_only_grow():
    from cachestore.keys import Namespace

    gens = NamespaceGenerations("p")
    ns = Namespace("acme", "minilm", "1")
    assert len(set(generations.covering(ns))) == 8
    key = entry("hello", "acme")
    first = gens.value_key(key, ns)
    assert first == f"p:r:{{{key.hex()}:0}}" and gens.lease_key(key, ns) == f"p:l:{{{key.hex()}:0}}"
    assert gens.advance(generations.field("acme", None, None), 1)
    assert not gens.advance(generations.field("acme", None, None), 1)  # old news
    assert gens.value_key(key, ns) != first
    other = Namespace("globex", "minilm", "1")
    assert gens.total(other) == 0  # another tenant is not touched
    grown = gens.replace({generations.field("acme", None, None): 1, generations.field(None, "minilm", None): 3})
    assert grown == [generations.field(None, "minilm", None)]
    assert gens.total(ns) == 4 and gens.total(other) == 3
    assert generations.selector(generations.field(None, "minilm", "1")).version == "1"


def test_fleet_settings_are_checked():
    with pytest.raises(ConfigError, match="fleet.redis must start with"):
        load_config(None, {}, {"fleet.redis": "localhost:6379"})
    with pytest.raises(ConfigError, match="ttl_jitter"):
        load_config(None, {}, {"fleet.redis": "redis://127.0.0.1:1", "fleet.ttl_jitter": "1.5"})
    config = load_config(None, {}, {"fleet.redis": "redis-cluster://127.0.0.1:7000,127.0.0.1:7001"})
    from server.fleet.link import seed_nodes

    assert seed_nodes(config.fleet.redis) == [("127.0.0.1", 7000), ("127.0.0.1", 7001)]


# ---- one Redis -----------------------------------------------------------------------------------------

def test_computed_on_one_pod_is_a_fleet_hit_on_another(redis_server, pods):
    a, b = pods(redis_server.url)
    text = "fleet: how do I order a new card?"
    with a.client() as ca, b.client() as cb:
        computed = ca.infer("minilm", text)
        assert computed.source == "MISS"
        until(lambda: worker_counter(a, "fleet.writes") >= 1)
        shared = cb.infer("minilm", text, mode="ONLY_IF_CACHED")  # the fleet counts as cached
        assert shared.source == "RESULT_FLEET" and shared.age_s > 0
        assert (shared.outputs["embedding"] == computed.outputs["embedding"]).all()
        # Read through: B's own store holds it now, and its frontend answers it.
        until(lambda: cb.infer("minilm", text, mode="ONLY_IF_CACHED").source == "RESULT_EXACT")
        # Tenants never see each other's entries through the fleet.
        assert cb.infer("minilm", text, tenant="globex").source == "MISS"
    assert worker_counter(b, "worker.computed") == 1  # the globex one only

    # The value is LMDB's record (header + payload, no pickle), its Redis expiry the entry's remaining TTL.
    key = entry(text)
    raw = redis.Redis(port=redis_server.port).get(f"icache:r:{{{key.hex()}:0}}")
    pttl_ms = redis.Redis(port=redis_server.port).pttl(f"icache:r:{{{key.hex()}:0}}")
    read_at_us = time.time() * 1e6
    assert a.stop() == 0
    store = Store(StoreSettings(path=a.cache_dir, map_size=2048 << 20, budget=1536 << 20), readonly=True)
    with store.begin() as txn:
        local = records.decode(txn.get(key, db=store.dbs[DB_RESULTS]), key)
    shared_record = records.decode(raw, key)
    assert shared_record == local
    remaining_ms = (local.expires_us - read_at_us) / 1000
    # The record's expiry carries cache.ttl_jitter already; Redis adds none by default (fleet.ttl_jitter 0)
    assert remaining_ms - 100 <= pttl_ms <= remaining_ms + 50


def test_invalidate_on_one_pod_reaches_the_other_within_a_second(redis_server, pods):
    a, b = pods(redis_server.url)
    cases = [
        ("key", "tenant-k", lambda c, text: c.invalidate(model="minilm", tenant="tenant-k", text=text)),
        ("model", "tenant-m", lambda c, text: c.invalidate(model="minilm")),
        ("version", "tenant-v", lambda c, text: c.invalidate(model="minilm", version="1")),
        ("tenant", "tenant-t", lambda c, text: c.invalidate(tenant="tenant-t")),
    ]
    with a.client() as ca, b.client() as cb:
        for name, tenant, invalidate in cases:
            text = f"fleet invalidation by {name}: where is my refund?"
            assert ca.infer("minilm", text, tenant=tenant).source == "MISS"
            until(lambda: cb.infer("minilm", text, tenant=tenant).source == "RESULT_FLEET", timeout=5)
            until(lambda: cb.infer("minilm", text, tenant=tenant, mode="ONLY_IF_CACHED").source == "RESULT_EXACT")
            invalidate(ca, text)
            started = time.monotonic()

            def gone_from_b() -> bool:
                try:
                    cb.infer("minilm", text, tenant=tenant, mode="ONLY_IF_CACHED")
                    return False
                except grpc.RpcError as exc:
                    return exc.code() == grpc.StatusCode.NOT_FOUND or exc.code() == grpc.StatusCode.FAILED_PRECONDITION

            until(gone_from_b, timeout=1.0, every=0.01)
            assert time.monotonic() - started < 1.0, name
            # ... and not in the fleet either: B computes it again.
            assert cb.infer("minilm", text, tenant=tenant).source == "MISS", name
    assert worker_counter(b, "fleet.l1_purges") >= len(cases)


def test_a_disconnected_pod_catches_up_from_the_generations(redis_server, pods):
    a, b = pods(redis_server.url)
    text = "fleet catch-up: cancel my transfer"
    admin = redis.Redis(port=redis_server.port)
    with a.client() as ca, b.client() as cb:
        ca.infer("minilm", text)
        until(lambda: cb.infer("minilm", text).source == "RESULT_FLEET", timeout=5)
        until(lambda: cb.infer("minilm", text, mode="ONLY_IF_CACHED").source == "RESULT_EXACT")
        worker = b.stats().worker.pid
        os.kill(worker, signal.SIGSTOP)  # B hears nothing: the broadcast below is lost to it
        try:
            admin.client_kill_filter(_type="pubsub")  # and its subscription is gone when it wakes
            ca.invalidate(model="minilm")
        finally:
            os.kill(worker, signal.SIGCONT)
        until(lambda: worker_counter(b, "fleet.generations_caught_up") >= 1, timeout=5)
        with pytest.raises(grpc.RpcError):
            cb.infer("minilm", text, mode="ONLY_IF_CACHED")
        assert cb.infer("minilm", text).source == "MISS"


def test_many_callers_on_two_pods_compute_once(redis_server, pods):
    a, b = pods(redis_server.url)
    text = "fleet stampede: my card was declined at the shop"
    clients = [server.client() for server in (a, b)]
    barrier = threading.Barrier(32)

    def ask(n: int):
        barrier.wait()
        return clients[n % 2].infer("minilm", text)

    try:
        with ThreadPoolExecutor(32) as pool:
            answers = list(pool.map(ask, range(32)))
    finally:
        for client in clients:
            client.close()
    assert worker_counter(a, "worker.computed") + worker_counter(b, "worker.computed") == 1
    reference = answers[0].outputs["embedding"]
    assert all((r.outputs["embedding"] == reference).all() for r in answers)
    sources = Counter(r.source for r in answers)
    assert sources["MISS"] == 1 and set(sources) <= {"MISS", "COALESCED", "RESULT_FLEET", "RESULT_EXACT"}, sources


def test_a_dead_pods_lease_lapses_and_one_waiter_takes_over(redis_server, pods):
    [a] = pods(redis_server.url, n=1, settings=("fleet.lease_wait_s=5",))
    text = "fleet lease: the pod computing this died"
    # What a pod killed mid-computation leaves behind: its lease, running out.
    redis.Redis(port=redis_server.port).set(f"icache:l:{{{entry(text).hex()}:0}}", "dead-pod", px=1500)
    started = time.monotonic()
    with a.client() as client:
        assert client.infer("minilm", text).source == "MISS"
    assert 1.3 < time.monotonic() - started < 4.5
    assert worker_counter(a, "fleet.lease_takeovers") == 1 and worker_counter(a, "worker.computed") == 1


def test_encrypted_records_travel_sealed(redis_server, pods, tmp_path):
    import base64

    key_file = tmp_path / "key"
    key_file.write_text(base64.b64encode(os.urandom(32)).decode())
    a, b = pods(redis_server.url, settings=(f"cache.encryption_key_file={key_file}",))
    text = "fleet sealed: my PIN is blocked"
    with a.client() as ca, b.client() as cb:
        computed = ca.infer("minilm", text)
        until(lambda: worker_counter(a, "fleet.writes") >= 1)
        assert cb.infer("minilm", text).source == "RESULT_FLEET"
    raw = redis.Redis(port=redis_server.port).get(f"icache:r:{{{entry(text).hex()}:0}}")
    assert raw[1] & records.FLAG_ENCRYPTED and computed.outputs["embedding"].tobytes()[:64] not in raw


def test_redis_down_is_a_miss_and_the_tier_comes_back(redis_server, pods):
    a, b = pods(redis_server.url, settings=("fleet.breaker_open_s=0.5",))
    hot = [f"fleet outage: hot question {n}" for n in range(8)]
    with a.client() as ca:
        for text in hot:
            ca.infer("minilm", text)
    with Load([a, b], hot, "fleet outage") as load:
        time.sleep(1.0)
        redis_server.kill()
        during = len(load.answered)
        time.sleep(2.0)
        assert len(load.answered) > during + 10  # still serving, from L1 and the model
        redis_server.start()
        until(lambda: fleet_usable(a) and fleet_usable(b), timeout=15)
    assert load.errors == []
    # The tier is back: a new entry computed on A is a fleet hit on B.
    text = "fleet outage: asked after Redis came back"
    with a.client() as ca, b.client() as cb:
        assert ca.infer("minilm", text).source == "MISS"
        until(lambda: cb.infer("minilm", text).source in ("RESULT_FLEET", "RESULT_EXACT"), timeout=5)


def test_two_servers_on_one_engine_directory_build_once(start_server, tmp_path):
    shared = tmp_path / "shared-engines"
    servers = [start_server(frontends=1, engines_dir=shared, wait=False) for _ in range(2)]
    for server in servers:
        server.wait_ready()
    built = [worker_counter(s, "worker.engines_built_at_start") for s in servers]
    loaded = [worker_counter(s, "worker.engines_loaded") for s in servers]
    # Each engine built once in all (by whichever server took its lock first; the other waited and loaded it).
    assert loaded[0] == loaded[1] == sum(built) >= 1


# ---- a Redis Cluster ----------------------------------------------------------------------------------------

@pytest.fixture
def cluster(tmp_path):
    made = redis_servers.RedisCluster(tmp_path / "cluster", masters=3, replicas=1, node_timeout_ms=1000)
    yield made
    made.stop()


def test_cluster_fleet_survives_a_master_killed_under_load(cluster, pods):
    a, b = pods(cluster.url)
    texts = [f"fleet cluster: question {n}" for n in range(12)]
    with a.client() as ca, b.client() as cb:
        for text in texts:
            ca.infer("minilm", text)
        until(lambda: worker_counter(a, "fleet.writes") >= len(texts))
        assert {cb.infer("minilm", t).source for t in texts} == {"RESULT_FLEET"}  # spread over the 3 masters
    with Load([a, b], texts, "fleet cluster") as load:
        time.sleep(1.0)
        victim = cluster.kill_master()  # returns once a replica has taken its slots over
        assert victim not in cluster.masters() and len(cluster.masters()) == 3
        time.sleep(1.0)
    assert load.errors == [] and len(load.answered) > 20
    until(lambda: fleet_usable(a) and fleet_usable(b), timeout=20)  # the breakers' probes found Redis back
    # Fleet hits resume on the new topology, on every slot.
    fresh = [f"fleet cluster: after the failover {n}" for n in range(12)]
    with a.client() as ca, b.client() as cb:
        for text in fresh:
            ca.infer("minilm", text)
        until(lambda: all(cb.infer("minilm", t).source in ("RESULT_FLEET", "RESULT_EXACT") for t in fresh), timeout=15)
        assert fleet_hits(b) >= len(texts) + 1


def test_cluster_fleet_survives_resharding_under_load(cluster, pods):
    a, b = pods(cluster.url)
    texts = [f"fleet reshard: question {n}" for n in range(8)]
    kept = [f"fleet reshard: asked on B only after the move {n}" for n in range(24)]
    with a.client() as ca:
        for text in texts + kept:
            ca.infer("minilm", text)
        until(lambda: worker_counter(a, "fleet.writes") >= len(texts) + len(kept))
    with Load([a, b], texts, "fleet reshard") as load:
        time.sleep(0.5)
        cluster.reshard(4000)  # keys move by MIGRATE; clients meet MOVED and ASK meanwhile
        time.sleep(0.5)
    assert load.errors == [] and len(load.answered) > 20
    until(lambda: fleet_usable(b), timeout=20)
    # Entries written before the move are found on B, wherever their slots went.
    with b.client() as cb:
        assert {cb.infer("minilm", t).source for t in kept} == {"RESULT_FLEET"}
