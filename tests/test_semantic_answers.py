"""Semantic answers for generated text (server/shared/answer_match.py, server/worker/semantic/answer_matching.py)
through a real server: SmolLM2's real weights answer, the FAQ head trained by train-head judges, real
LMDB and hnswlib underneath. The bound is permissive here (max_error 0.2: a dozen outcomes make a
threshold) so a few dozen generations on two cores reach hits; the benchmark runs it at 0.01."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest

from server.shared import question_guards as guards
from server.shared.answer_match import answer_match_from_config, namespace_material
from server.worker.semantic.label_calibration import BINS, LABEL_CALIBRATION_FILE, LabelCalibration, read, same_label
from tests.conftest import FAQ, MINILM_CONFIG, MODEL_VERSION_DIR
from harness.servers import REPO, ServerProcess, free_port, link_model, settled, worker_counters

GEN_VERSION_DIR = REPO / "models" / "smollm2" / "1"
ANSWERS = """
task: generate
serving_version: "1"
generate: {context_length: 256, max_new_tokens: 6, max_streams: 4, normalize: text}
cache: {ttl_s: 600}
semantic: {enabled: true, judge: faq, max_error: 0.2, coverage: 1.0, verify_fraction: 1.0}
"""
TOKENS = 6

# Questions the tests cache beside the FAQ's own, and questions that must never take their answers: each
# differs from one of them by a negation, a number, a date or a named entity.
WARM = ["Can I return an item after 30 days?", "Do you ship to Canada?", "How do I cancel my order?",
        "Can I pay with Visa?", "Is the store open on Sunday?"]
GUARDED = [("Can I return an item after 30 days?", "Can I return an item after 90 days?"),
           ("Do you ship to Canada?", "Do you ship to Mexico?"),
           ("How do I cancel my order?", "Why can't I cancel my order?"),
           ("Can I pay with Visa?", "Can I pay with Mastercard?"),
           ("Is the store open on Sunday?", "Is the store open on Monday?"),
           ("How do I cancel my order?", "How do I not cancel my order?")]
PARAPHRASES = ["how can i send an item back", "what's the return policy", "I'd like to return a product",
               "where is my package", "has my order shipped yet", "i forgot my password", "reset my password please",
               "which payment methods do you take", "how much is shipping", "when do you open"]

pytestmark = pytest.mark.skipif(not (GEN_VERSION_DIR / "decoder.onnx").is_file(),
                                reason="the generative model is not prepared: run `make model` (make test does)")


def _faq() -> list[str]:
    with open(FAQ, newline="") as f:
        return [row["text"] for row in csv.DictReader(f)]


def _user(text: str, system: str | None = None) -> list[dict]:
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]


# ---- the guards and the settings, on their own ------------------------------------------------------

@pytest.mark.parametrize("cached, asked", GUARDED)
def test_guards_tell_a_changed_negation_number_date_or_entity(cached, asked):
    assert not guards.same(guards.marks(cached), guards.marks(asked))


def test_a_thousands_comma_is_one_number_and_a_decimal_comma_another():
    assert guards.same(guards.marks("Send 1,000 euros to Anna"), guards.marks("Send 1000 euros to Anna"))
    assert not guards.same(guards.marks("Send 1,5 euros to Anna"), guards.marks("Send 15 euros to Anna"))


@pytest.mark.parametrize("cached, asked", [("Can I return an item after 30 days?", "could i return it after 30 days"),
                                           ("Do you ship to Canada?", "Do you deliver to Canada"),
                                           ("How do I cancel my order?", "How can I cancel an order?")])
def test_guards_let_paraphrases_through(cached, asked):
    assert guards.same(guards.marks(cached), guards.marks(asked))


def test_config_needs_a_judge_and_knows_its_keys():
    policy = answer_match_from_config({"enabled": True, "judge": "faq", "max_error": 0.05, "context": "system"})
    assert (policy.judge, policy.context, policy.rule.max_error) == ("faq", "system", 0.05)
    assert answer_match_from_config({"enabled": False, "judge": "faq"}) is None
    for bad in ({"enabled": True}, {"enabled": True, "judge": "faq", "context": "some"},
                {"enabled": True, "judge": "faq", "min_similarity": 0.9},
                {"enabled": True, "judge": "faq", "max_error": 2}):
        with pytest.raises(ValueError):
            answer_match_from_config(bad)


def test_the_namespace_holds_the_system_prompt_and_earlier_turns_where_the_config_says():
    every = answer_match_from_config({"enabled": True, "judge": "faq"})
    system = answer_match_from_config({"enabled": True, "judge": "faq", "context": "system"})
    a = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
         {"role": "assistant", "content": "hello"}, {"role": "user", "content": "q"}]
    b = [*a[:2], {"role": "assistant", "content": "hey"}, a[3]]
    assert namespace_material(every, a, [6]) != namespace_material(every, b, [6])
    assert namespace_material(system, a, [6]) == namespace_material(system, b, [6])
    other_system = [{"role": "system", "content": "x"}, a[3]]
    assert namespace_material(system, a, [6]) != namespace_material(system, other_system, [6])
    assert namespace_material(system, a, [6]) != namespace_material(system, a, [7])


# ---- through a real server ---------------------------------------------------------------------

def _judge_copy(target: Path, head: Path, calibration: LabelCalibration | None) -> Path:
    """The head's version with another label calibration (None: without one, as train-head wrote heads before)."""
    target.mkdir()
    for path in head.iterdir():
        if path.name != LABEL_CALIBRATION_FILE:
            (target / path.name).symlink_to(path)
    if calibration is not None:
        (target / LABEL_CALIBRATION_FILE).write_text(json.dumps(calibration.to_json()))
    return target


# Labelled pairs that bound no threshold at max_error 0.2: two of five pairs apart, whatever their probability.
UNSURE = LabelCalibration(1.0, np.eye(BINS)[BINS - 1] * 5, np.eye(BINS)[BINS - 1] * 2)
JUDGED = {"answers": "faq", "answers-unsure": "faq-unsure", "answers-judge-only": "faq-judge-only"}
UPSTREAM = "answers-upstream"  # the answers model computed upstream


@pytest.fixture(scope="module")
def server(tmp_path_factory, faq_models, engines_dir):
    root = tmp_path_factory.mktemp("answer-models")
    link_model(root, "minilm", MINILM_CONFIG, {"1": MODEL_VERSION_DIR})
    judge_config = (faq_models / "faq" / "config.yaml").read_text()
    link_model(root, "faq", judge_config, {"1": faq_models / "faq" / "1"})
    copies = tmp_path_factory.mktemp("judges")
    link_model(root, "faq-unsure", judge_config, {"1": _judge_copy(copies / "unsure", faq_models / "faq" / "1", UNSURE)})
    link_model(root, "faq-judge-only", judge_config, {"1": _judge_copy(copies / "only", faq_models / "faq" / "1", None)})
    for model, judge in JUDGED.items():
        link_model(root, model, ANSWERS.replace("judge: faq", f"judge: {judge}"), {"1": GEN_VERSION_DIR})
    # The same model computed upstream (kind infercache): by this server's own plain SmolLM2, so the
    # upstream's answers are the local model's.
    port = free_port()
    link_model(root, "plain", ANSWERS.split("semantic:")[0], {"1": GEN_VERSION_DIR})
    (root / UPSTREAM).mkdir()
    (root / UPSTREAM / "config.yaml").write_text(
        ANSWERS.replace("context_length: 256, ", "").replace("max_streams: 4, ", "") +
        f"runtime: upstream\nupstream: {{kind: infercache, urls: [http://127.0.0.1:{port}], model: plain}}\n")
    workdir = tmp_path_factory.mktemp("answer-server")
    srv = ServerProcess(workdir, root, frontends=1, engines_dir=engines_dir, port=port)
    with srv.client(timeout_s=120) as client:
        for model in (*JUDGED, UPSTREAM):
            for text in _faq() + WARM:  # tenant "a"'s cache; its misses' questions are outcomes once neighbours exist
                client.generate(model, messages=_user(text), tenant="a", max_new_tokens=TOKENS)
    settled(srv, "semantic.indexed")
    yield srv
    srv.stop()


def test_the_misses_taught_a_threshold(server):
    counters = worker_counters(server)
    assert counters["semantic.answers.1.outcomes"] >= 12
    assert "semantic.answers.1.threshold_milli" in counters
    assert counters["semantic.indexed"] + counters.get("worker.answer_semantic_hits", 0) >= 40


def test_paraphrases_hit_with_the_cached_answer_similarity_age_and_verdict(server):
    with server.client(timeout_s=120) as client:
        answers = {text: client.generate("answers", messages=_user(text), tenant="a", max_new_tokens=TOKENS).text
                   for text in _faq() + WARM}
        hits = [client.generate("answers", messages=_user(text), tenant="a", max_new_tokens=TOKENS)
                for text in PARAPHRASES]
    semantic = [h for h in hits if h.source == "RESULT_SEMANTIC"]
    assert len(semantic) >= len(PARAPHRASES) // 2, [(p, h.source) for p, h in zip(PARAPHRASES, hits)]
    for hit in semantic:
        assert hit.text in answers.values() and hit.token_ids
        assert 0 < hit.similarity <= 1 and hit.age_s > 0 and hit.verdict in ("ESTIMATED", "VERIFIED")


def test_a_model_computed_upstream_gets_semantic_answers_too(server):
    """Semantic answers in front of an upstream: the same paraphrases hit with the answers the upstream
    generated, and a guarded question never takes one."""
    with server.client(timeout_s=120) as client:
        answers = {client.generate(UPSTREAM, messages=_user(text), tenant="a", max_new_tokens=TOKENS).text
                   for text in _faq() + WARM}
        hits = [client.generate(UPSTREAM, messages=_user(text), tenant="a", max_new_tokens=TOKENS)
                for text in PARAPHRASES]
        for _, asked in GUARDED:
            got = client.generate(UPSTREAM, messages=_user(asked), tenant="a", max_new_tokens=TOKENS, mode="NO_STORE")
            assert got.source == "MISS", asked
    semantic = [h for h in hits if h.source == "RESULT_SEMANTIC"]
    assert len(semantic) >= len(PARAPHRASES) // 2, [(p, h.source) for p, h in zip(PARAPHRASES, hits)]
    assert all(hit.text in answers and 0 < hit.similarity <= 1 for hit in semantic)
    counters = worker_counters(server)
    assert counters[f"semantic.{UPSTREAM}.1.outcomes"] >= 12


def test_negated_number_and_entity_changed_questions_never_take_the_answer(server):
    with server.client(timeout_s=120) as client:
        for _, asked in GUARDED:
            got = client.generate("answers", messages=_user(asked), tenant="a", max_new_tokens=TOKENS, mode="NO_STORE")
            assert got.source == "MISS", asked


def test_another_tenant_never_gets_an_answer_even_for_the_same_text(server):
    with server.client(timeout_s=120) as client:
        for text in (_faq()[:3] + PARAPHRASES[:3]):
            got = client.generate("answers", messages=_user(text), tenant="b", max_new_tokens=TOKENS, mode="NO_STORE")
            assert got.source == "MISS", text
            assert client.generate("answers", messages=_user(text), tenant="a", max_new_tokens=TOKENS).source != "MISS"


def test_a_different_system_prompt_never_shares_answers(server):
    with server.client(timeout_s=120) as client:
        for text in _faq()[:3]:
            got = client.generate("answers", messages=_user(text, "Answer in French."), tenant="a",
                                  max_new_tokens=TOKENS, mode="NO_STORE")
            assert got.source == "MISS", text


def test_a_semantic_hit_streams_as_one_last_message(server):
    with server.client(timeout_s=120) as client:
        stream = list(client.generate_stream("answers", messages=_user("how do i send an item back"), tenant="a",
                                             max_new_tokens=TOKENS))
    assert len(stream) == 1 and stream[0].HasField("end")
    end = stream[0].end
    assert end.cache.source == end.cache.RESULT_SEMANTIC and stream[0].text and end.completion_tokens > 0
    assert end.cache.verdict in (end.cache.ESTIMATED, end.cache.VERIFIED) and end.cache.similarity > 0


def test_shadow_checks_judge_hits_and_count_in_the_bound(server):
    before = worker_counters(server)
    with server.client(timeout_s=120) as client:
        for text in PARAPHRASES:
            client.generate("answers", messages=_user(text + " please"), tenant="a", max_new_tokens=TOKENS,
                            mode="NO_STORE")
    after = settled(server, "semantic.answers.1.verified") and worker_counters(server)
    verified = after["semantic.answers.1.verified"] - before.get("semantic.answers.1.verified", 0)
    assert verified >= 1 and after["worker.answer_semantic_hits"] > before.get("worker.answer_semantic_hits", 0)
    # each check is an outcome too: what moves the threshold
    assert after["semantic.answers.1.outcomes"] - before["semantic.answers.1.outcomes"] >= verified
    # a checked entry that agreed is proven: its next hit says so
    with server.client(timeout_s=120) as client:
        again = [client.generate("answers", messages=_user(text + " please"), tenant="a", max_new_tokens=TOKENS,
                                 mode="NO_STORE") for text in PARAPHRASES]
    assert any(g.source == "RESULT_SEMANTIC" and g.verdict == "VERIFIED" for g in again), \
        [(g.source, g.verdict) for g in again]


# ---- the judge's label calibration (server/worker/semantic/label_calibration.py) ---------------------------------

def test_train_head_writes_the_judge_s_label_calibration(faq_models):
    calibration = read(faq_models / "faq" / "1")
    rows = len(_faq())
    assert calibration is not None and 0 < calibration.temperature < 10
    assert 0.8 * rows <= calibration.n.sum() <= rows and calibration.errors.sum() < 0.2 * calibration.n.sum()
    assert calibration.threshold(0.2) <= 1 and calibration.threshold(0.01) == float("inf")  # (52 pairs bound 0.2, not 0.01)


def test_the_threshold_is_the_lowest_probability_whose_pairs_bound_the_error():
    n, errors = np.zeros(BINS), np.zeros(BINS)
    n[990], n[500], errors[500] = 400, 100, 50  # 400 pairs at 0.99 all alike, 100 at 0.5 half apart
    calibration = LabelCalibration(1.0, n, errors)
    assert calibration.threshold(0.01) == 0.99
    assert calibration.threshold(0.2) == 0.5      # 50 apart in 500: under 0.2 by the bound (none lie below)
    assert calibration.threshold(0.05) == 0.99    # ... not under 0.05
    assert LabelCalibration(1.0, np.eye(BINS)[999] * 100, np.zeros(BINS)).threshold(0.01) == float("inf")  # 0 in 100
    one_hot = np.eye(4)
    assert same_label(one_hot[0], one_hot[0], 1.0) == 1.0 and same_label(one_hot[0], one_hot[1], 1.0) == 0.0
    soft = np.array([0.6, 0.4, 0.0, 0.0])
    assert same_label(soft, soft, 1.0) == pytest.approx(0.52) and same_label(soft, soft, 0.5) > 0.52  # colder: surer


def test_a_label_calibration_that_does_not_read_is_refused(tmp_path):
    (tmp_path / LABEL_CALIBRATION_FILE).write_text(json.dumps({"temperature": 1.0, "bins": BINS, "pairs": [1] * BINS,
                                                               "disagreed": [2] * BINS}))
    with pytest.raises(ValueError):
        read(tmp_path)
    assert read(tmp_path / "absent") is None


def test_the_calibrated_judge_tells_a_paraphrase_from_another_intent(server, faq_models):
    """The real head's scores, through the server: a paraphrase of a cached question shares its label with
    a probability over the FAQ's threshold; a question of another intent does not."""
    calibration = read(faq_models / "faq" / "1")
    with server.client(timeout_s=120) as client:
        texts = ["How do I return an item?", "how can i send an item back", "where is my package"]
        scores = [np.asarray(r.outputs["scores"]) for r in client.infer_batch("faq", texts, mode="BYPASS")]
    threshold = calibration.threshold(0.2)
    assert same_label(scores[0], scores[1], calibration.temperature) >= max(threshold, 0.9)
    assert same_label(scores[0], scores[2], calibration.temperature) < 0.1


def test_a_judge_whose_labelled_pairs_bound_nothing_answers_no_question_semantically(server):
    before = worker_counters(server)
    with server.client(timeout_s=120) as client:
        unsure = [client.generate("answers-unsure", messages=_user(text), tenant="a", max_new_tokens=TOKENS,
                                  mode="NO_STORE") for text in PARAPHRASES]
        judge_only = [client.generate("answers-judge-only", messages=_user(text), tenant="a", max_new_tokens=TOKENS,
                                      mode="NO_STORE") for text in PARAPHRASES]
    after = worker_counters(server)
    assert not any(g.source == "RESULT_SEMANTIC" for g in unsure), [(p, g.source) for p, g in zip(PARAPHRASES, unsure)]
    assert sum(g.source == "MISS" for g in unsure) >= len(PARAPHRASES) - 1  # (one of them is a cached text)
    # the rule admitted them, the label calibration refused them
    assert after.get("worker.answer_label_refused", 0) - before.get("worker.answer_label_refused", 0) >= 1
    # the same head without a label calibration: the judge's word alone, as before train-head wrote one
    assert sum(g.source == "RESULT_SEMANTIC" for g in judge_only) >= len(PARAPHRASES) // 2
