"""Text normalization: the pipeline that decides which requests share a cache key.

Each step is a plain function str -> str; `Normalizer` runs them in order. Later steps (configured
synonyms, PII redaction) are added to the pipeline, not to the call sites.
"""

from __future__ import annotations

import re
import unicodedata
from typing import Callable

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


class Normalizer:
    def __init__(self, steps: tuple[Step, ...] = DEFAULT_STEPS) -> None:
        self.steps = steps

    def __call__(self, text: str) -> str:
        for step in self.steps:
            text = step(text)
        return text
