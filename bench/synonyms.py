"""Synonyms section (`make bench ARGS="--sections synonyms"`): what a synonym dictionary does to exact hits.

The dictionary is mined from the Banking77 train split itself (`mine`), so that nothing hand-picked
flatters it: two texts of the same intent that differ in one span only ("how do i get my money back" /
"how do i get a refund") make that pair of spans (up to MAX_SPAN words each) a candidate; a pair seen in
at least MIN_PAIRS distinct text pairs is kept, unless swapping its spans turns some text of the split
into another text of another intent; kept pairs join into groups, and each group's most frequent phrase
in the split becomes its canonical form. Entries that `problems` objects to are dropped,
the most recently added first, until none is left. The labels only pick candidates: replaying counts a
hit whose stored text had another intent as a wrong hit.

Replay: the split's texts in order, each keyed as the server keys it (the model's Normalizer, then
entry_key); a key seen before is an exact hit. With and without the dictionary, in the same run: the
whole split with a dictionary mined from it, and a held-out replay (mined from the even rows, replayed
on the odd ones). Then the normalizer's cost per text, with and without the dictionary, rounds
alternating, medians.
"""

from __future__ import annotations

import csv
import re
import statistics
import time
from collections import Counter, defaultdict

from bench import BANKING77
from bench.sections import Run
from cachestore.keys import entry_key, namespace_id
from server.shared.normalize import Normalizer
from server.shared.synonyms import Synonyms, parse, problems

MAX_SPAN = 3
MIN_PAIRS = 3


def _rows() -> list[tuple[str, str]]:
    with open(BANKING77, newline="") as f:
        return [(row["text"], row["category"]) for row in csv.DictReader(f)]


def mine(rows: list[tuple[str, str]]) -> str:
    """A dictionary file's text mined from labelled rows (see the module's docstring)."""
    normalize = Normalizer()
    by_label: dict[str, set[tuple[str, ...]]] = defaultdict(set)
    for text, label in rows:
        if words := normalize(text).split(" "):
            by_label[label].add(tuple(words))
    pairs: Counter[tuple[str, str]] = Counter()
    for texts in by_label.values():
        ordered = sorted(texts)
        for i, a in enumerate(ordered):
            for b in ordered[i + 1:]:
                head = 0
                while head < min(len(a), len(b)) and a[head] == b[head]:
                    head += 1
                tail = 0
                while tail < min(len(a), len(b)) - head and a[-1 - tail] == b[-1 - tail]:
                    tail += 1
                span_a, span_b = a[head:len(a) - tail], b[head:len(b) - tail]
                if span_a and span_b and len(span_a) <= MAX_SPAN and len(span_b) <= MAX_SPAN:
                    pairs[tuple(sorted((" ".join(span_a), " ".join(span_b))))] += 1
    frequency: Counter[str] = Counter()
    for texts in by_label.values():
        for words in texts:
            for n in range(1, MAX_SPAN + 1):
                frequency.update(" ".join(words[i:i + n]) for i in range(len(words) - n + 1))
    parent: dict[str, str] = {}

    def root(x: str) -> str:
        while parent.setdefault(x, x) != x:
            x = parent[x]
        return x

    intents: dict[str, set[str]] = defaultdict(set)  # normalized text -> the intents it was labelled with
    for label, texts in by_label.items():
        for words in texts:
            intents[" ".join(words)].add(label)
    for (a, b), seen in pairs.items():
        if seen >= MIN_PAIRS and not _joins_intents(a, b, intents):
            parent[root(a)] = root(b)
    groups: dict[str, list[str]] = defaultdict(list)
    for phrase in parent:
        groups[root(phrase)].append(phrase)
    lines = []
    for members in groups.values():
        canonical = max(members, key=lambda p: (frequency[p], p))
        lines += [f"{p} => {canonical}" for p in sorted(members) if p != canonical]
    while True:  # drop what the checks object to, one entry at a time, the last line first
        found = problems(parse("\n".join(lines)))
        if not found:
            return "\n".join(lines) + "\n"
        worst = max(int(p.split(":", 2)[1]) for p in found)
        del lines[worst - 1]


def _joins_intents(a: str, b: str, intents: dict[str, set[str]]) -> bool:
    """Whether swapping phrase a for b (or b for a) in a text of the split gives a text of another intent."""
    for x, y in ((a, b), (b, a)):
        pattern = re.compile(rf"(?<!\S){re.escape(x)}(?!\S)")
        for text, labels in intents.items():
            if x in text and (other := intents.get(pattern.sub(y, text))) is not None and other != labels:
                return True
    return False


def replay(rows: list[tuple[str, str]], normalize: Normalizer, variant: str = "") -> dict:
    ns_id = namespace_id("", "banking77", "1", variant)
    first_label: dict[bytes, str] = {}
    hits = wrong = 0
    for text, label in rows:
        key = entry_key(ns_id, normalize(text))
        if key in first_label:
            hits += 1
            wrong += first_label[key] != label
        else:
            first_label[key] = label
    return {"texts": len(rows), "hits": hits, "hit_rate": round(hits / len(rows), 4), "wrong_label_hits": wrong,
            "distinct_keys": len(first_label)}


def _cost(rows: list[tuple[str, str]], rounds: int, table: Synonyms) -> dict:
    texts = [text for text, _ in rows]
    plain, with_synonyms = Normalizer(), Normalizer(synonyms=table)
    runs: dict[str, list[float]] = {"without": [], "with": []}
    for _ in range(rounds):
        for name, normalize in (("without", plain), ("with", with_synonyms)):
            started = time.perf_counter()
            for text in texts:
                normalize(text)
            runs[name].append((time.perf_counter() - started) / len(texts) * 1e6)
    out = {name: {"us_per_text": round(statistics.median(v), 3), "rounds": [round(x, 3) for x in v]}
           for name, v in runs.items()}
    out["with_over_without"] = round(out["with"]["us_per_text"] / out["without"]["us_per_text"], 3)
    return out


def bench_synonyms(rounds: int) -> dict:
    rows = _rows()
    mined = mine(rows)
    table = Synonyms({e.phrase: e.canonical for e in parse(mined)})
    whole = {"without": replay(rows, Normalizer()),
             "with": replay(rows, Normalizer(synonyms=table), f"synonyms:{table.fingerprint}")}
    even, odd = rows[0::2], rows[1::2]
    held_table = Synonyms({e.phrase: e.canonical for e in parse(mine(even))})
    held = {"without": replay(odd, Normalizer()), "with": replay(odd, Normalizer(synonyms=held_table)),
            "dictionary_phrases": len(held_table)}
    for part in (whole, held):
        part["hit_rate_ratio"] = round(part["with"]["hit_rate"] / max(part["without"]["hit_rate"], 1e-9), 2)
    return {"dictionary": {"phrases": len(table), "canonical_forms": len(set(table.table.values())),
                           "min_pairs": MIN_PAIRS, "max_span_words": MAX_SPAN, "sample": mined.splitlines()[:12]},
            "train_split": whole, "held_out_odd_rows": held, "normalizer_cost": _cost(rows, max(3, rounds), table)}


def print_synonyms(report: dict) -> None:
    d = report["dictionary"]
    print(f"\nsynonyms: a dictionary mined from Banking77 ({d['phrases']} phrases, {d['canonical_forms']} canonical forms)")
    for name in ("train_split", "held_out_odd_rows"):
        part = report[name]
        w, s = part["without"], part["with"]
        print(f"  {name:<18} exact hit rate {100 * w['hit_rate']:.2f}% without, {100 * s['hit_rate']:.2f}% with "
              f"({part['hit_rate_ratio']}x); hits of another intent: {w['wrong_label_hits']} / {s['wrong_label_hits']}")
    cost = report["normalizer_cost"]
    print(f"  normalizer per text: {cost['without']['us_per_text']} us without, {cost['with']['us_per_text']} us "
          f"with ({cost['with_over_without']}x)")


def section(run: Run) -> None:
    print("benchmarking synonym dictionaries (Banking77 exact hits, the normalizer's cost) ...", flush=True)
    run.report["synonyms"] = bench_synonyms(run.rounds)
    print_synonyms(run.report["synonyms"])
