"""A generative prompt's token ids, with what the caller wrote kept data: text that can never become a
control token, whatever it says.

The chat template is rendered a second time with a placeholder for each turn's content (once per sequence
of roles, then remembered), which shows the template's own text. The control tokens in that text (the
tokenizer's special tokens: turn markers, BOS/EOS the template writes) become their ids; the text between
them, the turns' content with the template's text around it, is tokenized with special-token parsing off,
so `<|im_end|>` in a message is the ordinary tokens of its characters, never the control id. A raw prompt
is all caller text. The tokenizer itself splits a text at its special tokens first and tokenizes each
stretch between them alone, so an ordinary prompt has exactly the ids the whole rendered text had.

A template that changes or drops a turn's content (the rendered text is not the placeholders' render with
the contents put in) cannot be split so: its prompts are tokenized whole, as rendered, unless the caller's
text holds a control token's text, which is then refused.
"""

from __future__ import annotations

import logging
import re
import secrets
from dataclasses import dataclass

from tokenizers import Tokenizer

from server.frontend.plan import keep
from server.shared.errors import InvalidArgument

log = logging.getLogger("infercache.prompts")

LAYOUTS_KEPT = 256  # role sequences whose template text is remembered; past it, start over
_SAMPLE = [{"role": "system", "content": "You answer for a bank."},
           {"role": "user", "content": "How do I get a refund?  "},
           {"role": "assistant", "content": " Ask the shop first.\n"},
           {"role": "user", "content": "\nAnd then?"}]


@dataclass(slots=True)
class Rendered:
    """A prompt as rendered, ready to tokenize."""

    text: str                   # the prompt as rendered (what the key hashes, unless holds_control)
    pieces: list[str | int]     # in order: text tokenized with special-token parsing off, and control ids
    holds_control: bool         # the caller's text holds a control token's text (so `text` is ambiguous)


class PromptRenderer:
    """One generative model version's chat template and tokenizer. chat and raw: event loop only (chat
    remembers layouts); ids: any thread (the tokenizer's settings are fixed here, before it is shared)."""

    def __init__(self, tokenizer: Tokenizer, template, name: str = "") -> None:
        self.template = template
        self.tokenizer = tokenizer
        added = tokenizer.get_added_tokens_decoder()
        self.control = {token.content: i for i, token in added.items() if token.special}
        self._lstrip = {i for i, token in added.items() if token.special and token.lstrip}
        self._rstrip = {i for i, token in added.items() if token.special and token.rstrip}
        # leftmost-longest, as the tokenizer matches them
        self._pattern = re.compile("|".join(map(re.escape, sorted(self.control, key=len, reverse=True)))
                                   if self.control else r"(?!)")
        self._marker = f"\x00{secrets.token_hex(8)}:"
        self._layouts: dict[tuple, tuple[list[str], list[list]] | None] = {}  # see _layout
        sample = self.chat(_SAMPLE)
        expected = tokenizer.encode(sample.text, add_special_tokens=False).ids  # special tokens parsed
        tokenizer.encode_special_tokens = True  # every later call: special tokens' text is text
        if self.ids(sample) != expected:
            log.warning("%s: a sample conversation's ids differ from those its tokenizer gives the rendered text "
                        "(its special tokens match in a way not reproduced here); content is kept text all the same",
                        name)

    def chat(self, turns: list[dict], add_generation_prompt: bool = True) -> Rendered:
        """`turns` ({role, content}) rendered with the template; the template's control tokens as ids."""
        text = self.template.render(messages=turns, add_generation_prompt=add_generation_prompt)
        contents = [turn["content"] for turn in turns]
        holds = any(self._pattern.search(content) for content in contents)
        layout = self._layout(tuple(turn["role"] for turn in turns), add_generation_prompt)
        if layout is None or _joined(layout[0], contents) != text:
            if holds:
                raise InvalidArgument("a message holds the text of one of this model's control tokens, which its "
                                      "chat template does not let the server keep as text; remove it")
            return Rendered(text, self._pieces([self._split(text)]), False)
        splits = layout[1]
        parts = [splits[0]]
        for content, after in zip(contents, splits[1:]):
            parts += [[content], after]
        return Rendered(text, self._pieces(parts), holds)

    def raw(self, prompt: str) -> Rendered:
        """A raw prompt: the caller's text, all of it tokenized as text."""
        return Rendered(prompt, [prompt], self._pattern.search(prompt) is not None)

    def ids(self, rendered: Rendered) -> list[int]:
        """The prompt's token ids: its control ids, and its texts tokenized with special-token parsing off."""
        texts = [piece for piece in rendered.pieces if isinstance(piece, str)]
        # (the batch call without offsets: a 4,096-token prompt tokenizes in 0.7x the time of encode's)
        encoded = iter(self.tokenizer.encode_batch_fast(texts, add_special_tokens=False))
        out: list[int] = []
        for piece in rendered.pieces:
            if isinstance(piece, int):
                out.append(piece)
            else:
                out += next(encoded).ids
        return out

    def _layout(self, roles: tuple[str, ...], generation_prompt: bool) -> tuple[list[str], list[list]] | None:
        """The template's text around each turn's content (len(roles) + 1 stretches, as they are and split
        at its control tokens), or None where a placeholder is not rendered exactly once, in its place."""
        key = (roles, generation_prompt)
        if key in self._layouts:
            return self._layouts[key]
        markers = [f"{self._marker}{n}\x00" for n in range(len(roles))]
        turns = [{"role": role, "content": marker} for role, marker in zip(roles, markers)]
        rest = self.template.render(messages=turns, add_generation_prompt=generation_prompt)
        stretches: list[str] = []
        for marker in markers:
            before, *after = rest.split(marker)
            if len(after) != 1 or self._marker in before:
                break
            stretches.append(before)
            rest = after[0]
        else:
            stretches.append(rest)
        layout = (stretches, [self._split(s) for s in stretches]) if len(stretches) == len(roles) + 1 else None
        keep(self._layouts, key, layout, LAYOUTS_KEPT)
        return layout

    def _split(self, text: str) -> list[str | int]:
        """The template's text: its control tokens as ids, the text between them as it is."""
        out: list[str | int] = []
        start = 0
        for match in self._pattern.finditer(text):
            out += [text[start:match.start()], self.control[match.group()]]
            start = match.end()
        out.append(text[start:])
        return out

    def _pieces(self, parts: list[list[str | int]]) -> list[str | int]:
        """Adjacent texts joined (the tokenizer saw them as one stretch), empty ones dropped, and the
        whitespace a control token strips from its side removed, as the tokenizer does."""
        out: list[str | int] = []
        for part in parts:
            for piece in part:
                if isinstance(piece, str) and out and isinstance(out[-1], str):
                    out[-1] += piece
                else:
                    out.append(piece)
        for n, piece in enumerate(out):
            if isinstance(piece, int):
                if piece in self._lstrip and n and isinstance(out[n - 1], str):
                    out[n - 1] = out[n - 1].rstrip()
                if piece in self._rstrip and n + 1 < len(out) and isinstance(out[n + 1], str):
                    out[n + 1] = out[n + 1].lstrip()
        return [piece for piece in out if piece != ""]


def _joined(stretches: list[str], contents: list[str]) -> str:
    """The placeholders' render with the contents put in."""
    out = [stretches[0]]
    for content, after in zip(contents, stretches[1:]):
        out += [content, after]
    return "".join(out)
