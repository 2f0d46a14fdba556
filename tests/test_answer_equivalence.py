"""Semantic answers judged by answer equivalence (`semantic.answer_cosine`: server/worker/semantic/answer_equivalence.py,
shadow regeneration in server/worker/semantic/regeneration.py) through a real server: SmolLM2's real weights
answer and are regenerated, MiniLM embeds questions and answers, real LMDB and hnswlib underneath.

The questions are how-to questions, which SmolLM2 answers by restating them ("To reset your password,
you"): paraphrases get alike answers, other tasks other ones, so the misses teach a similarity threshold.
The bound is permissive (max_error 0.2: a dozen agreeing outcomes make a threshold) so a few dozen
generations on two cores reach hits."""

from __future__ import annotations

import pytest

from server.shared.answer_match import answer_match_from_config, namespace_material
from tests.conftest import MINILM_CONFIG, MODEL_VERSION_DIR
from harness.servers import REPO, ServerProcess, link_model, settled, worker_counters

GEN_VERSION_DIR = REPO / "models" / "smollm2" / "1"
EQUIVALENCE = """
task: generate
serving_version: "1"
generate: {context_length: 256, max_new_tokens: 6, max_streams: 4, normalize: text}
cache: {ttl_s: 600}
semantic: {enabled: true, answer_cosine: 0.9, max_error: 0.2, verify_fraction: 1.0}
"""
TOKENS = 6
MODEL = "equivalent"
TASKS = ["reset my password", "change my password", "cancel my order", "return an item", "track my parcel",
         "update my shipping address", "delete my account", "change my email address", "apply a discount code",
         "contact customer support", "download my invoice", "unsubscribe from the newsletter", "redeem a gift card",
         "change my payment method", "report a damaged item", "close my account"]
GUARDED_WARM = "How do I return an item after 30 days?"
# Near but other tasks: the nearest cached question's answer may be served, and its regeneration says
# whether the model answers alike.
NEAR = ["How do I unsubscribe from emails?", "How do I reset my passcode?", "How do I update my billing address?",
        "How do I apply a coupon?", "How do I download my receipt?", "How do I report a missing item?",
        "How do I freeze my account?", "How do I change my delivery date?"]

pytestmark = pytest.mark.skipif(not (GEN_VERSION_DIR / "decoder.onnx").is_file(),
                                reason="the generative model is not prepared: run `make model` (make test does)")


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def _ask(client, text: str, **options):
    return client.generate(MODEL, messages=_user(text), tenant="a", max_new_tokens=TOKENS, **options)


# ---- the settings, on their own ------------------------------------------------------------------

def test_answer_cosine_chooses_answer_equivalence_and_is_checked():
    policy = answer_match_from_config({"enabled": True, "answer_cosine": 0.9, "max_error": 0.05, "k": 4})
    assert policy.by_answers and (policy.judge, policy.answer_cosine, policy.rule.k) == (None, 0.9, 4)
    assert not answer_match_from_config({"enabled": True, "judge": "faq"}).by_answers
    for bad, says in (({"judge": "faq", "answer_cosine": 0.9}, "set one"),
                      ({"answer_cosine": 0}, "answer_cosine"), ({"answer_cosine": 1.5}, "answer_cosine"),
                      ({"answer_cosine": "high"}, "answer_cosine"), ({"answer_cosine": True}, "answer_cosine"),
                      ({"answer_cosine": 0.9, "coverage": 0.5}, "coverage"), ({}, "answer_cosine")):
        with pytest.raises(ValueError, match=says):
            answer_match_from_config({"enabled": True, **bad})


def test_the_two_judges_never_share_an_index():
    turns = [{"role": "user", "content": "q"}]
    by_label = answer_match_from_config({"enabled": True, "judge": "faq"})
    by_answers = answer_match_from_config({"enabled": True, "answer_cosine": 0.9})
    assert namespace_material(by_label, turns, [6]) != namespace_material(by_answers, turns, [6])


# ---- through a real server -----------------------------------------------------------------------


def _quiet(server: ServerProcess) -> dict:
    """The counters once every write, every miss's answer (its embedding, outcome and entry) and every
    shadow regeneration has settled."""
    settled(server, f"semantic.{MODEL}.1.verified", idle=("writer.backlog", "generate.background_tasks",
                                                          "semantic.shadow_pending"), timeout=120)
    return worker_counters(server)


def _moved(before: dict, after: dict, name: str) -> int:
    return after.get(name, 0) - before.get(name, 0)


@pytest.fixture(scope="module")
def server(tmp_path_factory, engines_dir):
    root = tmp_path_factory.mktemp("equivalence-models")
    link_model(root, "minilm", MINILM_CONFIG, {"1": MODEL_VERSION_DIR})
    link_model(root, MODEL, EQUIVALENCE, {"1": GEN_VERSION_DIR})
    srv = ServerProcess(tmp_path_factory.mktemp("equivalence-server"), root, frontends=1, engines_dir=engines_dir)
    answers = {}
    try:
        with srv.client(timeout_s=120) as client:
            for task in TASKS:  # one entry per task, so an answer's text names its entry
                answers[task] = _ask(client, f"How do I {task}?").text
            answers[GUARDED_WARM] = _ask(client, GUARDED_WARM).text
            for task in TASKS:  # misses beside an entry: outcomes (NO_STORE: no entry of their own)
                _ask(client, f"How can I {task}?", mode="NO_STORE")
        _quiet(srv)
    except BaseException:
        srv.stop()
        raise
    srv.answers = answers  # the cached answer of each task
    yield srv
    srv.stop()


def test_the_misses_taught_a_similarity_threshold(server):
    counters = worker_counters(server)
    assert counters[f"semantic.{MODEL}.1.outcomes"] >= 12
    threshold = counters[f"semantic.{MODEL}.1.threshold_milli"] / 8000  # a margin is similarity x 8
    assert 0.5 < threshold < 0.95, threshold
    assert counters["semantic.indexed"] >= len(TASKS) + 1


def test_paraphrases_hit_with_the_cached_answer_similarity_age_and_verdict(server):
    with server.client(timeout_s=120) as client:
        asked = {task: _ask(client, form.format(task), mode="NO_STORE")
                 for form in ("How should I {}?", "How would I {}?") for task in TASKS}
    hits = {task: got for task, got in asked.items() if got.source == "RESULT_SEMANTIC"}
    assert len(hits) >= len(TASKS) * 3 // 4, {task: got.source for task, got in asked.items()}
    for task, hit in hits.items():
        assert hit.text == server.answers[task], task  # the answer cached for that task, not another's
        assert hit.token_ids and 0.8 < hit.similarity <= 1 and hit.age_s > 0
        assert hit.verdict in ("ESTIMATED", "VERIFIED")
    # an unrelated question is generated: nothing near it was verified
    with server.client(timeout_s=120) as client:
        assert _ask(client, "What is the capital of France?", mode="NO_STORE").source == "MISS"


def test_shadow_regenerations_check_hits_and_count_in_the_bound(server):
    before = _quiet(server)
    with server.client(timeout_s=120) as client:
        first = [_ask(client, f"How do I {task} please?", mode="NO_STORE") for task in TASKS]
    after = _quiet(server)
    hits = sum(g.source == "RESULT_SEMANTIC" for g in first)
    verified = _moved(before, after, f"semantic.{MODEL}.1.verified")
    assert hits >= 1 and verified >= 1, [(g.source, g.text) for g in first]
    # each verified hit was generated again (the regeneration itself, not the judge of a classifier)
    assert _moved(before, after, "worker.regenerated") >= verified
    assert _moved(before, after, "semantic.shadow_agreed") + _moved(before, after, "semantic.shadow_disagreed") == verified
    # ... and is an outcome of the calibration (what moves the threshold) and of its live fidelity
    assert _moved(before, after, f"semantic.{MODEL}.1.outcomes") >= verified
    assert _moved(before, after, f"semantic.{MODEL}.1.verified_weight_milli") >= verified * 1000
    assert after[f"semantic.{MODEL}.1.fidelity_ppm"] > 0
    # an entry a regeneration proved answers its next hit as VERIFIED
    with server.client(timeout_s=120) as client:
        again = [_ask(client, f"How do I {task} please?", mode="NO_STORE") for task in TASKS]
    assert any(g.source == "RESULT_SEMANTIC" and g.verdict == "VERIFIED" for g in again), \
        [(g.source, g.verdict) for g in again]


def test_a_guarded_pair_answers_only_after_the_model_showed_its_marks_irrelevant(server):
    asked = "How do I return an item after 90 days?"  # a number apart from the cached 30 days
    before = _quiet(server)
    with server.client(timeout_s=120) as client:
        first = _ask(client, asked, mode="NO_STORE")
    assert first.source == "MISS"  # the guard: never before a verification
    after = _quiet(server)
    assert _moved(before, after, "worker.answer_guarded") == 1
    assert _moved(before, after, "worker.answer_guard_agreed") == 1, "the model answered the two differently"
    with server.client(timeout_s=120) as client:
        second = _ask(client, asked, mode="NO_STORE")
        other_number = _ask(client, "How do I return an item after 60 days?", mode="NO_STORE")
    assert second.source == "RESULT_SEMANTIC" and second.text == server.answers[GUARDED_WARM]
    assert _moved(after, worker_counters(server), "worker.answer_guard_waived") >= 1
    assert other_number.source == "MISS"  # only those marks were shown irrelevant, not any number


def test_a_guarded_pair_whose_answers_differ_stays_refused(server):
    asked = "How do I not cancel my order?"  # a negation apart from the cached question
    before = _quiet(server)
    with server.client(timeout_s=120) as client:
        first = _ask(client, asked, mode="NO_STORE")
    after = _quiet(server)
    assert first.source == "MISS"
    assert _moved(before, after, "worker.answer_guarded") == 1  # the rule would have taken the cached one
    assert _moved(before, after, "worker.answer_guard_disagreed") == 1
    with server.client(timeout_s=120) as client:
        assert _ask(client, asked, mode="NO_STORE").source == "MISS"


def test_a_regeneration_that_disagrees_contests_the_entry_and_counts_in_the_bound(server):
    found = None
    for question in NEAR:
        before = _quiet(server)
        with server.client(timeout_s=120) as client:
            hit = _ask(client, question, mode="NO_STORE")
        after = _quiet(server)
        if hit.source == "RESULT_SEMANTIC" and _moved(before, after, f"semantic.{MODEL}.1.verified_disagreed"):
            found = question, hit, before, after
            break
    assert found is not None, "no hit of a near question was found wrong by its regeneration"
    question, hit, before, after = found
    assert _moved(before, after, "semantic.shadow_disagreed") == 1
    # the disagreement is an outcome of the bound and of its live fidelity (the threshold never falls for
    # it; it may vanish: no similarity answers any more)
    threshold = f"semantic.{MODEL}.1.threshold_milli"
    assert after.get(threshold, float("inf")) >= before[threshold]
    assert _moved(before, after, f"semantic.{MODEL}.1.outcomes") >= 1
    assert after[f"semantic.{MODEL}.1.fidelity_ppm"] < 1_000_000
    # the entry answers no more: neither this question nor a paraphrase of its own, far above the threshold
    task = next(t for t, answer in server.answers.items() if answer == hit.text)
    with server.client(timeout_s=120) as client:
        again = _ask(client, question, mode="NO_STORE")
        paraphrase = _ask(client, f"How should I {task}?", mode="NO_STORE")
    assert not (again.source == "RESULT_SEMANTIC" and again.text == hit.text), (question, again.source, again.text)
    assert paraphrase.source == "MISS", (task, paraphrase.source, paraphrase.text)
