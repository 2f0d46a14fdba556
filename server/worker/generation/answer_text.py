"""A generation's answer as it grows: token ids in, text deltas out, stop strings and the end tokens
honoured, and the next token chosen from the model's scores (greedy, or sampled with temperature,
top-k and top-p from a generator that a seed makes reproducible)."""

from __future__ import annotations

import numpy as np
from tokenizers import Tokenizer

from infercache.v1 import infercache_pb2 as pb

STOP, LENGTH = pb.GenerationEnd.STOP, pb.GenerationEnd.LENGTH
REPLACEMENT = "\ufffd"  # what a token that ends inside a UTF-8 character decodes to, for now


class AnswerText:
    """The answer of one generation. `add` takes the next token id and returns the text to send (what is
    certain: not an incomplete character, not the start of a possible stop string); `finish` is set once
    the answer ended (an end token, a stop string, or the token budget)."""

    def __init__(self, tokenizer: Tokenizer, end_ids: tuple[int, ...], stop: list[str], max_new_tokens: int) -> None:
        self.tokenizer = tokenizer
        self.end_ids = end_ids
        self.stop = stop
        self.max_new_tokens = max_new_tokens
        self.ids: list[int] = []
        self.sent = ""              # text given out so far
        self.finish: int | None = None
        # Incremental decoding: the text of ids[:read] is settled (it ends on a whole character); each
        # token decodes only ids[prefix:] against ids[prefix:read], not the whole answer again.
        self._settled = ""
        self._prefix = self._read = 0

    def add(self, token: int) -> str:
        if token in self.end_ids:
            self.finish = STOP
            return self._flush(self._text())
        self.ids.append(token)
        text = self._text()
        for stop in self.stop:
            at = text.find(stop, max(0, len(self.sent) - len(stop)))
            if at >= 0:
                self.finish = STOP
                return self._flush(text[:at])
        if len(self.ids) >= self.max_new_tokens:
            self.finish = LENGTH
            return self._flush(text)
        if text.endswith(REPLACEMENT):
            return ""
        held = max((n for stop in self.stop for n in range(len(stop) - 1, 0, -1) if text.endswith(stop[:n])), default=0)
        return self._flush(text[:len(text) - held])

    def end(self, reason: int) -> str:
        """Ends the answer from outside (the context is full): what was held back, then nothing more."""
        self.finish = reason
        return self._flush(self._text().rstrip(REPLACEMENT))

    def _text(self) -> str:
        """The answer's text so far (ending in REPLACEMENT while a character is incomplete)."""
        decode = self.tokenizer.decode
        before = decode(self.ids[self._prefix:self._read], skip_special_tokens=True)
        now = decode(self.ids[self._prefix:], skip_special_tokens=True)
        tail = now[len(before):]
        if tail and not tail.endswith(REPLACEMENT):
            self._settled += tail
            self._prefix, self._read = self._read, len(self.ids)
            return self._settled
        return self._settled + tail

    def _flush(self, upto: str) -> str:
        delta = upto[len(self.sent):] if upto.startswith(self.sent) else ""
        self.sent += delta
        return delta


class Sampler:
    """Chooses each next token of one generation."""

    def __init__(self, temperature: float, top_p: float, top_k: int, seed: int | None) -> None:
        self.temperature = temperature
        self.top_p = top_p
        self.top_k = top_k
        self.rng = np.random.default_rng(seed) if temperature > 0 else None

    def __call__(self, logits: np.ndarray) -> int:
        if self.rng is None:
            return int(np.argmax(logits))
        scores = logits.astype(np.float64) / self.temperature
        if 0 < self.top_k < scores.size:
            cut = np.partition(scores, -self.top_k)[-self.top_k]
            scores[scores < cut] = -np.inf
        scores -= scores.max()
        probs = np.exp(scores)
        probs /= probs.sum()
        if self.top_p < 1.0:
            order = np.argsort(-probs, kind="stable")
            kept = np.cumsum(probs[order]) - probs[order] < self.top_p  # the smallest set reaching top_p
            mask = np.zeros_like(probs, dtype=bool)
            mask[order[kept]] = True
            probs = np.where(mask, probs, 0.0)
            probs /= probs.sum()
        return int(self.rng.choice(probs.size, p=probs))
