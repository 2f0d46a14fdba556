"""A pure-Python fast path for BERT WordPiece tokenizers on printable-ASCII text, with a word cache.

Why: a frontend tokenizes every miss, and the `tokenizers` call costs about 24 us for a Banking77 text on
a 2-core host (most of it building the Encoding object: offsets, masks, type ids), the largest
single piece of a frontend's Python on the miss path (py-spy, null engine). Queries repeat their words
far more than their texts, so a text here is a lower(), one regex split and a dict lookup per word.

It answers only where it is exactly the tokenizer's answer: the tokenizer must be the BERT recipe
(BertNormalizer, BertPreTokenizer, WordPiece, [CLS] $A [SEP], right truncation, no padding, added
tokens matched on the raw text only), read from its own JSON, and the text printable ASCII without any
added token in it. There, the normalizer only lowercases (clean-up, accents and CJK spacing change
nothing), the pre-tokenizer splits on spaces and isolates each ASCII punctuation character, and
WordPiece is greedy longest-match-first. `FastWordPiece.of` also checks itself against the tokenizer on
sample texts and is None on any difference; everything else (None from `encode`) goes to the tokenizer.
"""

from __future__ import annotations

import json
import logging
import re

log = logging.getLogger("infercache.wordpiece")

WORD_CACHE = 65_536  # words kept with their ids (cleared when full)
# ASCII letters and digits run together; every other printable character but the space is a word of
# its own: the ASCII punctuation is exactly what BertPreTokenizer isolates.
_WORDS = re.compile(r"[a-z0-9]+|[^a-z0-9 ]")
SAMPLES = (
    "How do I top up my card?", "I can't find my PIN!!", "  spaces   and\tnothing else ", "", "e-mail: a_b@c.de",
    "what's the exchange rate (GBP->EUR) for 1,000.50?", "supercalifragilisticexpialidocious" * 4,
    "[CLS] a [MASK] b", "café déjà vu", "#hashtag ##subword `code` {x} ~tilde^ |pipe|", "UPPER lower MiXeD 123abc",
)


class FastWordPiece:
    def __init__(self, vocab: dict[str, int], unk: int, cls: int, sep: int, max_tokens: int, prefix: str,
                 max_word_chars: int, lowercase: bool, added: tuple[str, ...]) -> None:
        self.vocab = vocab
        self.unk, self.cls, self.sep = unk, cls, sep
        self.max_tokens = max_tokens
        self.prefix = prefix
        self.max_word_chars = max_word_chars
        self.lowercase = lowercase
        self.added = added
        self.words = _WORDS if lowercase else re.compile(r"[A-Za-z0-9]+|[^A-Za-z0-9 ]")
        self._cache: dict[str, tuple[int, ...]] = {}

    @classmethod
    def of(cls, tokenizer) -> FastWordPiece | None:
        """The fast path for a configured `tokenizers.Tokenizer`, or None where its recipe is not the one
        this reproduces, or where it differs from the tokenizer on any sample."""
        try:
            fast = cls._from_json(json.loads(tokenizer.to_str()))
        except Exception:  # a JSON of another shape: no fast path (it is only a shortcut)
            return None
        if fast is None:
            return None
        for text in SAMPLES:
            ids = fast.encode(text)
            if ids is not None and ids != tokenizer.encode(text).ids:
                log.warning("the WordPiece fast path differs from the tokenizer on %r; not used", text)
                return None
        return fast

    @classmethod
    def _from_json(cls, spec: dict) -> FastWordPiece | None:
        normalizer, pre, model = spec.get("normalizer") or {}, spec.get("pre_tokenizer") or {}, spec["model"]
        post, truncation = spec.get("post_processor") or {}, spec.get("truncation")
        if (normalizer.get("type") != "BertNormalizer" or not normalizer.get("clean_text")
                or pre.get("type") != "BertPreTokenizer" or model.get("type") != "WordPiece"
                or spec.get("padding") is not None or truncation is None
                or truncation.get("direction") != "Right" or truncation.get("stride")):
            return None
        vocab = model["vocab"]
        if post.get("type") == "TemplateProcessing":
            single = post["single"]
            if [next(iter(p)) for p in single] != ["SpecialToken", "Sequence", "SpecialToken"]:
                return None
            first, last = (post["special_tokens"][p["SpecialToken"]["id"]]["ids"] for p in (single[0], single[2]))
            if len(first) != 1 or len(last) != 1:
                return None
            cls_id, sep_id = first[0], last[0]
        elif post.get("type") == "BertProcessing":
            cls_id, sep_id = post["cls"][1], post["sep"][1]
        else:
            return None
        added_tokens = spec.get("added_tokens", [])
        if any(t.get("normalized") for t in added_tokens):
            return None  # matched on the normalized text in a normalized form: not reproduced here
        added = tuple(t["content"] for t in added_tokens)
        return cls(vocab, vocab[model["unk_token"]], cls_id, sep_id, int(truncation["max_length"]),
                   model["continuing_subword_prefix"], int(model["max_input_chars_per_word"]),
                   bool(normalizer.get("lowercase")), added)

    def encode(self, text: str) -> list[int] | None:
        """The ids the tokenizer gives `text`, or None where this path does not answer."""
        if not (text.isascii() and text.isprintable()):
            return None
        lowered = text.lower() if self.lowercase else text
        for token in self.added:
            if token in text or token in lowered:
                return None
        ids = [self.cls]
        cache = self._cache
        for word in self.words.findall(lowered):
            pieces = cache.get(word)
            if pieces is None:
                if len(cache) >= WORD_CACHE:
                    cache.clear()
                pieces = cache[word] = self._pieces(word)
            ids.extend(pieces)
        if len(ids) > self.max_tokens - 1:
            del ids[max(1, self.max_tokens - 1):]
        ids.append(self.sep)
        return ids

    def _pieces(self, word: str) -> tuple[int, ...]:
        """WordPiece: the longest vocabulary entry from the start, then from where it ended (with the
        continuation prefix); a word with a part no entry covers, or too long, is one unknown token."""
        if len(word) > self.max_word_chars:
            return (self.unk,)
        pieces, start = [], 0
        while start < len(word):
            end = len(word)
            while end > start:
                piece = word[start:end] if start == 0 else self.prefix + word[start:end]
                found = self.vocab.get(piece)
                if found is not None:
                    pieces.append(found)
                    break
                end -= 1
            else:
                return (self.unk,)
            start = end
        return tuple(pieces)
