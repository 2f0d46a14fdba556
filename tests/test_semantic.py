"""Semantic matching through the real server: a head trained by the CLI, hnswlib indexes, consensus."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import numpy as np
import pytest

from cachestore import records
from cachestore.env import Store, StoreSettings
from cachestore.keys import Namespace
from cachestore.results import now_us
from cachestore.semantic_log import Row, SemanticEntry
from cachestore.writer import WriteBehind
from harness.servers import ServerProcess, link_model, settled
from infercache.v1 import infercache_pb2 as pb
from server.shared.match_policy import MatchPolicy, Neighbor
from server.shared.answers import to_tensors
from server.worker.semantic.semantic_index import INITIAL_CAPACITY, SemanticTier, _Index
from tests.conftest import FAQ, MINILM_CONFIG, MODEL_VERSION_DIR, REPO
from tests.helpers import unique


@pytest.fixture(scope="module")
def semantic_server(tmp_path_factory, faq_models, engines_dir):
    srv = ServerProcess(tmp_path_factory.mktemp("semantic-server"), faq_models, engines_dir=engines_dir)
    yield srv
    assert srv.stop() == 0


def infer(server: ServerProcess, text: str, *, tenant: str = "", mode=pb.CachePolicy.DEFAULT, model: str = "faq",
          **semantic):
    channel, stub = server.stub()
    with channel:
        return stub.Infer(pb.InferRequest(model=model, text=text, tenant=tenant, cache=pb.CachePolicy(mode=mode),
                                          semantic=pb.SemanticPolicy(explain=True, **semantic)), timeout=30)


def wait_indexed(server: ServerProcess, count: int) -> None:
    deadline = time.monotonic() + 30
    while server.stats().worker.counters["semantic.indexed"] < count:
        assert time.monotonic() < deadline, "entries were not indexed"
        time.sleep(0.05)


def warm(server: ServerProcess, tenant: str, texts: list[str], model: str = "faq") -> None:
    """Caches each text as computed by the model (matching off, so none answers for another). The count
    it waits for starts once earlier writes have settled: an earlier test's answer indexed meanwhile
    would otherwise stand in for one of these."""
    before = settled(server, "semantic.indexed", idle=("writer.backlog", "semantic.shadow_pending"))
    for text in texts:
        assert infer(server, text, tenant=tenant, enabled=False, model=model).cache.source == pb.CacheInfo.MISS
    wait_indexed(server, before + len(texts))


def source(response) -> str:
    return pb.CacheInfo.Source.Name(response.cache.source)


def test_classification_answer_label_probability_and_scores(semantic_server):
    response = infer(semantic_server, unique("How do I reset my password?"), enabled=False)
    assert response.classification.label == "password_reset"
    scores = np.frombuffer(response.outputs[0].data, dtype=np.float32)
    assert response.outputs[0].name == "scores" and scores.shape == (8,)
    assert abs(scores.sum() - 1) < 1e-4 and abs(scores.max() - response.classification.probability) < 1e-6


def test_paraphrase_hits_unrelated_misses_and_the_hit_leaves_an_exact_alias(semantic_server):
    tenant = unique("t")
    warm(semantic_server, tenant, ["Where is my order?", "My package has not arrived yet", "Has my order been shipped?"])
    query = "my package still has not arrived, where is my order"
    hit = infer(semantic_server, query, tenant=tenant)
    assert source(hit) == "RESULT_SEMANTIC" and hit.classification.label == "order_status"
    assert hit.cache.similarity >= 0.62 and hit.cache.age_s >= 0
    assert [n.answer for n in hit.cache.neighbors[:2]] == ["order_status", "order_status"]
    unrelated = infer(semantic_server, "Which payment methods do you accept?", tenant=tenant)
    assert source(unrelated) == "MISS" and unrelated.classification.label == "payment_methods"
    deadline = time.monotonic() + 10
    while source(again := infer(semantic_server, query, tenant=tenant)) != "RESULT_EXACT":
        assert time.monotonic() < deadline, "the alias was not written"
        time.sleep(0.05)
    assert again.classification.label == "order_status"


def test_consensus_refuses_when_close_neighbours_disagree(semantic_server):
    tenant = unique("t")
    warm(semantic_server, tenant, ["how do I cancel my order", "how do I return my order"])
    query = "how do I cancel or return my order"
    response = infer(semantic_server, query, tenant=tenant, min_similarity=0.3)
    near = response.cache.neighbors
    assert len(near) == 2 and near[0].similarity >= 0.3 and near[1].similarity >= 0.3
    assert {near[0].answer, near[1].answer} == {"cancel_order", "returns"}
    assert source(response) == "MISS"  # a single threshold at 0.3 would have answered from near[0]


def test_tenants_never_match_each_other(semantic_server):
    a, b = unique("a"), unique("b")
    warm(semantic_server, a, ["How much does shipping cost?", "How much is express delivery?"])
    assert source(infer(semantic_server, "what does shipping cost", tenant=a)) == "RESULT_SEMANTIC"
    other = infer(semantic_server, "what does shipping cost", tenant=b)
    assert source(other) == "MISS" and len(other.cache.neighbors) == 0


def test_request_min_similarity_overrides_the_config(semantic_server):
    tenant = unique("t")
    warm(semantic_server, tenant, ["When is your store open?", "What time does the shop close today?"])
    strict = infer(semantic_server, "what time does your store open", tenant=tenant, min_similarity=0.99,
                   mode=pb.CachePolicy.NO_STORE)
    assert source(strict) == "MISS" and strict.cache.neighbors[0].similarity < 0.99
    assert source(infer(semantic_server, "what time does your store open", tenant=tenant)) == "RESULT_SEMANTIC"
    off = infer(semantic_server, "what time does the store open", tenant=tenant, enabled=False)
    assert source(off) == "MISS" and len(off.cache.neighbors) == 0


def test_invalidating_a_version_removes_its_entries_from_the_index(semantic_server):
    tenant = unique("t")
    warm(semantic_server, tenant, ["How do I change my delivery address?", "Can I change where my parcel is delivered?"])
    assert source(infer(semantic_server, "i need to change my delivery address", tenant=tenant,
                        mode=pb.CachePolicy.NO_STORE)) == "RESULT_SEMANTIC"
    before = semantic_server.stats().worker.counters["semantic.unindexed"]
    with semantic_server.client() as client:
        assert client.invalidate(model="faq", version="1", tenant=tenant) == 2
    deadline = time.monotonic() + 10
    while semantic_server.stats().worker.counters["semantic.unindexed"] < before + 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    after = infer(semantic_server, "i need to change my delivery address", tenant=tenant, mode=pb.CachePolicy.NO_STORE)
    assert source(after) == "MISS" and len(after.cache.neighbors) == 0


def test_expired_entries_leave_the_index(semantic_server):
    tenant = unique("t")
    texts = ["How much does shipping cost?", "How much is express delivery?"]
    before = semantic_server.stats().worker.counters["semantic.unindexed"]
    warm(semantic_server, tenant, texts, model="faq-short")
    query = "what does shipping cost"
    fresh = infer(semantic_server, query, tenant=tenant, model="faq-short", mode=pb.CachePolicy.NO_STORE)
    assert source(fresh) == "RESULT_SEMANTIC"
    deadline = time.monotonic() + 20  # TTL 2 s, the test server sweeps every second
    while semantic_server.stats().worker.counters["semantic.unindexed"] < before + 2:
        assert time.monotonic() < deadline, "expired entries were not swept out of the index"
        time.sleep(0.1)
    after = infer(semantic_server, query, tenant=tenant, model="faq-short", mode=pb.CachePolicy.NO_STORE)
    assert source(after) == "MISS" and len(after.cache.neighbors) == 0


def test_with_two_workers_entries_removed_by_either_leave_every_index(start_server, faq_models):
    """A semantic namespace is routed to one worker (its index lives there), but the delete of an
    Invalidate, a sweep or an eviction runs in whichever worker gets there first: the owner drops gone
    entries from its index either way (told by its own writer, or at its next lookup)."""
    server = start_server(models=faq_models, settings=("server.workers=2",))
    indexed = lambda: [w.counters["semantic.indexed"] for w in sorted(server.stats().workers, key=lambda w: w.index)]  # noqa: E731
    for attempt in range(8):  # a tenant whose namespace lives in worker 1: Invalidate goes to worker 0
        tenant = unique("t")
        before = indexed()
        for text in ["How do I change my delivery address?", "Can I change where my parcel is delivered?"]:
            infer(server, text, tenant=tenant, enabled=False)
        deadline = time.monotonic() + 30
        while sum(indexed()) < sum(before) + 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        if indexed()[1] == before[1] + 2:
            break
    else:
        pytest.fail("no tenant was routed to worker 1 in 8 tries")
    query = "i need to change my delivery address"
    assert source(infer(server, query, tenant=tenant, mode=pb.CachePolicy.NO_STORE)) == "RESULT_SEMANTIC"
    gone = lambda: sum(next(w for w in server.stats().workers if w.index == 1).counters[name]  # noqa: E731
                       for name in ("semantic.stale_dropped", "semantic.unindexed"))
    dropped = gone()
    with server.client() as client:
        assert client.invalidate(model="faq", tenant=tenant) == 2
    after = infer(server, query, tenant=tenant, mode=pb.CachePolicy.NO_STORE)
    assert source(after) == "MISS" and len(after.cache.neighbors) == 0
    assert gone() >= dropped + 2


def test_nearest_similarity_histogram_in_stats(semantic_server):
    counters = semantic_server.stats().worker.counters
    assert counters["semantic.lookups"] > 0
    assert sum(v for k, v in counters.items() if k.startswith("semantic.nearest.")) == counters["semantic.lookups"]


def test_index_comes_back_after_restart_from_snapshot_and_from_the_log(start_server, faq_models):
    first = start_server(models=faq_models)
    warm(first, "", ["How do I reset my password?", "I forgot my password", "I can't log in to my account"])
    assert first.stop() == 0
    snapshots = list((first.cache_dir / "semantic" / "worker-0").glob("*.hnsw"))
    assert len(snapshots) == 1

    for label, prepare in (("snapshot", lambda: None), ("log", lambda: [p.unlink() for p in snapshots])):
        prepare()
        again = start_server(models=faq_models, cache_dir=first.cache_dir)
        deadline = time.monotonic() + 30
        while "semantic indexes ready" not in again.log_text():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        counters = again.stats().worker.counters
        assert counters[f"semantic.rebuilt_from_{label}"] == 3, counters
        hit = infer(again, "i forgot my password and cannot log in", mode=pb.CachePolicy.NO_STORE)
        assert source(hit) == "RESULT_SEMANTIC" and hit.classification.label == "password_reset"
        assert again.stop() == 0


def test_eval_semantic_reports_hits_fidelity_and_draws_the_curve(semantic_server, tmp_path):
    out = tmp_path / "eval.json"
    result = subprocess.run(
        [sys.executable, "-m", "server", "eval-semantic", str(FAQ), "--model", "faq", "--address",
         semantic_server.address, "--label-column", "intent", "--folds", "2", "--out", str(out),
         "--png", str(tmp_path / "eval.png")], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "fold 2/2" in result.stdout and "recommended" in result.stdout
    report = __import__("json").loads(out.read_text())
    assert report["rows"] == 52 and len(report["sweep"]["fixed_threshold"]) == 20
    for point in report["sweep"]["consensus"]:
        assert 0 <= point["hit_rate"] <= 1 and 0 <= point["fidelity"] <= 1
    for point in report["sweep"]["fixed_threshold"] + report["sweep"]["consensus"]:  # beside the model, the labels
        if point["semantic_hits"]:
            low, high = point["fidelity_labels_95"]
            assert low <= point["fidelity_labels"] <= high and point["fidelity_95"][0] <= point["fidelity"]
        else:
            assert point["fidelity_labels"] is None and point["fidelity_labels_95"] is None
    assert any(p["semantic_hits"] for p in report["sweep"]["fixed_threshold"]) and "by the labels" in result.stdout
    assert (tmp_path / "eval.png").stat().st_size > 10_000


def test_match_policy_rules():
    policy = MatchPolicy(min_similarity=0.8, neighborhood=0.7, k=5, min_agree=2)
    n = lambda s, a: Neighbor(s, b"", a)  # noqa: E731
    assert policy.decide([n(0.9, "x"), n(0.75, "x")]).answer == "x"
    assert policy.decide([n(0.9, "x")]) is None                      # a lone neighbour is not enough
    assert policy.decide([n(0.9, "x"), n(0.72, "y")]) is None         # a close neighbour disagrees
    assert policy.decide([n(0.9, "x"), n(0.8, "x"), n(0.6, "y")]).answer == "x"  # far ones do not count
    assert policy.decide([n(0.79, "x"), n(0.78, "x")]) is None        # nearest below the floor
    assert policy.decide([n(0.79, "x"), n(0.78, "x")], min_similarity=0.7).answer == "x"
    assert policy.decide([]) is None


def test_neighborhood_decides_which_neighbours_must_agree():
    """It had no effect under the defaults (the rule took min(neighborhood, min_similarity))."""
    n = lambda s, a: Neighbor(s, b"", a)  # noqa: E731
    neighbors = [n(0.92, "x"), n(0.8, "x"), n(0.68, "y"), n(0.63, "y")]
    decisions = {hood: MatchPolicy(min_similarity=0.62, neighborhood=hood).decide(neighbors) is not None
                 for hood in (0.62, 0.65, 0.70, 0.90)}
    assert decisions == {0.62: False, 0.65: False, 0.70: True, 0.90: False}  # 0.90: the nearest alone, min_agree 2


def test_index_grows_past_its_capacity_and_forgets_removed_entries():
    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((INITIAL_CAPACITY + 500, 16)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    index = _Index(dim=16)
    index.add([Row(b"n" * 8, i, bytes([i % 256]) * 24, f"a{i % 3}", v) for i, v in enumerate(vectors)])
    assert index.graph.get_max_elements() >= len(vectors) and len(index.rows) == len(vectors)
    (label, nearest), *_ = index.search(vectors[1234], 3, lambda key: True)
    assert label == 1234 and nearest.similarity > 0.999 and nearest.answer == "a1"
    index.remove(1234)
    assert all(n.similarity < 0.999 for _, n in index.search(vectors[1234], 3, lambda key: True))


BANKING77 = REPO / "bench" / "data" / "banking77" / "train.csv"


@pytest.mark.skipif(not BANKING77.is_file(), reason="bench/data/banking77/train.csv is missing")
def test_train_head_on_banking77_writes_a_servable_version(tmp_path):
    models = tmp_path / "models"
    link_model(models, "minilm", MINILM_CONFIG, {"1": MODEL_VERSION_DIR})
    command = [sys.executable, "-m", "server", "train-head", str(BANKING77), "--name", "banking77",
               "--label-column", "category", "--models-dir", str(models), "--limit", "600", "--epochs", "200"]
    first = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr
    assert "embedded 600/600" in first.stdout and "held out (5 folds)" in first.stdout
    assert "as a judge of semantic answers" in first.stdout
    assert (models / "banking77" / "1" / "label_calibration.json").is_file()
    second = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0 and (models / "banking77" / "2" / "head.json").is_file()  # next version
    from server.shared.models import ModelRepository

    spec = ModelRepository(models).get("banking77")
    labels = __import__("json").loads((models / "banking77" / "1" / "labels.json").read_text())
    assert spec.task == "classification" and spec.semantic is not None and spec.versions == ("1", "2")
    import csv

    with open(BANKING77, newline="") as f:
        expected = sorted({row["category"] for row, _ in zip(csv.DictReader(f), range(600))})
    assert labels == expected and len(labels) >= 2


def test_train_head_names_a_missing_column(tmp_path):
    result = subprocess.run([sys.executable, "-m", "server", "train-head", str(FAQ), "--name", "x",
                             "--label-column", "category", "--models-dir", str(REPO / "models")],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "no column 'category'" in result.stderr and "intent" in result.stderr
    assert not (REPO / "models" / "x").exists()
    evaluated = subprocess.run([sys.executable, "-m", "server", "eval-semantic", str(FAQ), "--model", "faq",
                                "--label-column", "category", "--out", str(tmp_path / "e.json")],
                               cwd=REPO, capture_output=True, text=True, timeout=120)
    assert evaluated.returncode == 2 and "no column 'category'" in evaluated.stderr


def test_a_search_reads_scores_again_once_another_writer_rewrote_the_entry(tmp_path):
    """Searches keep each entry's embedding and class scores decoded. Another worker of the host may
    rewrite an entry (a correction) without this worker's index hearing of it: the scores must then be
    read anew from the record, not taken from what was decoded before."""
    labels = ["refund", "card_lost"]
    ns = Namespace("t", "m", "1")
    rng = np.random.default_rng(1)
    vectors = rng.standard_normal((12, 8)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    keys = [ns.ns_id + bytes([i]) * 16 for i in range(len(vectors))]
    query = 0.7 * vectors[0] + 0.3 * vectors[1]
    query /= np.linalg.norm(query)

    def record(scores: list[float]) -> records.Record:
        payload = pb.InferResponse(outputs=to_tensors({"scores": np.array(scores, np.float32)})).SerializeToString()
        return records.Record(now_us(), now_us() + 3_600_000_000, payload)

    async def run() -> tuple[str, str]:
        store = Store(StoreSettings(tmp_path / "cache", 64 << 20, 48 << 20, sync=False), readonly=False)
        tier = SemanticTier(store, tmp_path / "snapshots", 8)
        ours, other = WriteBehind(store, on_semantic=tier.apply), WriteBehind(store)
        await tier.start()
        for i, key in enumerate(keys):
            ours.put(key, ns, record([0.9, 0.1]), semantic=SemanticEntry(ns.ns_id, labels[0], vectors[i]))
        ours.flush().result(10)
        _, before = await tier.search(ns.ns_id, query, 10, labels)
        for key in keys:  # the other worker's correction: same keys, this tier not told
            other.put(key, ns, record([0.05, 0.95]))
        other.flush().result(10)
        _, after = await tier.search(ns.ns_id, query, 10, labels)
        ours.close()
        other.close()
        await tier.close()
        store.close()
        return before.answer, after.answer

    assert asyncio.run(run()) == ("refund", "card_lost")


def test_a_semantic_section_without_enabled_is_said_at_start(tmp_path, engines_dir):
    """A section that is there but off answers exactly, as configured, and says so once at start."""
    models = tmp_path / "models"
    link_model(models, "minilm", MINILM_CONFIG + "semantic: {max_error: 0.01}\n", {"1": MODEL_VERSION_DIR})
    server = ServerProcess(tmp_path, models, frontends=1, engines_dir=engines_dir)
    try:
        assert "minilm: its semantic: section is off" in server.log_text()
    finally:
        assert server.stop() == 0
