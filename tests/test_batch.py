"""InferBatch through a real server: hits and misses mixed in one call, its limits and its errors."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from infercache.v1 import infercache_pb2 as pb
from tests.helpers import is_cached, unique, wait_cached

MODEL = "minilm"


@pytest.fixture(scope="module")
def models_dir(versioned_models):
    """This module's servers serve shortlived too (its TTL, its two versions)."""
    return versioned_models


def _embedding(result) -> bytes:
    return result.outputs["embedding"].tobytes()


def test_mixed_hits_and_misses_in_one_call(server):
    warm = [unique(f"batch warm {i}") for i in range(3)]
    new = [unique(f"batch new {i}") for i in range(2)]
    with server.client() as client:
        singles = {t: client.infer(MODEL, t) for t in warm}
        for text in warm:
            wait_cached(client, MODEL, text)
        # What a single Infer answers for each new text, computed under another tenant (other keys, so
        # the new texts stay uncached for the batch).
        reference = {t: client.infer(MODEL, t, tenant="reference", mode="NO_STORE") for t in new}
        before = client.stats().frontend.counters  # same channel, same frontend as the call below

        texts = [warm[0], new[0], warm[1].upper() + "!!", new[1], new[0], warm[2]]
        results = client.infer_batch(MODEL, texts)
        after = client.stats().frontend.counters

        assert len(results) == len(texts)
        sources = [r.source for r in results]
        assert sources[0] == sources[2] == sources[5] == "RESULT_EXACT", sources
        assert sources[3] == "MISS", sources
        assert sorted([sources[1], sources[4]]) == ["COALESCED", "MISS"], sources  # one computation for both
        # Order preserved: each item is its own text's answer, with the key a single Infer gives it.
        for text, result in zip([warm[0], warm[1], warm[2]], [results[0], results[2], results[5]]):
            assert result.key == singles[text].key
            assert _embedding(result) == _embedding(singles[text])
        assert results[1].key == results[4].key != results[3].key
        assert _embedding(results[1]) == _embedding(results[4])
        for text, result in ((new[0], results[1]), (new[1], results[3])):
            assert result.outputs["embedding"].shape == (384,) and result.model_version == "1"
            np.testing.assert_allclose(result.outputs["embedding"], reference[text].outputs["embedding"],
                                       rtol=0, atol=1e-6)
        assert after["frontend.batch_calls"] == before["frontend.batch_calls"] + 1
        assert after["frontend.batch_texts"] == before["frontend.batch_texts"] + len(texts)

        # Later single calls of the new texts hit the entries the batch stored, same key, same bytes.
        for text, result in ((new[0], results[1]), (new[1], results[3])):
            wait_cached(client, MODEL, text)
            hit = client.infer(MODEL, text)
            assert hit.source == "RESULT_EXACT" and hit.key == result.key
            assert _embedding(hit) == _embedding(result)


def test_a_batch_computes_what_single_calls_compute(server):
    """Texts computed together answer what one Infer per text answers. Not byte for byte: ONNX Runtime's
    CPU kernels round differently with the number of rows in an engine batch (by ~1e-8 here)."""
    texts = [unique(f"batch vs single {i}") for i in range(4)]
    with server.client() as client:
        batch = client.infer_batch(MODEL, texts, tenant="batched")
        singles = [client.infer(MODEL, t, tenant="single") for t in texts]
    assert [r.source for r in batch] == ["MISS"] * len(texts)
    for b, s in zip(batch, singles):
        np.testing.assert_allclose(b.outputs["embedding"], s.outputs["embedding"], rtol=0, atol=1e-6)


def test_a_long_batch_keeps_order_and_keys(server):
    texts = [unique(f"long batch item {i}") for i in range(40)]  # over TOKENIZE_INLINE_MAX: tokenized in a thread
    with server.client() as client:
        results = client.infer_batch(MODEL, texts)
        assert [r.source for r in results] == ["MISS"] * len(texts)
        assert len({r.key for r in results}) == len(texts)
        for i in (0, 17, 39):
            wait_cached(client, MODEL, texts[i])
            hit = client.infer(MODEL, texts[i])
            assert hit.key == results[i].key and _embedding(hit) == _embedding(results[i])
    for result in results:
        assert abs(np.linalg.norm(result.outputs["embedding"]) - 1) < 1e-5


def _batch_error(server, texts, **kwargs) -> grpc.RpcError:
    channel, stub = server.stub()
    with channel, pytest.raises(grpc.RpcError) as err:
        stub.InferBatch(pb.InferBatchRequest(texts=texts, **{"model": MODEL, **kwargs}), timeout=10)
    return err.value


@pytest.mark.parametrize("bad, reason", [("", "text is empty"), (" ?!… ", "text is empty"),
                                         ("x" * 2049, "at most 2048")])
def test_an_unusable_text_names_its_index(server, bad, reason):
    err = _batch_error(server, [unique("fine 0"), unique("fine 1"), bad, unique("fine 3")])
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "texts[2]" in err.details() and reason in err.details()


def test_empty_batch_is_invalid(server):
    err = _batch_error(server, [])
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "texts is empty" in err.details()


def test_unknown_model_is_not_found(server):
    err = _batch_error(server, [unique("anything")], model="no-such-model")
    assert err.code() == grpc.StatusCode.NOT_FOUND and "no-such-model" in err.details()


def test_only_if_cached_fails_naming_the_uncached_text_and_computes_nothing(server):
    cached = [unique(f"cached for only-if {i}") for i in range(2)]
    missing = unique("never computed")
    with server.client() as client:
        for text in cached:
            client.infer(MODEL, text)
            wait_cached(client, MODEL, text)
        computed = server.stats().worker.counters["worker.computed"]
        only_cached = pb.CachePolicy(mode=pb.CachePolicy.ONLY_IF_CACHED)
        err = _batch_error(server, [cached[0], cached[1], missing], cache=only_cached)
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "texts[2]" in err.details() and "ONLY_IF_CACHED" in err.details()
        assert server.stats().worker.counters["worker.computed"] == computed
        assert not is_cached(client, MODEL, missing)
        # All cached: answered from the cache.
        results = client.infer_batch(MODEL, cached, mode="ONLY_IF_CACHED")
        assert [r.source for r in results] == ["RESULT_EXACT"] * 2


def test_list_models_reports_batch_limit_and_engines(server):
    with server.client() as client:
        models = {m.name: m for m in client.models()}
    info = models[MODEL]
    assert info.max_batch_texts == 256
    assert [(e.model, e.version, e.runtime, e.device, e.worker) for e in info.engines] == [
        (MODEL, "1", "onnxruntime", "cpu", 0)]
    assert info.engines[0].precision == "fp32"
    shortlived = {(e.version, e.runtime) for e in models["shortlived"].engines}
    assert shortlived == {("1", "onnxruntime"), ("2", "onnxruntime")}


def test_batch_limit_is_enforced(start_server):
    server = start_server(settings=("server.max_batch_texts=4",), frontends=1)
    with server.client() as client:
        assert {m.name: m for m in client.models()}[MODEL].max_batch_texts == 4
        assert len(client.infer_batch(MODEL, [unique(f"at the limit {i}") for i in range(4)])) == 4
    err = _batch_error(server, [unique(f"over the limit {i}") for i in range(5)])
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "at most 4" in err.details() and "server.max_batch_texts" in err.details()
