"""The feature tier (L2): head models on the encoder's output, kept in a memory LRU and the host's LMDB
feature store. Real servers (real worker processes, real LMDB files) on the default encoder and a head
trained by train-head on examples/faq.csv."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import Counter
from pathlib import Path

import grpc
import numpy as np
import pytest

from cachestore import records
from cachestore.env import DB_RESULTS, Store
from cachestore.errors import CorruptRecord
from cachestore.keys import Namespace
from harness.servers import ServerProcess, link_model, settled
from server.worker.batcher import Batcher
from server.config import Config, feature_store_settings
from server.worker.store.feature_lru import DeviceRow, FeatureLRU
from server.shared.feature_records import decode, encode, feature_key, storage_dtype
from tests.conftest import FAQ, MINILM_CONFIG, MODEL_VERSION_DIR
from tests.helpers import reseal_crc, unique, wait_cached

QUESTIONS = ["how do I reset my password", "where is my parcel", "can I pay by card", "cancel my subscription",
             "what are your opening hours", "I was charged twice", "change my delivery address",
             "do you ship abroad", "my account is locked", "talk to a human please"]


@pytest.fixture(scope="module")
def head_models(tmp_path_factory) -> Path:
    """minilm; faq (a head by train-head, semantic on); faq-graph (the same head as one ONNX graph with
    the encoder, the format before L2); intents (the head without semantic matching, four versions of the
    same weights); intents-shared (the same, features shared across tenants)."""
    from server.tools.train_head import train

    root = tmp_path_factory.mktemp("head-models")
    link_model(root, "minilm", MINILM_CONFIG, {"1": MODEL_VERSION_DIR})
    quiet = lambda line: None  # noqa: E731
    head = train(FAQ, text_column="text", label_column="intent", models_dir=root, encoder="minilm", name="faq",
                 epochs=100, progress=quiet)
    graph = train(FAQ, text_column="text", label_column="intent", models_dir=root, encoder="minilm",
                  name="faq-graph", epochs=100, whole_graph=True, progress=quiet)
    assert (head / "head.json").is_file() and not (head / "model.onnx").exists()
    assert (graph / "model.onnx").is_file() and not (graph / "head.json").exists()
    plain = (root / "faq" / "config.yaml").read_text().split("semantic:")[0]  # train-head writes it last
    versions = {v: head for v in ("1", "2", "3", "4")}
    link_model(root, "intents", plain, versions)
    link_model(root, "intents-shared", plain + "\nl2:\n  share_across_tenants: true\n", versions)
    return root


def _counters(server: ServerProcess) -> Counter:
    """Every worker's counters, summed."""
    total: Counter = Counter()
    for worker in server.stats().workers:
        total.update(dict(worker.counters))
    return total


def _encoded(server: ServerProcess) -> int:
    return _counters(server)["batcher.minilm.1.batched_requests"]


def _wait_features_written(server: ServerProcess, count: int) -> None:
    deadline = time.monotonic() + 10
    while _counters(server)["features.writer.writes"] < count:
        assert time.monotonic() < deadline, "features were not written behind within 10 s"
        time.sleep(0.05)


def test_a_new_head_version_answers_from_features_and_the_encoder_runs_once_per_miss(start_server, head_models):
    # Heads run in the worker only: its memory level (on the GPU on a GPU host) answers; the frontends'
    # own FEATURE answers are tested below.
    server = start_server(head_models, settings=("l2.frontend_head_mb=0",))
    texts = [unique(q) for q in QUESTIONS]
    with server.client() as client:
        before = _encoded(server)
        first = [client.infer("faq", t) for t in texts]  # semantic matching on: the encoder is also the embedder
        assert [r.source for r in first] == ["MISS"] * len(texts)
        assert _encoded(server) - before == len(texts)  # once per miss (the whole graph runs it twice: below)

        bumped = [client.infer("intents", t, version="2") for t in texts]  # same encoder, same tenant
        assert [r.source for r in bumped] == ["FEATURE"] * len(texts)
        assert _encoded(server) - before == len(texts)
        for a, b in zip(first, bumped):
            assert a.label == b.label and b.model_version == "2"
            np.testing.assert_allclose(a.outputs["scores"], b.outputs["scores"], atol=1e-6)
        for t in texts[:3]:  # the worker's copies into L1, once written behind (cache.group_commit_ms)
            wait_cached(client, "intents", t, version="2")
        assert [client.infer("intents", t, version="2").source for t in texts[:3]] == ["RESULT_EXACT"] * 3

        before = _encoded(server)
        graph = [client.infer("faq-graph", unique(q)) for q in QUESTIONS]
        assert [r.source for r in graph] == ["MISS"] * len(texts)
        assert _encoded(server) - before == len(texts)  # the embedder's run; the graph's own is not counted here
        assert _counters(server)["batcher.faq-graph.1.batched_requests"] == len(texts)
        # The same weights: the same labels. Probabilities differ a little: the head reads FP16-stored
        # features (on CPU the graph runs in FP32; on a GPU all of the graph runs in FP16: up to 0.02 seen).
        same = [client.infer("faq-graph", t) for t in texts]
        assert [a.label for a in same] == [a.label for a in first]
        for a, b in zip(first, same):
            np.testing.assert_allclose(a.outputs["scores"], b.outputs["scores"], atol=0.05)
    counters = _counters(server)
    assert counters["worker.l2_device_hits"] == len(texts) and counters["worker.feature_answers"] == len(texts)


def test_a_frontend_answers_from_a_stored_feature_as_the_worker_would_and_copies_the_answer_into_l1(
        start_server, head_models):
    texts = [unique(q) for q in QUESTIONS]
    answers = {}
    for label, settings in (("worker", ("l2.frontend_head_mb=0",)), ("frontend", ())):
        server = start_server(head_models, frontends=1, settings=settings)
        with server.client() as client:
            assert {client.infer("intents", t, version="1").source for t in texts} == {"MISS"}
            # One call mixes an exact hit (version 1 again) and a text never seen (a miss).
            fresh = unique("where can I find my invoice")
            wait_cached(client, "intents", texts[0], version="1")  # (until then the worker answers: COALESCED)
            mixed = client.infer_batch("intents", [texts[0], fresh], version="1")
            assert [r.source for r in mixed] == ["RESULT_EXACT", "MISS"]
            _wait_features_written(server, len(texts) + 1)
            before = _counters(server)
            bumped = [client.infer("intents", t, version="2") for t in texts[:5]]
            bumped += client.infer_batch("intents", texts[5:] + [fresh], version="2")
            assert [r.source for r in bumped] == ["FEATURE"] * len(bumped)
            answers[label] = bumped
            after, frontend = _counters(server), client.stats().frontend.counters
            made_here = len(bumped) if label == "frontend" else 0
            assert frontend["frontend.feature_answers"] == made_here
            assert after["worker.feature_answers"] - before["worker.feature_answers"] == len(bumped) - made_here
            assert _encoded(server) == _encoded_in(before)  # no FEATURE answer ran the encoder
            if label == "frontend":
                # A one-off FEATURE answer made here is not written to L1; a text's second one is copied
                # into L1 through the worker, and the text is an exact hit from then on, with the same answer.
                assert frontend["frontend.feature_copies"] == 0
                writes = settled(server, "writer.writes", timeout=10, poll_s=0.2)
                assert {client.infer("intents", t, version="2").source for t in texts} == {"FEATURE"}
                assert client.stats().frontend.counters["frontend.feature_copies"] == len(texts)
                assert settled(server, "writer.writes", timeout=10, poll_s=0.2) - writes == len(texts)
                again = [client.infer("intents", t, version="2") for t in texts]
                assert {r.source for r in again} == {"RESULT_EXACT"}
                assert [r.label for r in again] == [r.label for r in bumped[:len(texts)]]
                # Neither under NO_STORE (answered, never copied) nor under BYPASS (no stored answer at
                # all: the worker computes, the feature it reads included).
                for _ in range(2):
                    assert {client.infer("intents", t, version="3", mode="NO_STORE").source for t in texts} == {"FEATURE"}
                assert client.stats().frontend.counters["frontend.feature_copies"] == len(texts)
                assert {client.infer("intents", t, version="3", mode="BYPASS").source for t in texts[:3]} == {"MISS"}
    for here, there in zip(answers["frontend"][:len(texts)], answers["worker"]):  # (not the fresh texts)
        assert here.label == there.label and here.model_version == "2"
        np.testing.assert_allclose(here.outputs["scores"], there.outputs["scores"], atol=1e-6)


def test_a_feature_answer_a_frontend_copies_is_shared_through_the_fleet(start_server, head_models, tmp_path):
    """As a worker's answers are: a text's second FEATURE answer made in pod A's frontend reaches pod B
    through Redis, which then answers it as a fleet hit."""
    pytest.importorskip("redis")
    from harness import redis_servers
    from tests.test_fleet import TEST_BUDGET_MS, fleet_usable, until, worker_counter

    redis = redis_servers.RedisProcess(tmp_path / "redis")
    try:
        settings = (f"fleet.redis={redis.url}", f"fleet.timeout_ms={TEST_BUDGET_MS}")
        a, b = (start_server(head_models, frontends=1, settings=settings) for _ in range(2))
        for pod in (a, b):
            until(lambda: fleet_usable(pod))
        text = unique("fleet: where is my parcel")
        with a.client() as ca, b.client() as cb:
            assert ca.infer("intents", text, version="1").source == "MISS"
            _wait_features_written(a, 1)
            writes = worker_counter(a, "fleet.writes")
            assert [ca.infer("intents", text, version="2").source for _ in range(2)] == ["FEATURE"] * 2
            until(lambda: worker_counter(a, "fleet.writes") > writes)
            shared = cb.infer("intents", text, version="2", mode="ONLY_IF_CACHED")
            assert shared.source == "RESULT_FLEET" and shared.model_version == "2"
    finally:
        redis.stop()


def _encoded_in(counters: Counter) -> int:
    return counters["batcher.minilm.1.batched_requests"]


def test_tenants_reach_each_others_features_only_when_the_model_shares_them(start_server, head_models):
    server = start_server(head_models)
    texts = [unique(q) for q in QUESTIONS[:4]]
    with server.client() as client:
        for model in ("intents", "intents-shared"):
            assert {client.infer(model, t, tenant="a").source for t in texts} == {"MISS"}
        assert {client.infer("intents", t, version="2", tenant="b").source for t in texts} == {"MISS"}
        assert {client.infer("intents", t, version="2", tenant="a").source for t in texts} == {"FEATURE"}
        assert {client.infer("intents-shared", t, version="2", tenant="b").source for t in texts} == {"FEATURE"}

        # Tenant a's own features (not b's, not the shared ones); the delete is ordered after the writes.
        assert client.invalidate(features=True, model="minilm", tenant="a") == len(texts)
        assert {client.infer("intents", t, version="3", tenant="a").source for t in texts} == {"MISS"}
        assert {client.infer("intents-shared", t, version="3", tenant="c").source for t in texts} == {"FEATURE"}
        with pytest.raises(grpc.RpcError) as refused:
            client.invalidate(features=True, model="minilm", text="hello")
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_features_are_shared_by_two_workers_survive_a_restart_and_a_corrupt_one_is_a_miss(
        tmp_path, head_models, engines_dir):
    texts = [unique(q) for q in QUESTIONS]
    cache = tmp_path / "cache"
    (tmp_path / "a").mkdir()
    in_workers = ("l2.frontend_head_mb=0",)  # the workers' host level (frontends read the store first)
    with ServerProcess(tmp_path / "a", head_models, cache_dir=cache, engines_dir=engines_dir,
                       settings=("server.workers=2", *in_workers)) as server:
        with server.client() as client:
            first = [client.infer("intents", t, version="1") for t in texts]
            _wait_features_written(server, len(texts))
            # Version 2's keys route to either worker: the one that did not compute a text reads the
            # feature its peer wrote to the host's store.
            assert {client.infer("intents", t, version="2").source for t in texts} == {"FEATURE"}
        counters = _counters(server)
        assert counters["worker.l2_host_hits"] > 0
        assert counters["worker.l2_host_hits"] + counters["worker.l2_device_hits"] == len(texts)

    again, counters, _ = _served_once(tmp_path / "b", head_models, cache, engines_dir, "3", texts, in_workers)
    assert {r.source for r in again} == {"FEATURE"}
    assert [r.label for r in again] == [r.label for r in first]
    assert counters["worker.l2_host_hits"] == len(texts)

    # Damage every stored feature: half no longer decode as a feature (checksum made valid again),
    # half fail their checksum. Each is a miss, computed and answered correctly (the frontend finds
    # them unreadable first, the worker again).
    store = Store(dataclasses.replace(feature_store_settings(Config()), path=cache / "features"), readonly=False)
    with store.begin(write=True) as txn:
        rows = list(txn.cursor(db=store.dbs[DB_RESULTS]))
        assert len(rows) >= len(texts)
        for n, (key, raw) in enumerate(rows):
            damaged = raw[:records.HEADER.size] + b"X" + raw[records.HEADER.size + 1:]
            txn.put(key, reseal_crc(damaged) if n % 2 else damaged, db=store.dbs[DB_RESULTS])
    store.close()
    recomputed, counters, frontend = _served_once(tmp_path / "c", head_models, cache, engines_dir, "4", texts)
    assert {r.source for r in recomputed} == {"MISS"}
    assert [r.label for r in recomputed] == [r.label for r in first]
    for unreadable in (counters["features.unreadable"], frontend["frontend.features_unreadable"]):
        assert unreadable > 0
    assert counters["features.records_unreadable"] > 0 and frontend["features.records_unreadable"] > 0
    assert counters["features.unreadable"] + counters["features.records_unreadable"] == len(texts)
    assert frontend["frontend.features_unreadable"] + frontend["features.records_unreadable"] == len(texts)


def _served_once(workdir: Path, models: Path, cache: Path, engines: Path, version: str, texts: list[str],
                 settings: tuple[str, ...] = ()):
    """A fresh server (one worker, one frontend) on `cache`: its answers to `texts` from intents
    `version`, then its workers' counters and its frontend's."""
    workdir.mkdir()
    with ServerProcess(workdir, models, cache_dir=cache, engines_dir=engines, settings=settings, frontends=1) as server:
        with server.client() as client:
            results = [client.infer("intents", t, version=version) for t in texts]
            frontend = client.stats().frontend.counters
        return results, _counters(server), frontend


def test_a_head_whose_tokenizer_or_max_tokens_differ_from_its_encoders_is_refused(head_models):
    """A feature is keyed by the normalized text alone, so every head on an encoder must tokenize as the
    encoder does: one truncating shorter would read features computed on longer inputs."""
    from server.shared.head_scoring import load_head
    from server.shared.models import ModelConfigError, ModelRepository

    repository = ModelRepository(head_models)
    spec, encoder = repository.get("intents"), repository.get("minilm")
    ref = spec.head("1")
    weight, bias, labels = load_head(spec, "1", ref, encoder)
    assert weight.shape[0] == 384 and bias.shape == (len(labels),)
    for other in (dataclasses.replace(spec, max_tokens=spec.max_tokens // 2),
                  dataclasses.replace(spec, max_tokens=spec.max_tokens + 1)):
        with pytest.raises(ModelConfigError, match="max_tokens"):
            load_head(other, "1", ref, encoder)
    with pytest.raises(ModelConfigError, match="no output"):
        load_head(spec, "1", dataclasses.replace(ref, input="nope"), encoder)


def test_a_truncated_head_file_is_a_model_error_not_a_crash(head_models, tmp_path):
    import shutil

    from server.shared.head_scoring import read_weights
    from server.shared.models import HEAD_WEIGHTS_FILE, ModelConfigError

    version = tmp_path / "1"
    shutil.copytree(head_models / "intents" / "1", version)
    data = (version / HEAD_WEIGHTS_FILE).read_bytes()
    (version / HEAD_WEIGHTS_FILE).write_bytes(data[:len(data) // 2])
    with pytest.raises(ModelConfigError, match=HEAD_WEIGHTS_FILE):
        read_weights(version)


# ---- the memory level and the stored form, without a server ----------------------------------------

NS_A, NS_B = Namespace("t:a", "minilm", "1"), Namespace("t:b", "minilm", "1")


def _key(k: int) -> bytes:  # namespace "a" below 1000, "b" from there: key = namespace id + number
    return (NS_A if k < 1000 else NS_B).ns_id + k.to_bytes(16, "big")


def _fill(lru: FeatureLRU, keys: range, expires_us: int = 0) -> None:
    for k in keys:
        lru.put(_key(k), np.full(lru.dim, k % 1000, dtype=lru.dtype), NS_A if k < 1000 else NS_B, expires_us)


def _value(lru: FeatureLRU, found) -> float:
    """First component of what a lookup returned (a host copy, or a pinned device row: gathered, released)."""
    if isinstance(found, DeviceRow):
        value = float(lru.gather([found])[0][0])
        lru.release(found)
        return value
    return float(found[0])


def _get(lru: FeatureLRU, k: int, now_us: int = 1):
    return lru.get(_key(k), now_us)


def _check_lru(device: str | None) -> None:
    row = 384 * 2
    lru = FeatureLRU(384, "float16", 10 * row + row // 2, device)
    assert lru.capacity == 10
    _fill(lru, range(10))
    assert _value(lru, _get(lru, 0)) == 0.0  # 0 is now the most recently used
    _fill(lru, range(10, 15))                   # evicts 1..5, the least recently used
    held = [k for k in range(15) if _key(k) in lru]
    assert held == [0] + list(range(6, 15)) and len(lru) == 10 and lru.allocated_bytes <= 10 * row + row // 2
    copy = _get(lru, 14)                    # a host copy, or a pinned row: neither changes ...
    _fill(lru, range(100, 110))                 # ... while every other row is reused
    assert (_key(14) in lru) == bool(device)   # a pinned row is passed over; the next oldest goes instead
    assert _value(lru, copy) == 14.0 and lru.counters["evicted"] == 15
    _fill(lru, range(1000, 1005))               # namespace b: evicts 5 of a's
    assert lru.purge(lambda ns: ns == NS_B) == 5 and len(lru) == 5
    assert lru.counters["evicted"] == 20
    _fill(lru, range(200, 205))                 # purged rows are reused before any eviction
    assert len(lru) == 10 and lru.counters["evicted"] == 20
    assert _value(lru, _get(lru, 204)) == 204.0
    _fill(lru, range(300, 301), expires_us=5)   # an expired feature is a miss, and gone
    assert _value(lru, _get(lru, 300, now_us=4)) == 300.0
    assert _get(lru, 300, now_us=5) is None and len(lru) == 9
    assert FeatureLRU(384, "float16", row - 1, device).capacity == 0
    if device:  # a row purged while a head batch reads it is reused only after the read
        pinned = _get(lru, 200)
        lru.purge(lambda ns: ns == NS_A)
        _fill(lru, range(1000, 1010))
        assert _value(lru, pinned) == 200.0


def test_the_memory_lru_keeps_its_byte_cap_and_evicts_least_recently_used_first():
    _check_lru(None)


def test_the_device_lru_logic_on_torch_cpu_tensors():
    """Pins, batched copies in and gathers, with torch tensors in host memory (CUDA: the next test)."""
    pytest.importorskip("torch", reason="the device LRU runs on torch")
    _check_lru("cpu")


def test_the_device_lru_gathers_rows_across_slabs_in_order():
    pytest.importorskip("torch", reason="the device LRU runs on torch")
    lru = FeatureLRU(4, "float32", 3 << 19, "cpu")  # 1.5 MiB of 16-byte rows: slabs of at most 1 MiB
    assert lru.capacity == 98_304 and lru.slab_rows == 65_536
    _fill(lru, range(lru.capacity))
    lru.flush()
    picks = np.random.default_rng(0).integers(0, lru.capacity, 64)
    handles = [_get(lru, int(k)) for k in picks]
    assert len({h.row // lru.slab_rows for h in handles}) == 2
    assert np.array_equal(lru.gather(handles)[:, 0].numpy(), (picks % 1000).astype(np.float32))


def test_the_memory_lru_on_the_gpu_keeps_its_cap_in_device_memory():
    torch = pytest.importorskip("torch", reason="the device LRU needs torch (a GPU host's cuda extra)")
    if not torch.cuda.is_available():
        pytest.skip("the device LRU needs a CUDA GPU (run on an H200 through bench/device.sh)")
    _check_lru("cuda")
    before = torch.cuda.memory_allocated()
    cap = 64 << 20
    lru = FeatureLRU(384, "float16", cap, "cuda")
    _fill(lru, range(200_000))  # 2.3x what fits
    lru.flush()
    assert len(lru) == lru.capacity and 0.9 * cap < lru.capacity * 768 <= cap
    assert torch.cuda.memory_allocated() - before <= cap
    assert _value(lru, _get(lru, 199_999)) == 999.0


def test_the_head_gives_the_same_scores_on_torch_for_features_in_the_lru_and_on_the_host():
    pytest.importorskip("torch", reason="the GPU head runs on torch")
    from server.worker.semantic.heads import _NumpyHead, _TorchHead

    rng = np.random.default_rng(1)
    weight, bias = rng.normal(size=(384, 7)).astype(np.float32), rng.normal(size=7).astype(np.float32)
    rows = [rng.normal(size=384).astype(np.float16) for _ in range(5)]
    lru = FeatureLRU(384, "float16", 1 << 20, "cpu")
    for n in (1, 3):
        lru.put(_key(n), rows[n], NS_A)
    mixed = [_get(lru, n) if n in (1, 3) else r for n, r in enumerate(rows)]  # as the LRU and LMDB give them
    expected = _NumpyHead(weight, bias).run(rows)
    head = _TorchHead(weight, bias, "cpu")
    np.testing.assert_allclose(head.run(mixed), expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(head.run([mixed[1], mixed[3]]), expected[[1, 3]], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(head.run(rows[:2]), expected[:2], rtol=1e-5, atol=1e-6)
    assert np.allclose(expected.sum(axis=1), 1)

    async def batched():  # through a batcher, as the worker runs heads (it buckets features by length)
        batcher = Batcher(lambda features: list(head.run(features)), buckets=(384,), max_batch=8,
                          max_delay_s=0.0, max_queue=100)
        scores = await asyncio.gather(*(batcher.submit(f, None) for f in mixed))
        await batcher.close()
        return np.stack(scores)

    np.testing.assert_allclose(asyncio.run(batched()), expected, rtol=1e-5, atol=1e-6)


def test_features_are_stored_in_fp16_only_when_the_encoder_output_survives_it():
    rng = np.random.default_rng(0)
    unit = rng.normal(size=(8, 384)).astype(np.float32)
    unit /= np.linalg.norm(unit, axis=1, keepdims=True)
    assert storage_dtype(unit) == np.float16
    assert storage_dtype(unit * 1e7) == np.float32            # overflows FP16
    assert storage_dtype(unit * 1e-6) == np.float32           # below FP16's smallest: every component vanishes
    assert storage_dtype(np.vstack([unit, np.zeros((1, 384), np.float32)])) == np.float16
    half = unit[0].astype(np.float16)
    assert np.array_equal(decode(encode(half), 384), half)
    # Two outputs of one encoder never share a key; two tenants' namespaces neither.
    assert feature_key(NS_A, ("minilm", "1", "cls"), "hi") != feature_key(NS_A, ("minilm", "1", "mean"), "hi")
    assert feature_key(NS_A, ("minilm", "1", "cls"), "hi") != feature_key(NS_B, ("minilm", "1", "cls"), "hi")
    for bad in (encode(half)[:-2], b"G" + encode(half)[1:], encode(unit[0])[:-4]):
        with pytest.raises(CorruptRecord):
            decode(bad, 384)
