"""Semantic answers for generated text: when may an answer generated for one question answer another?

A generative model (`task: generate`) with a `semantic:` section matches the normalized last user turn of a
request against the questions whose answers it cached, within a namespace that hashes everything else
that shapes the answer (`namespace_material`): the system prompt, the earlier turns where `context: all`
says they matter, and the generation settings. Tenants are in the namespace id, so each tenant has its
own index (server/worker/semantic_index.py keeps one per namespace), never a filter over a shared one.

An answer is faithful to a new question when the model would answer it the same way. The `judge` says
when that is: a classification model of the repository (a head on the embedder, Banking77's intents for a
banking FAQ bot) whose label for the new question equals its label for the cached one. The decision is
the calibrated rule of the classifier tier (server/shared/match_policy.py) applied to the judge: the
judge's class scores stored with each cached question are interpolated at the query, and a hit needs the
query covered, the namespace's fit agreeing, and the predicted label's margin over the threshold that the
judge's own verdicts on the cache's misses and on shadow-checked hits learnt (server/worker/calibration.py)
for `max_error`. The guards (server/shared/question_guards.py) then refuse a neighbour whose negations,
numbers, dates or entities differ from the query's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

from server.shared.match_policy import CalibratedPolicy

CONTEXTS = ("system", "all")  # what besides the last user turn keys an answer: system prompts, or every turn


@dataclass(frozen=True)
class AnswerMatchPolicy:
    judge: str                   # a classification model served beside it, a head on `rule.embedder`
    rule: CalibratedPolicy       # embedder, max_error, coverage, k, verify_fraction
    context: str = "all"         # CONTEXTS

    def settings(self, embedder_version: str, judge_version: str) -> str:
        """What its outcomes depend on (server/worker/calibration.py keeps them with it)."""
        return f"judge={self.judge}/{judge_version} context={self.context} {self.rule.settings(embedder_version)}"


OWN_KEYS = ("judge", "context")


def answer_match_from_config(section: dict | None) -> AnswerMatchPolicy | None:
    """A generative model's `semantic:` section (None when absent or not enabled)."""
    if not section:
        return None
    if not isinstance(section, dict):
        raise ValueError(f"semantic: expected a mapping of settings, got {section!r}")
    names = {f.name for f in fields(CalibratedPolicy)} | set(OWN_KEYS) | {"enabled"}
    if unknown := set(section) - names:
        raise ValueError(f"semantic: {', '.join(sorted(unknown))} not settings of a generative model's semantic "
                         f"answers ({', '.join(sorted(names))})")
    if not section.get("enabled", False):
        return None
    judge = section.get("judge")
    if not isinstance(judge, str) or not judge:
        raise ValueError("semantic.judge: name the classification model that judges two questions alike")
    context = str(section.get("context", "all"))
    if context not in CONTEXTS:
        raise ValueError(f"semantic.context must be one of {', '.join(CONTEXTS)}, got {context!r}")
    rule_section = {k: v for k, v in section.items() if k not in OWN_KEYS}
    try:
        rule = CalibratedPolicy(**{k: type(getattr(CalibratedPolicy, k))(v) for k, v in rule_section.items()
                                   if k != "enabled"})
    except (TypeError, ValueError) as exc:
        raise ValueError(f"semantic: {exc}") from None
    if not (0 < rule.max_error < 1 and 0 < rule.coverage <= 2 and rule.k >= 2 and 0 <= rule.verify_fraction <= 1):
        raise ValueError("semantic: need 0 < max_error < 1, 0 < coverage <= 2, k >= 2 and 0 <= verify_fraction <= 1")
    return AnswerMatchPolicy(judge, rule, context)


def namespace_material(policy: AnswerMatchPolicy, turns: list[dict], params: list) -> str:
    """What the namespace of a request's question hashes besides tenant, model and version: every turn
    but the last user turn where the context is `all`, the system turns where it is `system`, and the
    generation settings (`params`, as the exact key has them)."""
    kept = [t for t in turns[:-1] if policy.context == "all" or t["role"] == "system"]
    return "answers:" + json.dumps([kept, params], ensure_ascii=False, separators=(",", ":"))
