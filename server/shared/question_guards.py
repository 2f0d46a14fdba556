"""What two questions must share before one's generated answer may answer the other, whatever their
embeddings say: their negations, their numbers (amounts, dates, counts: digits, number words, months,
weekdays) and their named entities. An embedder puts "How do I cancel my card?" and "How do I not cancel
my card?", or "Send 20 euros to Anna" and "Send 200 euros to Anna", side by side; a fixed distance
threshold cannot tell them apart.

`marks(text)` is a question's marks, worked out once in the frontend from the question as sent (PII
already replaced: entities are read from its capitals, which normalization folds); the worker compares
the query's marks with those stored beside the cached question (`same`). The marks are short strings,
so they are stored and sent as text, never as objects."""

from __future__ import annotations

import re

NEGATIONS = frozenset("not no never none nothing nobody nowhere neither nor cannot without".split())
NUMBER_WORDS = frozenset((
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
    "seventeen eighteen nineteen twenty thirty forty fifty sixty seventy eighty ninety hundred thousand "
    "million billion first second third fourth fifth half twice double triple").split())
CALENDAR = frozenset((
    "january february march april may june july august september october november december monday tuesday "
    "wednesday thursday friday saturday sunday today tomorrow yesterday").split())
# Capitalized words that are no entity: a sentence's first word is skipped already; these are common
# anywhere (the pronoun, question words after a quote, greetings).
NOT_ENTITIES = frozenset("i i'm i've i'd i'll hi hello please thanks ok okay".split())

_WORD = re.compile(r"[^\W_]+(?:['’][^\W_]+)*", re.UNICODE)
_NUMBER = re.compile(r"\d+(?:[.,]\d+)*")
_THOUSANDS = re.compile(r",(?=\d{3}(?!\d))")  # 1,000 is 1000; 1,5 stays 1,5 (a decimal comma)
_SENTENCE_END = re.compile(r"[.!?]\s*$")


def marks(text: str) -> tuple[str, ...]:
    """The question's guard marks, sorted: `neg` once per negation, `num:<n>` per number, `cal:<word>`
    per calendar word, `ent:<word>` per named entity."""
    out: list[str] = []
    lower = text.lower()
    negations = sum(1 for w in _WORD.findall(lower) if w in NEGATIONS or w.endswith(("n't", "n’t")))
    out += ["neg"] * negations
    out += [f"num:{_THOUSANDS.sub('', n)}" for n in _NUMBER.findall(text)]
    start = None
    for match in _WORD.finditer(text):
        word = match.group()
        folded = word.lower()
        first = start is None or bool(_SENTENCE_END.search(text[start:match.start()]))  # a sentence's first word
        start = match.end()
        if folded in NEGATIONS or folded.endswith(("n't", "n’t")):
            continue
        if folded in NUMBER_WORDS:
            out.append(f"num:{folded}")
        elif folded in CALENDAR:
            out.append(f"cal:{folded}")
        elif (word[0].isupper() and not first and folded not in NOT_ENTITIES) or (len(word) > 1 and word.isupper()):
            out.append(f"ent:{folded}")
    return tuple(sorted(out))


def same(a: tuple[str, ...] | list[str], b: tuple[str, ...] | list[str]) -> bool:
    """Whether two questions' marks agree: as many negations (an odd count flips a question, an even one
    may not, and a count tells them apart) and the same numbers, dates and entities."""
    return sorted(a) == sorted(b)


def encode(found: tuple[str, ...]) -> str:
    return "\n".join(found)


def decode(text: str) -> tuple[str, ...]:
    return tuple(text.split("\n")) if text else ()
