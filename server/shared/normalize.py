"""Text normalization: the pipeline that decides which requests share a cache key.

Each step is a plain function str -> str; `Normalizer` runs them in order. PII redaction (a model's
`privacy.pii: redact`) is a step of its own, after NFKC (so full-width digits are digits) and before
case and punctuation folding (which would break e-mail addresses and phone numbers apart): the key, the
model's input and whatever is stored all come from the redacted text. A model's synonym dictionary
(server/shared/synonyms.py) runs last, on the folded text.
"""

from __future__ import annotations

import re
import unicodedata
from typing import Callable

from server.shared import pii

Step = Callable[[str], str]

_PUNCT = re.compile(r"[^\w\s]+")
_SPACE = re.compile(r"\s+")


def nfkc(text: str) -> str:
    """Compatibility forms fold together: full-width letters, ligatures, non-breaking spaces."""
    return unicodedata.normalize("NFKC", text)


def casefold(text: str) -> str:
    return text.casefold()


def fold_punctuation(text: str) -> str:
    """Punctuation becomes a space: "item?" == "item", "e-mail" == "e mail"."""
    return _PUNCT.sub(" ", text)


def fold_whitespace(text: str) -> str:
    return _SPACE.sub(" ", text).strip()


DEFAULT_STEPS: tuple[Step, ...] = (nfkc, casefold, fold_punctuation, fold_whitespace)
REDACTING_STEPS: tuple[Step, ...] = (nfkc, pii.redact, casefold, fold_punctuation, fold_whitespace)
REDACTING_ONLY: tuple[Step, ...] = (nfkc, pii.redact)  # texts kept as sent but for their PII (Generate)

# DEFAULT_STEPS on an ASCII text in one pass (tests/test_units.py checks it against the steps): NFKC
# leaves ASCII as it is, casefold is lower(), and each character that is neither a word character nor
# whitespace becomes a space (one space per run or per character is the same once whitespace folds).
# The regular expressions cost about 40 us on a 1,000-character text, this about 12 us: every request's
# text is normalized, an overload's refused ones too.
_ASCII_FOLD = {c: (" " if _PUNCT.fullmatch(chr(c)) else chr(c).lower()) for c in range(128)
               if _PUNCT.fullmatch(chr(c)) or chr(c).lower() != chr(c)}


def holds_pii(text: str) -> bool:
    """privacy.pii: no_store: whether a request's text holds PII (then it is answered, never cached)."""
    return pii.contains_pii(nfkc(text))


class Normalizer:
    def __init__(self, steps: tuple[Step, ...] = DEFAULT_STEPS, synonyms: Step | None = None) -> None:
        self.steps = steps
        self.synonyms = synonyms  # a model's dictionary (server/shared/synonyms.py), after the steps
        self._ascii_fold = steps == DEFAULT_STEPS

    @classmethod
    def of(cls, spec) -> "Normalizer":
        """A model's normalization (server/shared/models.py ModelSpec): with PII redaction where its
        privacy.pii says redact, and its synonym dictionary where it names one."""
        return cls(REDACTING_STEPS if spec.pii == "redact" else DEFAULT_STEPS, spec.synonyms)

    def __call__(self, text: str) -> str:
        if self._ascii_fold and text.isascii():
            text = " ".join(text.translate(_ASCII_FOLD).split())
        else:
            for step in self.steps:
                text = step(text)
        return self.synonyms(text) if self.synonyms is not None else text
