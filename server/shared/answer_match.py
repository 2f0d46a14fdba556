"""Semantic answers for generated text: when may an answer generated for one question answer another?

A generative model (`task: generate`) with a `semantic:` section matches the normalized last user turn of a
request against the questions whose answers it cached, within a namespace that hashes everything else
that shapes the answer (`namespace_material`): the system prompt, the earlier turns where `context: all`
says they matter, and the generation settings. Tenants are in the namespace id, so each tenant has its
own index (server/worker/semantic/semantic_index.py keeps one per namespace), never a filter over a shared one.

An answer is faithful to a new question when the model would answer it the same way. The config says
who judges that, one of two:
- `judge`: a classification model of the repository (a head on the embedder, Banking77's intents for a
  banking FAQ bot) whose label for the new question equals its label for the cached one;
- `answer_cosine`: answer equivalence, the model itself: its fresh answer to the new question and the
  cached answer, both embedded by the embedder, within that cosine (server/worker/semantic/answer_equivalence.py).
  With no class labels, the rule decides on the questions' similarity (`margin`), and the calibration
  learns the similarity at which answers stay alike for `max_error`.

Under a classifier judge the decision is
the calibrated rule of the classifier tier (server/shared/match_policy.py) applied to the judge: the
judge's class scores stored with each cached question are interpolated at the query, and a hit needs the
query covered, the namespace's fit agreeing, and the predicted label's margin over the threshold that the
judge's own verdicts on the cache's misses and on shadow-checked hits learnt (server/worker/semantic/calibration.py)
for `max_error`, and the judge's label calibration (server/worker/semantic/label_calibration.py) must say that the
two questions share a label in truth, not only in the judge's eyes, with the probability that labelled
rows showed to keep `max_error`. The guards (server/shared/question_guards.py) then refuse a neighbour whose negations,
numbers, dates or entities differ from the query's; under answer equivalence a guarded pair whose
answers the model showed alike may answer after all (server/worker/semantic/answer_equivalence.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

from server.shared.match_policy import CalibratedPolicy

CONTEXTS = ("system", "all")  # what besides the last user turn keys an answer: system prompts, or every turn
# Answer equivalence: a calibration margin is the questions' similarity times this, so the calibration's
# bins (server/worker/semantic/calibration.py: 0.125 wide, up to 8) are 1/64 of a similarity wide.
SIMILARITY_SCALE = 8.0


@dataclass(frozen=True)
class AnswerMatchPolicy:
    judge: str | None            # a classification model served beside it, a head on `rule.embedder`; or
    rule: CalibratedPolicy       # embedder, max_error, coverage, k, verify_fraction
    context: str = "all"         # CONTEXTS
    answer_cosine: float | None = None  # ... answer equivalence: answers alike within this cosine

    @property
    def by_answers(self) -> bool:
        """Answer equivalence judges (else the classifier `judge`)."""
        return self.answer_cosine is not None

    def settings(self, embedder_version: str, judge_version: str = "") -> str:
        """What its outcomes depend on (server/worker/semantic/calibration.py keeps them with it)."""
        if self.by_answers:
            return (f"answers cosine={self.answer_cosine} context={self.context} {self.rule.embedder}/"
                    f"{embedder_version} k={self.rule.k} scale={SIMILARITY_SCALE}")
        return f"judge={self.judge}/{judge_version} context={self.context} {self.rule.settings(embedder_version)}"


def margin(similarity: float) -> float:
    """Answer equivalence: what the calibration bins a candidate by (its similarity to the question)."""
    return SIMILARITY_SCALE * similarity


OWN_KEYS = ("judge", "context", "answer_cosine")


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
    judge, cosine = section.get("judge"), section.get("answer_cosine")
    if judge is not None and cosine is not None:
        raise ValueError("semantic: judge (a classification model) and answer_cosine (answer equivalence) are two "
                         "judges; set one")
    if cosine is not None:
        if isinstance(cosine, bool) or not isinstance(cosine, (int, float)) or not 0 < cosine <= 1:
            raise ValueError(f"semantic.answer_cosine: the cosine within which two answers are alike, in (0, 1], "
                             f"got {cosine!r}")
        if "coverage" in section:
            raise ValueError("semantic.coverage: a setting of a classifier judge's rule; answer equivalence "
                             "decides on the questions' similarity alone")
        cosine = float(cosine)
    elif not isinstance(judge, str) or not judge:
        raise ValueError("semantic.judge: name the classification model that judges two questions alike "
                         "(or set answer_cosine: answer equivalence)")
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
    return AnswerMatchPolicy(judge if cosine is None else None, rule, context, cosine)


def namespace_material(policy: AnswerMatchPolicy, turns: list[dict], params: list) -> str:
    """What the namespace of a request's question hashes besides tenant, model and version: every turn
    but the last user turn where the context is `all`, the system turns where it is `system`, and the
    generation settings (`params`, as the exact key has them)."""
    kept = [t for t in turns[:-1] if policy.context == "all" or t["role"] == "system"]
    kind = "answers-equivalence:" if policy.by_answers else "answers:"  # (the judges' entries differ)
    return kind + json.dumps([kept, params], ensure_ascii=False, separators=(",", ":"))
