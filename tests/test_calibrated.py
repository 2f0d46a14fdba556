"""The calibrated semantic rule: interpolation of the neighbours' class scores, the error bound learnt from
outcomes, and shadow verification of hits, through a real server (tests/test_semantic.py has the
consensus rule)."""

from __future__ import annotations

import asyncio
import base64
import csv
import json
import math
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from harness.servers import ServerProcess, link_model, settled
from cachestore.results import now_us
from server.worker.semantic.calibration import EDGES, Calibration, learn, load, save, wilson_upper
from server.shared.match_policy import Assessment, CalibratedPolicy, Neighbor, assess, policy_from_config
from server.shared.surrogate import Surrogate
from tests.conftest import FAQ, MINILM_CONFIG, MODEL_VERSION_DIR, REPO
from tests.helpers import unique, wait_for


def test_interpolation_is_exact_for_a_linear_head_inside_the_neighbours_hull():
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((16, 4))
    vectors = rng.standard_normal((6, 16))
    scores = np.exp(vectors @ weight)
    scores /= scores.sum(axis=1, keepdims=True)
    blend = np.array([0.5, 0.3, 0.2, 0, 0, 0])
    query = blend @ vectors  # an affine combination of the neighbours
    found = assess(query, vectors, scores, ["a", "b", "c", "d"])
    logits = query @ weight
    expected = np.sort(logits)[::-1]
    assert found.answer == "abcd"[int(np.argmax(logits))]
    assert found.margin == pytest.approx(expected[0] - expected[1], abs=0.05)
    assert found.residual < 0.05
    far = assess(rng.standard_normal(16) * 3, vectors, scores, ["a", "b", "c", "d"])
    assert far.residual > 1


def learnt(max_error: float = 0.05, coverage: float = 0.5, bad_margin: float = 0.5, residual: float = 0.3) -> Calibration:
    """A calibration whose outcomes put its threshold just above `bad_margin` and its reach just beyond
    `residual`: half wrong at bad_margin, right above it, all at that residual."""
    calibration = Calibration(max_error=max_error, coverage=coverage)
    for _ in range(100):
        calibration.record(bad_margin, agreed=False, residual=residual)
        calibration.record(bad_margin, agreed=True, residual=residual)
    for _ in range(300):
        calibration.record(2.0, agreed=True, residual=residual)
    return calibration


def test_calibrated_decision_needs_margin_reach_the_fits_agreement_and_an_entry_holding_the_answer():
    policy = CalibratedPolicy(coverage=0.5)
    neighbors = [Neighbor(0.9, b"k1", "x"), Neighbor(0.85, b"k2", "y")]
    calibration = learnt()
    assert calibration.threshold_for(False) == EDGES[5] and calibration.reach_for(False) == pytest.approx(0.35)
    assert policy.decide(neighbors, Assessment("y", 2.0, 0.3, "y"), calibration).key == b"k2"  # nearest holding it
    assert policy.decide(neighbors, Assessment("y", 0.5, 0.3, "y"), calibration) is None       # margin short
    assert policy.decide(neighbors, Assessment("y", 2.0, 0.4, "y"), calibration) is None       # beyond the reach
    assert policy.decide(neighbors, Assessment("z", 9.0, 0.1, "z"), calibration) is None       # nobody holds z
    assert policy.decide(neighbors, Assessment("y", 2.0, 0.3, "y"), Calibration(0.05)) is None  # no outcomes yet
    assert policy.decide(neighbors, Assessment("y", 2.0, 0.3, "y"), calibration, min_similarity=0.95) is None
    assert policy.decide(neighbors, Assessment("y", 9.0, 0.1, "x"), calibration) is None       # the fit differs
    assert policy.decide(neighbors, Assessment("y", 2.0, 0.3), calibration).key == b"k2"       # no fit yet
    # Such a miss is still an outcome: the region bounds the interpolation's own error, which is what
    # answers in a namespace without a fit.
    assert policy.opines(neighbors, Assessment("y", 9.0, 0.1, "x"))
    assert not policy.opines(neighbors, Assessment("z", 9.0, 0.1, "z"))


def test_the_fit_learns_a_class_that_no_entry_answers():
    """Entries of classes a and b only; their scores (a linear head over all three classes) still say
    where c lies. Queries of c beside the cached a: the neighbours' interpolation answers a cached class,
    the fit answers the model's c, and the rule does not answer."""
    rng = np.random.default_rng(0)
    dim, labels = 64, ["a", "b", "c"]
    centres = rng.standard_normal((3, dim)) * 2
    weight = centres.T  # the head: a class's logit is the dot product with its centre

    def head(x):
        logits = x @ weight
        scores = np.exp(logits - logits.max(axis=1, keepdims=True))
        return scores / scores.sum(axis=1, keepdims=True)

    def unit(x):
        return x / np.linalg.norm(x, axis=-1, keepdims=True)

    cached = unit(np.vstack([centres[c] + rng.standard_normal((60, dim)) for c in (0, 1)]))
    fit = Surrogate(dim, 3)
    fit.add(cached[:dim], head(cached[:dim]))
    assert not fit.ready
    fit.add(cached[dim:], head(cached[dim:]))
    assert fit.count == 120 and fit.ready
    novel = unit(0.5 * centres[0] + centres[2] + rng.standard_normal((40, dim)))
    assert head(novel).argmax(axis=1).tolist() == [2] * 40
    assert [fit.answer(q) for q in novel] == [2] * 40
    blind, anything = 0, learnt(coverage=2.0, bad_margin=0.0, residual=1.5)
    assert anything.admits(0.5, 1.9, fitted=False)
    for query in novel:
        nearest = np.argsort(-(cached @ query))[:10]
        found = assess(query, cached[nearest], head(cached)[nearest], labels, labels[fit.answer(query)])
        assert found.fitted == "c"
        assert CalibratedPolicy(coverage=2.0).decide([Neighbor(0.9, b"k", found.answer)], found, anything) is None
        blind += found.answer != "c"
    assert blind >= 30  # the interpolation alone would have answered these from the cache


def test_threshold_is_the_lowest_margin_whose_error_bound_holds_and_the_guard_tightens():
    calibration = Calibration(max_error=0.05)
    assert calibration.threshold == math.inf
    for _ in range(100):
        calibration.record(0.1, agreed=False)  # low margins: wrong as often as right
        calibration.record(0.1, agreed=True)
    for _ in range(200):
        calibration.record(3.0, agreed=True)
    assert calibration.threshold == pytest.approx(EDGES[1]) and EDGES[1] > 0.1  # the first edge above the bad ones
    assert wilson_upper(0, 200) < 0.05 < wilson_upper(100, 400)
    for _ in range(40):
        calibration.verified_hit(3.0, agreed=True, chance=1.0)
    base = calibration.threshold
    for _ in range(5):
        calibration.verified_hit(3.0, agreed=False, chance=1.0)
    assert calibration.tightened >= 1 and calibration.threshold > base  # live fidelity fell below 95%
    assert calibration.fidelity == pytest.approx(40 / 45)
    for _ in range(400):
        calibration.verified_hit(3.0, agreed=True, chance=0.5)
    assert calibration.tightened == 0  # recovered
    assert calibration.stats()["verified"] == 445 and calibration.stats()["verified_disagreed"] == 5


def test_hits_with_a_fit_and_without_have_thresholds_of_their_own():
    """Outcomes the fit agreed with teach the threshold of hits decided with a fit; every outcome teaches
    that of hits decided without one (a namespace too small for a fit), so the errors the fit filters out
    still keep the threshold up where no fit filters them."""
    calibration = Calibration(max_error=0.05)
    for _ in range(300):
        calibration.record(0.2, agreed=True, fit_agreed=True)
    for _ in range(60):
        calibration.record(0.2, agreed=False)  # wrong, and the fit said so
    for _ in range(300):
        calibration.record(2.0, agreed=True, fit_agreed=True)
    assert calibration.threshold_for(True) == 0.0 < EDGES[1] < calibration.threshold_for(False) <= 2.0
    assert calibration.threshold == calibration.threshold_for(False)
    stats = calibration.stats()
    assert (stats["outcomes"], stats["outcomes_fit"]) == (660, 600)
    assert stats["threshold_fit_milli"] == 0 and stats["threshold_milli"] > 0
    calibration.verified_hit(0.2, agreed=False, chance=1.0, fit_agreed=True)
    assert calibration.n[1].sum() == 601 and calibration.errors[1].sum() == 1


def test_the_reach_is_learnt_and_goes_beyond_coverage_only_for_hits_a_proven_fit_vouched_for():
    """Outcomes right up to residual 0.8 and wrong beyond: the region reaches 0.8 where the outcomes allow,
    but hits decided without a fit stop at coverage 0.5, and those the fit agreed with too until the fit
    has reproduced the model on enough misses; the guard brings every reach back to coverage."""
    calibration = Calibration(max_error=0.05, coverage=0.5)
    for residual in np.arange(0.0, 0.8, 0.05) + 0.01:
        for _ in range(40):
            calibration.record(3.0, agreed=True, fit_agreed=True, residual=residual)
    for _ in range(40):
        calibration.record(3.0, agreed=False, fit_agreed=True, residual=0.9)
    assert calibration.admits(3.0, 0.45, fitted=False) and calibration.admits(3.0, 0.45, fitted=True)
    assert not calibration.admits(3.0, 0.6, fitted=False) and not calibration.admits(3.0, 0.6, fitted=True)
    assert calibration.reach_for(False) == calibration.reach_for(True) == pytest.approx(0.5)
    for _ in range(30):
        calibration.record_fit(agreed=True)
    assert not calibration.fit_proven  # 0 disagreements in 30 bound them by 8.3% only
    calibration.record_fit(agreed=False)
    for _ in range(30):
        calibration.record_fit(agreed=True)
    assert not calibration.fit_proven  # 1 in 61: 7.0%
    for _ in range(100):
        calibration.record_fit(agreed=True)
    assert calibration.fit_proven      # 1 in 161: 2.7%
    assert calibration.admits(3.0, 0.75, fitted=True) and not calibration.admits(3.0, 0.75, fitted=False)
    assert not calibration.admits(3.0, 0.9, fitted=True)  # where the outcomes went wrong
    assert calibration.reach_for(True) == pytest.approx(0.8)
    stats = calibration.stats()
    assert (stats["reach_milli"], stats["reach_fit_milli"], stats["fit_answers"], stats["fit_disagreed"]) == (500, 800, 161, 1)
    for _ in range(30):
        calibration.verified_hit(3.0, agreed=False, chance=1.0, fit_agreed=True, residual=0.7)
    assert calibration.tightened and not calibration.admits(9.0, 0.75, fitted=True)  # the guard: back within coverage
    assert calibration.fit_answers == 191  # the fit vouched for those hits: they were its answers too


def test_the_region_within_coverage_is_the_best_of_the_outcomes_within_it():
    """Far outcomes that need a higher threshold do not raise it for hits within coverage."""
    calibration = Calibration(max_error=0.05, coverage=0.5)
    for _ in range(300):
        calibration.record(0.5, agreed=True, fit_agreed=True, residual=0.3)
    for _ in range(100):
        calibration.record(0.5, agreed=False, fit_agreed=True, residual=0.7)
    for _ in range(500):
        calibration.record(3.0, agreed=True, fit_agreed=True, residual=0.7)
    for _ in range(300):
        calibration.record_fit(agreed=True)
    assert calibration.admits(0.5, 0.3, fitted=False) and (calibration.threshold, calibration.reach_for(False)) == (0.0, 0.35)
    assert calibration.threshold_for(True) == EDGES[5] and calibration.reach_for(True) == 0.75  # 800 outcomes, not 300
    assert calibration.admits(0.5, 0.3, fitted=True) and not calibration.admits(0.5, 0.7, fitted=True)


def test_decisions_work_the_region_out_again_at_most_every_rebase_s():
    """Under load an outcome comes with almost every miss: decisions read a region at most rebase_s old;
    the figures read (thresholds, reaches, GetStats) are always current."""
    calibration = learnt()
    calibration.rebase_s = 3600.0
    assert calibration.admits(2.0, 0.3, fitted=False)
    for _ in range(300):
        calibration.record(2.0, agreed=False, residual=0.3)  # the region is gone ...
    assert calibration.admits(2.0, 0.3, fitted=False)  # ... but decisions read it until rebase_s has passed
    assert calibration.threshold == math.inf and not calibration.admits(2.0, 0.3, fitted=False)
    calibration.rebase_s = 0.0
    calibration.record(2.0, agreed=False, residual=0.3)
    assert not calibration.admits(2.0, 0.3, fitted=False) and not calibration._stale


def test_a_miss_teaches_the_fits_answer_and_an_outcome_where_the_rule_had_an_opinion():
    neighbors = [Neighbor(0.9, b"k1", "x"), Neighbor(0.85, b"k2", "y")]
    calibration = Calibration(max_error=0.05)
    learn(calibration, neighbors, Assessment("y", 2.0, 0.7, "y"), "x")  # the rule and the fit both wrong
    learn(calibration, neighbors, Assessment("z", 2.0, 0.3, "x"), "x")  # no entry holds z: the fit's answer only
    learn(calibration, neighbors, Assessment("x", 2.0, 0.3), "x")       # no fit yet: the outcome only
    assert (calibration.fit_answers, calibration.fit_disagreed) == (2, 1)
    assert (calibration.n[0].sum(), calibration.errors[0].sum(), calibration.n[1].sum()) == (2, 1, 1)
    assert calibration.n[1, 14].sum() == 1  # the fit-agreed outcome, at residual 0.7 (bins of 0.05)


def test_config_chooses_the_rule():
    assert isinstance(policy_from_config({"enabled": True}), CalibratedPolicy)
    with pytest.raises(ValueError, match="consensus"):
        policy_from_config({"enabled": True, "min_similarity": 0.7, "max_error": 0.01})
    with pytest.raises(ValueError, match="max_error"):
        policy_from_config({"enabled": True, "max_error": 1.5})


def test_a_nan_margin_never_answers_and_is_not_an_outcome():
    neighbors = [Neighbor(0.9, b"k1", "x"), Neighbor(0.85, b"k2", "x")]
    assert CalibratedPolicy().decide(neighbors, Assessment("x", math.nan, 0.1, "x"), learnt()) is None
    calibration = Calibration(max_error=0.05)
    calibration.record(math.nan, agreed=False)
    calibration.record(1.0, agreed=False, residual=math.nan)
    assert calibration.n.sum() == 0


def test_saved_outcomes_count_only_under_the_same_rule(tmp_path):
    policy = CalibratedPolicy(max_error=0.05, coverage=0.5)
    calibration = Calibration.under(policy, "minilm/1 k=10 coverage=0.5")
    for _ in range(100):
        calibration.record(2.0, agreed=True, residual=0.3)
        calibration.record(2.0, agreed=True, residual=0.6)
    calibration.record_fit(agreed=False)
    calibration.verified_hit(2.0, agreed=True, chance=0.1)
    path = tmp_path / "calibration.json"
    save({("faq", "1"): calibration}, path)
    same = load(path, {("faq", "1"): (policy, "minilm/1 k=10 coverage=0.5")})[("faq", "1")]
    assert same.threshold == calibration.threshold < math.inf
    assert same.reach_for(False) == calibration.reach_for(False) == 0.35  # within coverage: the outcomes at 0.3
    assert (same.fit_answers, same.fit_disagreed, same.coverage) == (1, 1, 0.5)
    assert same.fidelity == 1.0 and same.verified_at_start == 1
    assert load(path, {("faq", "1"): (policy, "minilm/1 k=10 coverage=0.9")}) == {}  # another coverage
    saved = json.loads(path.read_text())
    del saved["reaches"]  # outcomes binned by margin alone
    path.write_text(json.dumps(saved))
    assert load(path, {("faq", "1"): (policy, "minilm/1 k=10 coverage=0.5")}) == {}
    path.write_text("{not json")
    assert load(path, {("faq", "1"): (policy, "x")}) == {}


@pytest.fixture(scope="module")
def calibrated_models(tmp_path_factory, faq_models) -> Path:
    """faq with the calibrated rule at max_error 0.2 and coverage 0.9 (what a 52-row file can support: few
    neighbours are far apart), every hit verified."""
    root = tmp_path_factory.mktemp("calibrated-models")
    link_model(root, "minilm", MINILM_CONFIG, {"1": MODEL_VERSION_DIR})
    config = (faq_models / "faq-calibrated" / "config.yaml").read_text()
    config = (config.replace("max_error: 0.01", "max_error: 0.2").replace("verify_fraction: 0.1", "verify_fraction: 1.0")
              .replace("coverage: 0.5", "coverage: 0.9"))
    link_model(root, "faq", config, {"1": faq_models / "faq" / "1"})
    return root


@pytest.fixture(scope="module")
def calibrated_server(tmp_path_factory, calibrated_models, engines_dir):
    srv = ServerProcess(tmp_path_factory.mktemp("calibrated-server"), calibrated_models, engines_dir=engines_dir)
    yield srv
    assert srv.stop() == 0, srv.log_text()


def _faq_texts() -> list[str]:
    with open(FAQ, newline="") as f:
        return [row["text"] for row in csv.DictReader(f)]


def _counters(server: ServerProcess) -> dict:
    return dict(server.stats().worker.counters)


def _infer_indexed(server: ServerProcess, client, text: str, **kwargs):
    """client.infer, and for a miss, waiting until its row is in the worker's semantic index (rows come
    from the writer's commits, up to cache.group_commit_ms later): the next text searches it."""
    indexed = _counters(server).get("semantic.indexed", 0)
    result = client.infer("faq", text, **kwargs)
    if result.source == "MISS":
        wait_for(lambda: _counters(server).get("semantic.indexed", 0) != indexed, 30, f"{text!r} indexed",
                 poll_s=0.005)
    return result


def test_no_semantic_hit_before_outcomes_bound_the_error_then_hits_are_verified(calibrated_server):
    server, tenant = calibrated_server, unique("t")
    with server.client() as client:
        assert _infer_indexed(server, client, "Where is my order?", tenant=tenant).source == "MISS"
        assert _infer_indexed(server, client, "Has my order been shipped?", tenant=tenant).source == "MISS"
        # Two near neighbours agree, but nothing has been verified: the calibrated rule does not answer.
        assert _infer_indexed(server, client, "where is my order, has it shipped", tenant=tenant).source == "MISS"
        for text in _faq_texts():  # misses whose neighbours were searched: outcomes
            _infer_indexed(server, client, text, tenant=tenant)
        counters = _counters(server)
        assert counters["semantic.faq.1.outcomes"] >= 11 and "semantic.faq.1.threshold_milli" in counters
        assert 0 < counters["semantic.faq.1.reach_milli"] <= 900  # within coverage 0.9: 52 rows make no fit
        paraphrases = ["my parcel has still not arrived", "I want to send these shoes back",
                       "how can I cancel the order I just placed", "when will my order be delivered",
                       "what payment methods can I use", "how do I reset my account password"]
        sources = [client.infer("faq", text, tenant=tenant).source for text in paraphrases]
    hits = sources.count("RESULT_SEMANTIC")
    assert hits >= 1, sources
    deadline = time.monotonic() + 20
    while _counters(server).get("semantic.faq.1.verified", 0) < hits:  # verify_fraction 1.0: every hit
        assert time.monotonic() < deadline, _counters(server)
        time.sleep(0.05)
    counters = _counters(server)
    assert counters["semantic.shadow_agreed"] + counters.get("semantic.shadow_disagreed", 0) >= hits
    assert 0 < counters["semantic.faq.1.fidelity_ppm"] <= 1_000_000


class _Echo:
    """What a check needs of a runtime (its batcher and labels): a real Batcher whose engine echoes
    each input as the model's scores. Foreground texts have 3 values and take `foreground_s`; checks have
    2 and take nothing. `batches` gets, for each batch the engine ran, its rows' kinds as it starts;
    `spans`, (kinds, started, ended) as it ends (time.monotonic)."""
    labels = ["a", "b"]

    def __init__(self, batches: list, foreground_s: float, **settings) -> None:
        from server.worker.batcher import Batcher

        self.spans: list[tuple[list[str], float, float]] = []

        def engine(batch):
            kinds, started = ["foreground" if len(x) == 3 else "check" for x in batch], time.monotonic()
            batches.append(kinds)
            time.sleep(foreground_s if len(batch[0]) == 3 else 0)
            self.spans.append((kinds, started, time.monotonic()))
            return [{"scores": np.asarray(x, dtype=np.float32)} for x in batch]

        self.batcher = Batcher(engine, buckets=(8,), max_delay_s=0.0, **{"max_batch": 8, "max_queue": 64, **settings})

    def foreground(self):
        return self.batcher.enqueue(np.array([0.1, 0.2, 0.3]), None)


def _check(model: _Echo, calibration: Calibration, entry: bytes, scores=(0.9, 0.1)):
    """A hit that answered "a", from `entry`, offered for its check."""
    from server.worker.semantic.shadow import Check

    return Check(model, calibration, None, np.array(scores), np.zeros(2), "a", 2.0, entry, 1.0, now_us())


def _with_repo_path() -> dict:
    """This process's environment with the repository first on PYTHONPATH (kept: the device's wheels)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))}


async def _until(condition, timeout_s: float = 2.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)


def test_shadow_checks_wait_for_an_idle_worker_go_together_and_report_disagreements():
    """Checks offered while a foreground batch runs on the model's batcher, and then on another batcher
    of the worker (an encoder), wait for both to be idle: a foreground text queued after them runs first.
    Then the waiting checks go in one batch. A check whose model answer differs from the hit's contests
    the entry that answered."""
    from server.worker.semantic.shadow import ShadowVerifier

    batches: list[list[str]] = []

    async def scenario():
        model, encoder = _Echo(batches, 0.2), _Echo(batches, 0.4)
        checked = []
        verifier = ShadowVerifier(lambda check, outputs, agreed: checked.append(agreed),
                                  lambda: [model.batcher, encoder.batcher])
        calibration = Calibration(max_error=0.05)
        first = model.foreground()
        await asyncio.sleep(0.05)  # the first foreground batch is running
        verifier.offer(_check(model, calibration, b"a1", (0.9, 0.1)))
        verifier.offer(_check(model, calibration, b"a2", (0.2, 0.8)))  # the model says "b"
        await asyncio.sleep(0.01)
        second = model.foreground()  # queued after the checks
        await first
        encoded = encoder.foreground()  # starts as `second` runs
        await asyncio.gather(second, encoded)
        await _until(lambda: len(checked) == 2)
        await verifier.close()
        await model.batcher.close()
        await encoder.batcher.close()
        return checked, calibration, verifier, model.spans, encoder.spans

    checked, calibration, verifier, spans, encoded = asyncio.run(scenario())
    assert batches == [["foreground"], ["foreground"], ["foreground"], ["check", "check"]]
    assert spans[-1][0] == ["check", "check"] and spans[-1][1] >= encoded[0][2]  # after the encoder's batch ended
    assert checked == [True, False]
    assert calibration.verified == 2 and calibration.disagreed == 1 and calibration.fidelity == 0.5
    assert verifier.chance(b"a1", 0.1) == 0.1 and not verifier.contested(b"a1")  # proven by the agreement
    assert verifier.contested(b"a2") and verifier.chance(b"a2", 0.1) == 1.0
    assert verifier.chance(b"never", 0.1) == 1.0
    assert verifier.counters["shadow_unidle"] == 0 and verifier.stats()["shadow_pending"] == 0


def test_shadow_checks_of_two_models_go_in_a_batch_each_oldest_model_first():
    from server.worker.semantic.shadow import ShadowVerifier

    batches: list[list[str]] = []

    async def scenario():
        one, two = _Echo(batches, 0.1), _Echo(batches, 0.1)
        settled = []
        verifier = ShadowVerifier(lambda check, outputs, agreed: settled.append(check.entry),
                                  lambda: [one.batcher, two.batcher])
        calibration = Calibration(max_error=0.05)
        running = one.foreground()
        await asyncio.sleep(0.02)
        for model, entry in ((one, b"1a"), (two, b"2a"), (one, b"1b"), (two, b"2b")):
            verifier.offer(_check(model, calibration, entry))
        assert verifier.stats()["shadow_pending"] == 4
        await running
        await _until(lambda: len(settled) == 4)
        await verifier.close()
        await one.batcher.close()
        await two.batcher.close()
        return settled

    assert asyncio.run(scenario()) == [b"1a", b"1b", b"2a", b"2b"]
    assert batches == [["foreground"], ["check", "check"], ["check", "check"]]


def test_shadow_checks_go_anyway_when_the_worker_is_never_idle(monkeypatch):
    """A batcher kept busy without a pause by two callers (one text per batch: while one runs, the other
    waits): every MAX_DEFER_S one check runs between its batches (counted), so verification goes on
    under sustained load."""
    from server.worker.semantic import shadow

    monkeypatch.setattr(shadow, "MAX_DEFER_S", 0.2)
    batches: list[list[str]] = []

    async def scenario():
        model = _Echo(batches, 0.02, max_batch=1)
        checked = []
        verifier = shadow.ShadowVerifier(lambda check, outputs, agreed: checked.append(agreed),
                                         lambda: [model.batcher])
        calibration = Calibration(max_error=0.05)
        busy = True

        async def caller():
            while busy:
                await model.foreground()

        callers = [asyncio.ensure_future(caller()) for _ in range(2)]
        await asyncio.sleep(0.05)
        for n in range(3):
            verifier.offer(_check(model, calibration, b"e%d" % n))
        await _until(lambda: len(checked) == 3, timeout_s=10)
        busy = False
        await asyncio.gather(*callers)
        await verifier.close()
        await model.batcher.close()
        return checked, verifier

    checked, verifier = asyncio.run(scenario())
    assert checked == [True, True, True] and verifier.counters["shadow_unidle"] == 3
    assert [n for batch in batches if (n := batch.count("check"))] == [1, 1, 1]  # max_batch 1


def test_shadow_checks_wait_on_rather_than_fill_a_busy_queue(monkeypatch):
    """A batch that runs past MAX_DEFER_S with half of the queue waiting behind it: the checks are not
    added to it (counted), none is refused (which would count as a user's refusal), and they run once
    the queue has drained."""
    import threading

    from server.worker.semantic import shadow

    monkeypatch.setattr(shadow, "MAX_DEFER_S", 0.1)
    release = threading.Event()
    batches: list[list[str]] = []

    async def scenario():
        model = _Echo(batches, 0.0, max_batch=1, max_queue=4)
        engine = model.batcher.run_batch
        model.batcher.run_batch = lambda batch: (release.wait(5), engine(batch))[1]
        checked = []
        verifier = shadow.ShadowVerifier(lambda check, outputs, agreed: checked.append(agreed),
                                         lambda: [model.batcher])
        calibration = Calibration(max_error=0.05)
        foreground = [model.foreground() for _ in range(3)]  # one runs, two wait: half of the queue
        await asyncio.sleep(0.05)
        verifier.offer(_check(model, calibration, b"e0"))
        await _until(lambda: verifier.counters["shadow_deferred"] >= 2)
        during = len(checked), verifier.counters["shadow_unidle"], model.batcher.depth
        release.set()
        await asyncio.gather(*foreground)
        await _until(lambda: len(checked) == 1)
        await verifier.close()
        await model.batcher.close()
        return during, checked, verifier, model.batcher.counters

    (checked_during, unidle_during, depth), checked, verifier, counters = asyncio.run(scenario())
    assert checked_during == 0 and unidle_during == 0 and depth == 2
    assert checked == [True]
    assert not counters["rejected_full"] and not counters["rejected_wait"]


def test_a_model_whose_queue_has_no_room_holds_back_only_its_own_checks(monkeypatch):
    """Model one's batch runs long with half of its queue waiting; model two is idle, the worker is not.
    A check of model two offered after one of model one goes (without an idle moment, counted) while
    model one's waits on; it goes once its queue has drained."""
    import threading

    from server.worker.semantic import shadow

    monkeypatch.setattr(shadow, "MAX_DEFER_S", 0.1)
    release = threading.Event()
    batches: list[list[str]] = []

    async def scenario():
        one, two = _Echo(batches, 0.0, max_batch=1, max_queue=4), _Echo(batches, 0.0)
        engine = one.batcher.run_batch
        one.batcher.run_batch = lambda batch: (release.wait(5), engine(batch))[1]
        settled = []
        verifier = shadow.ShadowVerifier(lambda check, outputs, agreed: settled.append(check.entry),
                                         lambda: [one.batcher, two.batcher])
        calibration = Calibration(max_error=0.05)
        foreground = [one.foreground() for _ in range(3)]  # one runs, two wait: half of its queue
        await asyncio.sleep(0.05)
        verifier.offer(_check(one, calibration, b"one"))
        verifier.offer(_check(two, calibration, b"two"))
        await _until(lambda: settled == [b"two"])
        during = verifier.counters["shadow_unidle"], verifier.stats()["shadow_pending"]
        release.set()
        await asyncio.gather(*foreground)
        await _until(lambda: len(settled) == 2)
        await verifier.close()
        await one.batcher.close()
        await two.batcher.close()
        return during, settled

    (unidle, pending), settled = asyncio.run(scenario())
    assert unidle == 1 and pending == 1
    assert settled == [b"two", b"one"]


@pytest.mark.parametrize("sealed", [False, True], ids=["clear", "encrypted"])
def test_what_the_rule_learnt_survives_a_clean_restart(tmp_path, calibrated_models, engines_dir, sealed):
    """Also with encryption at rest, whose start deletes the index snapshots in clear."""
    cache = tmp_path / "cache"
    (tmp_path / "first").mkdir()
    (tmp_path / "second").mkdir()
    settings: tuple[str, ...] = ()
    if sealed:
        (tmp_path / "key").write_text(base64.b64encode(os.urandom(32)).decode() + "\n")
        settings = (f"cache.encryption_key_file={tmp_path / 'key'}",)
    first = ServerProcess(tmp_path / "first", calibrated_models, engines_dir=engines_dir, cache_dir=cache,
                          settings=settings)
    try:
        with first.client() as client:
            for text in _faq_texts():  # each computed text indexed before the next: what the rule learns
                _infer_indexed(first, client, text)
        # Shadow checks settle outcomes after their answers: what was learnt is read once they are done.
        settled(first, "semantic.faq.1.outcomes", idle=("writer.backlog", "semantic.shadow_pending"))
        learnt = {k: v for k, v in _counters(first).items() if k.startswith("semantic.faq.1.")}
        assert learnt["semantic.faq.1.outcomes"] >= 11 and "semantic.faq.1.threshold_milli" in learnt
    finally:
        assert first.stop() == 0
    assert stat.S_IMODE((cache / "semantic" / "calibration-worker-0.json").stat().st_mode) == 0o600
    second = ServerProcess(tmp_path / "second", calibrated_models, engines_dir=engines_dir, cache_dir=cache,
                           settings=settings)
    try:
        time.sleep(1)  # (the index rebuild, which deletes the snapshots in clear, runs after start)
        again = {k: v for k, v in _counters(second).items() if k.startswith("semantic.faq.1.")}
        assert again["semantic.faq.1.outcomes"] == learnt["semantic.faq.1.outcomes"]
        assert again["semantic.faq.1.threshold_milli"] == learnt["semantic.faq.1.threshold_milli"]
    finally:
        assert second.stop() == 0


def test_eval_semantic_replays_held_out_and_novel_rows_and_writes_a_new_file(calibrated_server, tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "server", "eval-semantic", str(FAQ), "--model", "faq", "--label-column", "intent",
         "--address", calibrated_server.address, "--holdout", "3", "--leave-out-labels", "4"],
        cwd=tmp_path, env=_with_repo_path(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    written = list(tmp_path.glob("eval-semantic-faq-*.json"))  # where it runs, under a new name
    assert len(written) == 1, result.stdout
    report = json.loads(written[0].read_text())
    assert report["warm"] + report["replay"] + report["novel"] == report["rows"] == 52 and report["novel"] > 0
    for name in ("heldout", "novel_static", "novel_streaming"):
        part = report[name]
        assert part["exact_misses"] + part["exact_hits"] == part["queries"]
        assert 0 <= part["semantic_hits"] <= part["exact_misses"]
        if part["semantic_hits"]:
            assert part["disagreed"] == round(part["semantic_hits"] * (1 - part["fidelity"]))
            labels = part["labels"]  # the hits by the data set's labels, with their interval
            assert labels["fidelity"] == labels["agreed"] / part["semantic_hits"]
            assert labels["fidelity_95_low"] <= labels["fidelity"] <= labels["fidelity_95_high"]
        else:
            assert part["labels"]["fidelity"] is None
    assert "heldout" in result.stdout and "novel_streaming" in result.stdout


def test_eval_semantic_warms_with_one_file_and_replays_another(calibrated_server, tmp_path):
    with open(FAQ, newline="") as f:
        rows = list(csv.DictReader(f))
    for name, part in (("warm.csv", [r for i, r in enumerate(rows) if i % 3]), ("replay.csv", rows[::3])):
        with open(tmp_path / name, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=["text", "intent"])
            writer.writeheader()
            writer.writerows(part)
    command = [sys.executable, "-m", "server", "eval-semantic", str(tmp_path / "warm.csv"), "--model", "faq",
               "--label-column", "intent", "--address", calibrated_server.address, "--replay",
               str(tmp_path / "replay.csv"), "--out", str(tmp_path / "report.json")]
    result = subprocess.run(command, cwd=REPO, env=_with_repo_path(), capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert (report["warm"], report["replay"], report["novel"]) == (len(rows) - len(rows[::3]), len(rows[::3]), 0)
    assert report["heldout"]["queries"] == len(rows[::3]) and "replay file" in report["split"]
    both = subprocess.run(command + ["--folds", "3"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert both.returncode == 2 and "exclude each other" in both.stderr


def test_the_tier_fits_every_entrys_scores_rebuilds_the_fit_at_start_and_drops_it_when_emptied(tmp_path):
    """Real LMDB and write-behind: entries of classes a and b, whose stored scores come from a linear head
    over a, b and c (and one whose answer has no scores). The first calibrated search of the namespace
    asks for a fit and goes without it; the next gets c at a query of c (what the rule needs to refuse
    it). Again after a restart, and no more once an invalidation empties the namespace."""
    from cachestore.env import Store, StoreSettings
    from cachestore.keys import Namespace
    from cachestore import records
    from cachestore.semantic_log import SemanticEntry
    from cachestore.keys import Selector
    from cachestore.writer import WriteBehind
    from infercache.v1 import infercache_pb2 as pb
    from server.shared.answers import to_tensors
    from server.worker.semantic.semantic_index import SemanticTier

    rng = np.random.default_rng(2)
    dim, labels = 16, ["a", "b", "c"]
    centres = rng.standard_normal((3, dim)) * 2
    cached = np.vstack([centres[c] + rng.standard_normal((n, dim)) for c, n in ((0, 31), (1, 30))]).astype(np.float32)
    cached /= np.linalg.norm(cached, axis=1, keepdims=True)
    query = (0.5 * centres[0] + centres[2]).astype(np.float32)
    query /= np.linalg.norm(query)
    ns = Namespace("t", "m", "1")

    def scores(x):
        logits = x @ centres.T
        return np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()

    assert int(np.argmax(scores(query))) == 2

    async def fitted(tier) -> str | None:
        _, assessment = await tier.search(ns.ns_id, query, 10, labels)
        return assessment.fitted

    def put(writer, rows):
        for i in rows:
            stored = scores(cached[i]).astype(np.float32) if i else np.zeros(0, np.float32)  # row 0: none
            payload = pb.InferResponse(outputs=to_tensors({"scores": stored}))
            writer.put(ns.ns_id + i.to_bytes(16, "big"), ns,
                       records.Record(now_us(), now_us() + 3_600_000_000, payload.SerializeToString()),
                       semantic=SemanticEntry(ns.ns_id, labels[i // 31], cached[i]))
        writer.flush().result(10)

    async def run() -> list:
        store = Store(StoreSettings(tmp_path / "cache", 64 << 20, 48 << 20, sync=False), readonly=False)
        seen = []
        tier = SemanticTier(store, tmp_path / "snapshots", dim)
        writer = WriteBehind(store, on_semantic=tier.apply)
        await tier.start()
        put(writer, range(61))
        seen += [await fitted(tier), await fitted(tier), tier.counters["fit_rows"]]
        writer.close()
        await tier.close()
        again = SemanticTier(store, tmp_path / "snapshots", dim)
        writer = WriteBehind(store, on_semantic=again.apply)
        await again.start()
        seen += [await fitted(again), await fitted(again), again.counters["fit_rows"]]
        writer.invalidate(Selector(tenant="t")).result(10)
        put(writer, range(1, 9))  # fewer than the dimensions: a fit started over has nothing to say yet
        seen += [await fitted(again), await fitted(again), again.counters["fit_errors"]]
        writer.close()
        await again.close()
        store.close()
        return seen

    assert asyncio.run(run()) == [None, "c", 60, None, "c", 60, None, None, 0]
