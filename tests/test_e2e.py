"""End to end through real processes: the server on a real port, real LMDB, real ONNX Runtime."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from infercache.v1 import infercache_pb2 as pb
from tests.conftest import SHORT_TTL_S
from tests.helpers import is_cached, unique, wait_cached

MODEL = "minilm"


@pytest.fixture(scope="module")
def models_dir(versioned_models):
    """This module's servers serve shortlived too (its TTL, its two versions)."""
    return versioned_models


def test_first_call_misses_second_hits_with_identical_outputs(server):
    text = unique("How do I return an item?")
    with server.client() as client:
        first = client.infer(MODEL, text)
        assert first.source == "MISS" and first.model_version == "1"
        assert first.outputs["embedding"].shape == (384,)
        assert abs(np.linalg.norm(first.outputs["embedding"]) - 1) < 1e-5
        second = wait_cached(client, MODEL, text)
        third = client.infer(MODEL, text)
    assert third.source == "RESULT_EXACT" and third.key == first.key
    for result in (second, third):
        assert result.outputs["embedding"].tobytes() == first.outputs["embedding"].tobytes()
    assert 0 <= second.age_s <= third.age_s < 10


def test_a_request_repeated_byte_for_byte_is_answered_without_parsing_and_alike(server, models_dir, monkeypatch):
    """Planner.prepared keeps a serialized request's plan and key: the answer to its bytes equals
    the answer to the parsed message, for a hit and a miss; only what depends on the bytes alone is kept."""
    import asyncio
    from collections import Counter

    from server import config as settings
    from server.frontend import plan as plan_module
    from server.frontend.core import FrontendCore
    from server.shared.errors import InvalidArgument
    from server.shared.models import ModelRepository

    text = unique("asked again and again")
    with server.client() as client:
        client.infer(MODEL, text)
        wait_cached(client, MODEL, text)
    config = settings.load(None, {}, {"cache.dir": str(server.cache_dir), "server.models_dir": str(models_dir)})
    core = FrontendCore(config, ModelRepository(models_dir), None, Counter())
    request = pb.InferRequest(model=MODEL, text=text)
    raw = request.SerializeToString()

    async def answer(call) -> pb.InferResponse:
        return pb.InferResponse.FromString(await core.infer(call, None))

    first, again, parsed = asyncio.run(answer(raw)), asyncio.run(answer(raw)), asyncio.run(answer(request))
    assert raw in core.planner._prepared
    for got in (first, again):
        assert got.cache.source == pb.CacheInfo.RESULT_EXACT and got.cache.key == parsed.cache.key
        assert list(got.outputs) == list(parsed.outputs) and got.cache.model_version == parsed.cache.model_version
    # A request with semantic overrides is kept too (they are in its bytes, and in its plan's key); one
    # with max_age_s is worked out each time.
    for request, kept in ((pb.InferRequest(model=MODEL, text=text, cache=pb.CachePolicy(max_age_s=3600)), False),
                          (pb.InferRequest(model=MODEL, text=text, semantic=pb.SemanticPolicy(min_similarity=0.99)), True)):
        assert asyncio.run(answer(request.SerializeToString())).cache.source == pb.CacheInfo.RESULT_EXACT
        assert (request.SerializeToString() in core.planner._prepared) == kept
    with pytest.raises(InvalidArgument, match="not a valid InferRequest"):
        asyncio.run(answer(b"\xff\xff\xff"))
    monkeypatch.setattr(plan_module, "PREPARED_KEPT", 2)  # bounded: past it the kept requests start over
    for n in range(5):
        core.planner.prepared(pb.InferRequest(model=MODEL, text=f"{text} {n}").SerializeToString())
        assert len(core.planner._prepared) <= 2


def test_normalized_variants_share_one_entry(server):
    word = unique("")
    with server.client() as client:
        first = client.infer(MODEL, f"How do I return an item? {word}")
        wait_cached(client, MODEL, f"How do I return an item? {word}")
        for variant in (f"how do i return an item {word}", f"  HOW do I return   an ITEM!! {word}",
                        f"Ｈｏｗ do I return an item？ {word}"):  # full-width forms fold under NFKC
            hit = client.infer(MODEL, variant)
            assert hit.source == "RESULT_EXACT" and hit.key == first.key, variant
        other = client.infer(MODEL, f"How do I return a parcel? {word}")
    assert other.source == "MISS" and other.key != first.key


def test_max_age_s_refuses_older_entries_and_refreshes(server):
    text = unique("max age")
    with server.client() as client:
        client.infer(MODEL, text)
        wait_cached(client, MODEL, text)
        time.sleep(1.2)
        assert client.infer(MODEL, text, max_age_s=60).source == "RESULT_EXACT"
        assert client.infer(MODEL, text, max_age_s=1).source == "MISS"  # too old for this caller
        refreshed = wait_cached(client, MODEL, text, max_age_s=1)
    assert refreshed.age_s < 1


def test_model_ttl_expires_entries(server):
    text = unique("short lived")
    with server.client() as client:
        assert client.infer("shortlived", text).source == "MISS"
        assert wait_cached(client, "shortlived", text).source == "RESULT_EXACT"
        time.sleep(SHORT_TTL_S + 0.2)
        assert not is_cached(client, "shortlived", text)
        assert client.infer("shortlived", text).source == "MISS"


def test_bypass_recomputes_and_refreshes_the_entry(server):
    text = unique("bypass me")
    with server.client() as client:
        first = client.infer(MODEL, text)
        wait_cached(client, MODEL, text)
        time.sleep(0.5)
        old_age = client.infer(MODEL, text).age_s
        bypass = client.infer(MODEL, text, mode="BYPASS")
        assert bypass.source == "MISS"
        assert bypass.outputs["embedding"].tobytes() == first.outputs["embedding"].tobytes()
        deadline = time.monotonic() + 5
        while client.infer(MODEL, text).age_s >= old_age and time.monotonic() < deadline:
            time.sleep(0.02)
        assert client.infer(MODEL, text).age_s < old_age  # the entry was rewritten


def test_no_store_computes_without_storing_but_reads_the_cache(server):
    text = unique("do not keep this")
    with server.client() as client:
        assert client.infer(MODEL, text, mode="NO_STORE").source == "MISS"
        time.sleep(0.3)  # longer than any write-behind delay
        assert not is_cached(client, MODEL, text)
        client.infer(MODEL, text)
        wait_cached(client, MODEL, text)
        assert client.infer(MODEL, text, mode="NO_STORE").source == "RESULT_EXACT"


def test_only_if_cached_never_runs_the_model(server):
    text = unique("only from cache")
    before = server.stats().worker.counters["worker.computed"]
    with server.client() as client, pytest.raises(grpc.RpcError) as err:
        client.infer(MODEL, text, mode="ONLY_IF_CACHED")
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "ONLY_IF_CACHED" in err.value.details()
    assert server.stats().worker.counters["worker.computed"] == before


def test_tenants_never_share_entries(server):
    text = unique("tenant text")
    with server.client() as client:
        a = client.infer(MODEL, text, tenant="acme")
        wait_cached(client, MODEL, text, tenant="acme")
        b = client.infer(MODEL, text, tenant="globex")
        assert b.source == "MISS" and b.key != a.key
        assert not is_cached(client, MODEL, text, tenant="")


def answering_pid(stub) -> int:
    """The frontend that owns this channel's connection (GetStats answers with its own pid)."""
    return stub.GetStats(pb.GetStatsRequest(), timeout=10).frontend.pid


def test_entry_written_through_one_frontend_hits_through_another(server):
    text = unique("cross frontend")
    request = pb.InferRequest(model=MODEL, text=text)
    channel, stub = server.stub()
    with channel:
        assert stub.Infer(request, timeout=10).cache.source == pb.CacheInfo.MISS
        first_pid = answering_pid(stub)
    with server.client() as client:
        wait_cached(client, MODEL, text)
    for _ in range(200):  # each new channel is a new connection; SO_REUSEPORT spreads them
        channel, stub = server.stub()
        with channel:
            if answering_pid(stub) != first_pid:
                assert stub.Infer(request, timeout=10).cache.source == pb.CacheInfo.RESULT_EXACT
                assert answering_pid(stub) != first_pid  # still the other frontend
                return
    pytest.fail(f"only frontend {first_pid} answered in 200 connections")


def test_identical_concurrent_requests_are_computed_once(server):
    text = unique("everyone asks this at once")
    before = server.stats().worker.counters["worker.computed"]
    with server.client() as client, ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda _: client.infer(MODEL, text), range(16)))
    sources = [r.source for r in results]
    assert sources.count("MISS") == 1, sources
    assert set(sources) <= {"MISS", "COALESCED", "RESULT_EXACT"}
    assert len({r.outputs["embedding"].tobytes() for r in results}) == 1
    assert server.stats().worker.counters["worker.computed"] == before + 1


def test_invalidate_removes_what_it_names_and_nothing_else(server):
    word = unique("")
    entries = {
        ("acme", MODEL, "1"): f"refund status {word}",
        ("acme", MODEL, "1b"): f"card arrival {word}",
        ("globex", MODEL, "1"): f"refund status {word}",
        ("acme", "shortlived", "2"): f"refund status {word}",
        ("acme", "shortlived", "1"): f"refund status {word}",
    }
    with server.client() as client:

        def cached(tenant, model, version, text):
            return is_cached(client, model, text, tenant=tenant, version=version.rstrip("b"))

        def populate():
            for (tenant, model, version), text in entries.items():
                client.infer(model, text, tenant=tenant, version=version.rstrip("b"))
                wait_cached(client, model, text, tenant=tenant, version=version.rstrip("b"))

        populate()
        # by exact text (normalized like Infer), in one tenant
        assert client.invalidate(model=MODEL, tenant="acme", text=f"Refund status? {word}") == 1
        assert [cached(*k, t) for k, t in entries.items()] == [False, True, True, True, True]
        # by key, from CacheInfo
        key = client.infer(MODEL, entries[("acme", MODEL, "1b")], tenant="acme").key
        assert client.invalidate(key=key) == 1
        assert client.invalidate(key=key) == 0
        assert [cached(*k, t) for k, t in entries.items()] == [False, False, True, True, True]
        # by model version: version 2 of shortlived only
        assert client.invalidate(model="shortlived", version="2") >= 1
        assert [cached(*k, t) for k, t in entries.items()] == [False, False, True, False, True]
        # by tenant
        populate()
        assert client.invalidate(tenant="globex") >= 1
        assert [cached(*k, t) for k, t in entries.items()] == [True, True, False, True, True]
        # by model, across tenants and versions
        assert client.invalidate(model="shortlived") >= 2
        assert [cached(*k, t) for k, t in entries.items()] == [True, True, False, False, False]


@pytest.mark.parametrize(
    "request_kwargs, code, fragment",
    [
        (dict(model="no-such-model", text="hi"), grpc.StatusCode.NOT_FOUND, "unknown model 'no-such-model'"),
        (dict(model=MODEL, version="7", text="hi"), grpc.StatusCode.NOT_FOUND, "no version '7'"),
        (dict(model="", text="hi"), grpc.StatusCode.INVALID_ARGUMENT, "model is required"),
        (dict(model=MODEL, text=""), grpc.StatusCode.INVALID_ARGUMENT, "text is empty"),
        (dict(model=MODEL, text=" ?!… "), grpc.StatusCode.INVALID_ARGUMENT, "text is empty"),
        (dict(model=MODEL, text="x" * 2049), grpc.StatusCode.INVALID_ARGUMENT, "at most 2048"),
        (dict(model=MODEL, text="hi", cache=pb.CachePolicy(mode=9)), grpc.StatusCode.INVALID_ARGUMENT, "cache.mode"),
    ],
)
def test_bad_inputs_get_documented_codes(server, request_kwargs, code, fragment):
    channel, stub = server.stub()
    with channel, pytest.raises(grpc.RpcError) as err:
        stub.Infer(pb.InferRequest(**request_kwargs), timeout=10)
    assert err.value.code() == code
    assert fragment in err.value.details()


@pytest.mark.parametrize(
    "selector, fragment",
    [
        ({}, "set at least one"),
        (dict(version="1"), "set model too"),
        (dict(key="abc"), "hex digits"),
        (dict(model="no-such-model", text="hi"), "unknown model"),
    ],
)
def test_bad_invalidate_requests(server, selector, fragment):
    with server.client() as client, pytest.raises(grpc.RpcError) as err:
        client.invalidate(**selector)
    assert err.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND)
    assert fragment in err.value.details()


def test_deadline_is_respected(server):
    channel, stub = server.stub()
    started = time.monotonic()
    with channel, pytest.raises(grpc.RpcError) as err:
        stub.Infer(pb.InferRequest(model=MODEL, text=unique("too slow for you")), timeout=0.001)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - started < 1.0


def test_health_reflection_models_and_stats(server):
    channel, _ = server.stub()
    with channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "infercache.v1.InferenceCache"):
            watch = health.Watch(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert any(r.status == health_pb2.HealthCheckResponse.SERVING for r in watch)
        reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
        reply = next(reflect.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
        names = {s.name for s in reply.list_services_response.service}
        assert "infercache.v1.InferenceCache" in names
    with server.client() as client:
        models = {m.name: m for m in client.models()}
        stats = client.stats()
    assert models[MODEL].serving_version == "1" and list(models[MODEL].outputs) == ["embedding"]
    assert list(models["shortlived"].versions) == ["1", "2"]
    assert stats.frontend.role == "frontend" and stats.worker.role == "worker"
    assert stats.store.entries > 0 and 0 < stats.store.used_bytes < stats.store.budget_bytes


def test_outputs_match_sentence_transformers_through_the_server(server, reference_encoder):
    texts = ["how do i return an item", "my card has not arrived yet", "what is the exchange rate for euros"]
    with server.client() as client:
        got = np.stack([client.infer(MODEL, t, mode="NO_STORE").outputs["embedding"] for t in texts])
    want = reference_encoder.encode(texts, normalize_embeddings=True)
    assert np.min(np.sum(got * want, axis=1)) >= 0.999


def test_a_frontend_prepares_every_version_before_it_listens_with_one_tokenizer_per_file(tmp_path):
    """A version's first request must not load its tokenizer on the event loop (85 ms on 2 cores, every
    call of the frontend waiting): FrontendCore.prepare_models makes them all at start, once per distinct
    tokenizer file; a version that cannot be served is left to its requests, which say why."""
    from collections import Counter

    from server import config as settings
    from server.shared.errors import ModelNotFound
    from server.frontend.core import FrontendCore
    from server.shared.models import ModelRepository
    from tests.conftest import MINILM_CONFIG, MODEL_VERSION_DIR
    from harness.servers import link_model

    root = tmp_path / "models"
    missing, garbled = tmp_path / "missing", tmp_path / "garbled"
    for broken in (missing, garbled):
        broken.mkdir()
        (broken / "model.onnx").symlink_to(MODEL_VERSION_DIR / "model.onnx")
    (garbled / "tokenizer.json").write_text('{"not": "a tokenizer"}')  # tokenizers raises a bare Exception
    link_model(root, "enc", MINILM_CONFIG, {"1": MODEL_VERSION_DIR, "2": MODEL_VERSION_DIR, "3": missing, "4": garbled})
    config = settings.load(None, {}, {"cache.dir": str(tmp_path / "cache"), "server.models_dir": str(root)})
    core = FrontendCore(config, ModelRepository(root), None, Counter())
    core.planner.prepare_models()  # returns: the broken versions are left to their requests
    assert set(core.planner._served) == {("enc", "1"), ("enc", "2")}
    assert core.planner._served["enc", "1"].encoder is core.planner._served["enc", "2"].encoder and len(core.planner._encoders) == 1
    for version in ("3", "4"):
        with pytest.raises(ModelNotFound, match=f"version '{version}' cannot be served here"):
            core.planner.prepare(pb.InferRequest(model="enc", version=version, text="hello"))
