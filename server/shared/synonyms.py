"""Synonym dictionaries: common expressions mapped to one form before a key is derived.

A model's config names a dictionary file (`normalize: {synonyms: FILE}`, relative to the model's
folder). Each line maps one or more phrases to a canonical phrase; `#` starts a comment:

    get my money back | money back => get a refund
    cash machine | cashpoint => atm

Phrases and canonical forms are normalized as request texts are (NFKC, case, punctuation, whitespace),
and match whole words of the normalized text, the longest phrase first, left to right, in one pass. So
that every phrase shares its canonical form's key, a canonical form must come out of the dictionary as
it went in; `problems` names what breaks that, or makes a result depend on the order of matching:

- a phrase that maps to itself;
- a phrase mapped to two different canonical forms;
- a canonical form that is, or holds, a phrase of the dictionary (a chain a => b, b => c, or a cycle);
- two phrases that overlap (the end of one is the start of the other) where no phrase covers both:
  which one applies would depend on where the text starts.

The dictionary's fingerprint (its normalized mapping, not its bytes: comments and order do not count)
is part of the namespace of the model's keys (cachestore/keys.py), so a changed dictionary can never
serve keys made under the old one. `infercache synonyms check FILE` runs the checks.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

ARROW = "=>"
MAX_PHRASE_WORDS = 16


class SynonymError(ValueError):
    pass


@dataclass(frozen=True)
class Entry:
    phrase: str     # normalized
    canonical: str  # normalized
    line: int


def _fold(text: str) -> str:
    from server.shared.normalize import Normalizer  # (normalize.py runs dictionaries: no import cycle)

    return Normalizer()(text)


def parse(text: str, source: str = "synonyms") -> list[Entry]:
    """The entries of a dictionary's text; SynonymError naming the line of a malformed one."""
    entries = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if line.count(ARROW) != 1:
            raise SynonymError(f"{source}:{number}: expected 'phrase | phrase => canonical', got {raw.strip()!r}")
        left, right = line.split(ARROW)
        canonical = _fold(right)
        if not canonical:
            raise SynonymError(f"{source}:{number}: the canonical form is empty (after normalization)")
        for phrase in left.split("|"):
            folded = _fold(phrase)
            if not folded:
                raise SynonymError(f"{source}:{number}: a phrase is empty (after normalization): {raw.strip()!r}")
            if len(folded.split(" ")) > MAX_PHRASE_WORDS:
                raise SynonymError(f"{source}:{number}: {folded!r} has more than {MAX_PHRASE_WORDS} words")
            entries.append(Entry(folded, canonical, number))
    return entries


def problems(entries: list[Entry], source: str = "synonyms") -> list[str]:
    """What makes a dictionary unusable (see the module's docstring), one message each."""
    out: list[str] = []
    first: dict[str, Entry] = {}
    for entry in entries:
        if entry.phrase == entry.canonical:
            out.append(f"{source}:{entry.line}: {entry.phrase!r} maps to itself")
            continue
        seen = first.setdefault(entry.phrase, entry)
        if seen.canonical != entry.canonical:
            out.append(f"{source}:{entry.line}: {entry.phrase!r} maps to {entry.canonical!r} here and to "
                       f"{seen.canonical!r} on line {seen.line}")
    table = {p: e for p, e in first.items() if e.phrase != e.canonical}
    matcher = Synonyms(table and {p: e.canonical for p, e in table.items()})
    for entry in table.values():
        canonical = entry.canonical
        if canonical in table:
            path, node = [entry.phrase, canonical], table[canonical].canonical
            while node in table and node not in path:
                path.append(node)
                node = table[node].canonical
            what = "a cycle" if node in path else "a chain"
            out.append(f"{source}:{entry.line}: {entry.phrase!r} maps to {canonical!r}, itself a phrase (line "
                       f"{table[canonical].line}): {what} {' => '.join([*path, node])}; map every phrase to "
                       "its last form directly")
        elif (found := matcher.search(canonical)) is not None:
            out.append(f"{source}:{entry.line}: the canonical form {canonical!r} holds the phrase {found!r} (line "
                       f"{table[found].line}), so it would change again")
    out += _overlaps(table, source)
    return out


def _overlaps(table: dict[str, Entry], source: str) -> list[str]:
    """Pairs of phrases where the end of one is the start of the other, and no phrase covers both."""
    starts: dict[tuple[str, ...], list[str]] = {}
    for phrase in table:
        words = tuple(phrase.split(" "))
        for k in range(1, len(words)):
            starts.setdefault(words[:k], []).append(phrase)
    out = []
    for phrase, entry in table.items():
        words = tuple(phrase.split(" "))
        for k in range(1, len(words)):
            for other in starts.get(words[k:], ()):
                union = " ".join((*words, *other.split(" ")[len(words) - k:]))
                if union not in table:
                    out.append(f"{source}:{entry.line}: {phrase!r} overlaps {other!r} (line {table[other].line}) in "
                               f"{union!r}: which applies would depend on where the text starts; add {union!r} "
                               "as a phrase of its own, or drop one of them")
    return out


def _pattern(phrases) -> str:
    """A regular expression of the phrases as a trie of words: at each word boundary, the longest phrase
    that ends on a word boundary (greedy, backtracking to shorter ones)."""
    trie: dict = {}
    for phrase in phrases:
        node = trie
        for word in phrase.split(" "):
            node = node.setdefault(word, {})
        node[""] = {}

    def alternatives(node: dict) -> str:
        parts = []
        for word, child in sorted(node.items()):
            if not word:
                continue
            longer = [w for w in child if w]
            if not longer:
                rest = r"(?!\S)"
            elif "" in child:
                rest = rf"(?: (?:{alternatives(child)})|(?!\S))"
            else:
                rest = rf" (?:{alternatives(child)})"
            parts.append(re.escape(word) + rest)
        return "|".join(parts)

    return rf"(?<!\S)(?:{alternatives(trie)})"


class Synonyms:
    """A dictionary, compiled: called on a normalized text, it returns the text with each phrase
    replaced by its canonical form."""

    def __init__(self, table: dict[str, str]) -> None:
        self.table = dict(table)
        self._regex = re.compile(_pattern(self.table)) if self.table else None
        canonical = json.dumps(sorted(self.table.items()), ensure_ascii=False).encode()
        self.fingerprint = hashlib.blake2b(canonical, digest_size=8, person=b"icache-syn").hexdigest()

    def __call__(self, text: str) -> str:
        if self._regex is None:
            return text
        return self._regex.sub(self._replace, text)

    def _replace(self, match: re.Match) -> str:
        return self.table[match.group()]

    def search(self, text: str) -> str | None:
        """The first phrase found in a normalized text, or None."""
        found = self._regex.search(text) if self._regex is not None else None
        return found.group() if found else None

    def __len__(self) -> int:
        return len(self.table)


def load(path: Path) -> Synonyms:
    """A dictionary file, checked; SynonymError naming every problem (with its file and line)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SynonymError(f"cannot read synonym dictionary {path}: {exc}") from None
    entries = parse(text, str(path))
    found = problems(entries, str(path))
    if found:
        raise SynonymError("; ".join(found))
    return Synonyms({e.phrase: e.canonical for e in entries})
