"""The WordPiece fast path (server/shared/wordpiece.py) gives exactly the tokenizer's ids, or does not answer."""

from __future__ import annotations

import csv
import random
import string
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

from harness.servers import REPO
from server.shared.tokenization import TextEncoder
from server.shared.wordpiece import FastWordPiece

MINILM_TOKENIZER = REPO / "models" / "minilm" / "1" / "tokenizer.json"
BANKING77 = REPO / "bench" / "data" / "banking77" / "train.csv"
PRINTABLE = "".join(c for c in string.printable if c.isprintable())


def _fuzz(vocab: list[str], seed: int = 0) -> list[str]:
    """Printable ASCII at random, sentences of vocabulary words with suffixes and punctuation, words past
    the 100-character limit, special tokens written out, and texts that are not printable ASCII."""
    rng = random.Random(seed)
    texts = ["".join(rng.choice(PRINTABLE) for _ in range(rng.randint(0, 300))) for _ in range(3000)]
    texts += [" ".join(rng.choice(vocab) + rng.choice(["", "s", "ing", "!", "'", "-x", "##"]) for _ in range(rng.randint(0, 120)))
              for _ in range(1500)]
    texts += ["a" * n for n in (99, 100, 101, 250)] + ["[CLS] a", "x [mask] y", "[SEP]", "[PAD][UNK]"]
    texts += ["café au lait", "tab\tand\nnewline", "nbsp\u00a0here", "中文 text", "zero\u200bwidth", "\x7f", "\x00"]
    return texts


@pytest.fixture(scope="module")
def minilm() -> TextEncoder:
    return TextEncoder(MINILM_TOKENIZER, 256)


def test_the_fast_path_is_the_tokenizer_on_random_and_hostile_texts(minilm):
    assert minilm.fast is not None  # minilm's tokenizer is the BERT recipe
    texts = _fuzz([w for w in minilm.fast.vocab if w.isascii()])
    answered = [t for t in texts if minilm.fast.encode(t) is not None]
    assert len(answered) > 0.8 * len(texts)  # it answers most of them: the comparison below tests it
    assert all(minilm.fast.encode(t) is None for t in ("café", "a\tb", "中", "[CLS]", "x[MASK]"))
    for text in texts:
        assert minilm.encode(text) == minilm.tokenizer.encode(text).ids, text
    assert minilm.encode_batch(texts) == [e.ids for e in minilm.tokenizer.encode_batch(texts)]


@pytest.mark.parametrize("max_tokens", [2, 3, 16])
def test_truncation_matches_at_any_length(max_tokens):
    encoder = TextEncoder(MINILM_TOKENIZER, max_tokens)
    assert encoder.fast is not None
    for text in ["", "one", "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen",
                 "unaffable " * 10, "!" * 40]:
        assert encoder.encode(text) == encoder.tokenizer.encode(text).ids
        assert len(encoder.encode(text)) <= max_tokens


def test_banking77_texts_take_the_fast_path_to_the_same_ids(minilm):
    if not BANKING77.is_file():
        pytest.skip(f"{BANKING77} is absent")
    with BANKING77.open(newline="", encoding="utf-8") as f:
        texts = [row["text"] for row in csv.DictReader(f)]
    assert sum(minilm.fast.encode(t) is not None for t in texts) > 0.99 * len(texts)
    assert [minilm.encode(t) for t in texts] == [e.ids for e in minilm.tokenizer.encode_batch(texts)]


def test_a_tokenizer_of_another_recipe_gets_no_fast_path(tmp_path):
    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    other = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    other.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    other.save(str(path))
    encoder = TextEncoder(Path(path), 8)
    assert encoder.fast is None and FastWordPiece.of(encoder.tokenizer) is None
    assert encoder.encode("hello world again") == [1, 2, 0]


def test_added_tokens_matched_on_the_normalized_text_turn_the_fast_path_off(tmp_path):
    """Such a token matches the lowercased text in a normalized form ("x [foo] y" is one token for
    "[FOO]"), which the fast path does not reproduce: it stays off, and the tokenizer answers."""
    tokenizer = Tokenizer.from_file(str(MINILM_TOKENIZER))
    tokenizer.add_tokens([AddedToken("[FOO]", normalized=True)])
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    encoder = TextEncoder(path, 256)
    assert encoder.fast is None
    assert encoder.encode("x [foo] y") == encoder.tokenizer.encode("x [foo] y").ids
    assert len(encoder.encode("x [foo] y")) == 5  # [CLS] x [FOO] y [SEP]
