"""Synonym dictionaries (server/shared/synonyms.py): the matcher, the checks, the CLI, and keys through a
real server."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from server.shared.models import ModelConfigError, load_model
from server.shared.normalize import Normalizer
from server.shared.synonyms import Synonyms, parse, problems
from tests.conftest import MINILM_CONFIG, MODEL_VERSION_DIR
from harness.servers import REPO, link_model
from tests.helpers import unique, wait_cached

DICTIONARY = """# phrases => canonical form
get my money back | money back | reimburse me => get a refund
cash machine | cashpoint | ＣＡＳＨ ＰＯＩＮＴ => atm
"""


def test_longest_phrase_first_on_word_boundaries_in_one_pass():
    table = Synonyms({e.phrase: e.canonical for e in parse(DICTIONARY)})
    assert table("how do i get my money back") == "how do i get a refund"  # the longest phrase, not "money back"
    assert table("my money back please") == "my get a refund please"
    assert table("money backs") == "money backs"  # whole words only
    assert table("cashpoint or cash machine") == "atm or atm"
    assert table("cash point") == "atm"  # the dictionary's phrases are normalized as texts are (NFKC, case)
    normalize = Normalizer(synonyms=table)
    assert normalize("Where is the nearest Cash-Machine?") == "where is the nearest atm"
    assert normalize(normalize("I want my money back!")) == normalize("I want my money back!")  # a fixed point


@pytest.mark.parametrize("text, expected", [
    ("refund => refund", "'refund' maps to itself"),
    ("a => b\na => c", "'a' maps to 'c' here and to 'b' on line 1"),
    ("a => b\nb => a", "a cycle a => b => a"),
    ("a => b\nb => c", "a chain a => b => c"),
    ("get a refund => refund\nrefund => money", "a chain"),
    ("money => cash\nx => more money", "the canonical form 'more money' holds the phrase 'money' (line 1)"),
    ("my money => funds\nmoney back => refund", "'my money' overlaps 'money back' (line 2) in 'my money back'"),
])
def test_problems_are_named_with_their_lines(text, expected):
    assert any(expected in problem for problem in problems(parse(text))), problems(parse(text))


def test_an_overlap_that_a_longer_phrase_decides_is_no_problem():
    text = "my money => funds\nmoney back => refund\nmy money back => refund"
    assert problems(parse(text)) == []


def test_synonyms_check_cli(tmp_path):
    good, bad = tmp_path / "good.txt", tmp_path / "bad.txt"
    good.write_text(DICTIONARY)
    bad.write_text("a => b\nb => a\nx => x\n")

    def check(path):
        return subprocess.run([sys.executable, "-m", "server", "synonyms", "check", str(path)], cwd=REPO,
                              capture_output=True, text=True, timeout=60)

    ok = check(good)
    assert ok.returncode == 0 and "6 phrases to 2 canonical forms, no problems" in ok.stdout, ok.stdout + ok.stderr
    failed = check(bad)
    assert failed.returncode == 1, failed.stdout
    assert f"{bad}:3: 'x' maps to itself" in failed.stdout and "a cycle" in failed.stdout
    assert "3 problem(s)" in failed.stdout
    malformed = tmp_path / "malformed.txt"
    malformed.write_text("no arrow here\n")
    assert check(malformed).returncode == 2 and "malformed.txt:1: expected" in check(malformed).stdout
    assert check(tmp_path / "absent.txt").returncode == 2


def _synonym_model(root, dictionary: str, name: str = "faqsyn"):
    link_model(root, name, MINILM_CONFIG + "normalize: {synonyms: synonyms.txt}\n", {"1": MODEL_VERSION_DIR})
    (root / name / "synonyms.txt").write_text(dictionary)
    return root / name


def test_a_model_with_a_broken_dictionary_is_refused(tmp_path):
    _synonym_model(tmp_path, "a => b\nb => a\n")
    with pytest.raises(ModelConfigError, match="normalize.synonyms: .*a cycle"):
        load_model(tmp_path / "faqsyn")


def test_phrases_share_their_canonical_forms_key_and_a_new_dictionary_new_keys(start_server, tmp_path):
    models = tmp_path / "models"
    link_model(models, "minilm", MINILM_CONFIG, {"1": MODEL_VERSION_DIR})
    model = _synonym_model(models, DICTIONARY)
    server = start_server(models, frontends=1)
    tag = unique("")
    with server.client() as client:
        first = client.infer("faqsyn", f"How do I get my money back?{tag}")
        assert first.source == "MISS"
        hit = wait_cached(client, "faqsyn", f"how do i get a refund{tag}")
        assert hit.key == first.key  # one key for the phrase and its canonical form
        assert client.infer("faqsyn", f"how do I reimburse me{tag}").source == "RESULT_EXACT"
        # The model ran on the canonical text: the answer is minilm's for it
        plain = client.infer("minilm", f"how do i get a refund{tag}")
        assert plain.key != first.key  # another model (no dictionary): another namespace
        assert np.allclose(plain.outputs["embedding"], first.outputs["embedding"], atol=1e-5)
        # Invalidate by text normalizes with the dictionary too
        assert client.invalidate(model="faqsyn", text=f"get my money back: how do i{tag}") == 0
        assert client.invalidate(model="faqsyn", text=f"How do I get my money back{tag}") == 1
        client.infer("faqsyn", f"where is the cashpoint{tag}")
        kept = wait_cached(client, "faqsyn", f"where is the cash machine{tag}")
    assert server.stop() == 0
    # The same store, the dictionary changed: nothing made under the old one answers
    (model / "synonyms.txt").write_text(DICTIONARY + "nearest => closest\n")
    again = start_server(models, frontends=1, cache_dir=server.cache_dir)
    with again.client() as client:
        assert client.infer("faqsyn", f"where is the cashpoint{tag}", mode="NO_STORE").source == "MISS"
        assert client.infer("faqsyn", f"where is the cash machine{tag}").key != kept.key
        # the old entries are still the model's: Invalidate by model removes them with the new ones
        wait_cached(client, "faqsyn", f"where is the atm{tag}")
        assert client.invalidate(model="faqsyn") == 2
