"""Tokenization and padding for encoder models (Hugging Face `tokenizers`, no Python model code; BERT
WordPiece tokenizers answer printable-ASCII texts through server/shared/wordpiece.py, to the same ids)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from server.shared.wordpiece import FastWordPiece


class TextEncoder:
    def __init__(self, tokenizer_path: Path, max_tokens: int) -> None:
        if not tokenizer_path.is_file():  # the library's own message does not name the file
            raise FileNotFoundError(f"tokenizer file {tokenizer_path} is missing")
        self.tokenizer = Tokenizer.from_file(str(tokenizer_path))
        self.tokenizer.no_padding()
        self.tokenizer.enable_truncation(max_length=max_tokens)
        self.fast = FastWordPiece.of(self.tokenizer)  # None: every text goes to the tokenizer

    def encode(self, text: str) -> list[int]:
        if self.fast is not None and (ids := self.fast.encode(text)) is not None:
            return ids
        return self.tokenizer.encode(text).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        if self.fast is None:
            return [encoding.ids for encoding in self.tokenizer.encode_batch(texts)]
        out = [self.fast.encode(text) for text in texts]
        rest = [n for n, ids in enumerate(out) if ids is None]
        if rest:
            for n, encoding in zip(rest, self.tokenizer.encode_batch([texts[n] for n in rest])):
                out[n] = encoding.ids
        return out

    @property
    def fingerprint(self) -> tuple[int, int]:
        """Equal for encoders that produce the same ids (same vocabulary and rules, same truncation)."""
        return hash(self.tokenizer.to_str()), self.tokenizer.truncation["max_length"]


def pad_batch(sequences: list, length: int) -> dict[str, np.ndarray]:
    """Right-pads with id 0 to `length` (the longest in the batch, never beyond its bucket). Sequences
    are lists or int32 arrays of token ids. Vectorized: no Python work per row but its length."""
    lengths = np.fromiter(map(len, sequences), dtype=np.int64, count=len(sequences))
    mask = np.arange(length) < lengths[:, None]
    ids = np.zeros((len(sequences), length), dtype=np.int64)
    ids[mask] = np.concatenate(sequences) if len(sequences) > 1 else sequences[0]
    return {"input_ids": ids, "attention_mask": mask.astype(np.int64)}
