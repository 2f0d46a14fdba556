"""A head model's layer, as both sides run it: its weights read and checked against its encoder, and its
scores (softmax of one matrix product). The workers run it on computed or cached features; a frontend on
stored ones (server/frontend/features.py)."""

from __future__ import annotations

import json
import zipfile

import numpy as np

from server.shared.models import HEAD_WEIGHTS_FILE, LABELS_FILE, TOKENIZER_FILE, HeadRef, ModelConfigError, ModelSpec


def read_weights(version_dir) -> tuple[np.ndarray, np.ndarray]:
    try:
        with np.load(version_dir / HEAD_WEIGHTS_FILE, allow_pickle=False) as data:
            weight, bias = data["weight"].astype(np.float32), data["bias"].astype(np.float32)
    except (OSError, ValueError, KeyError, zipfile.BadZipFile) as exc:  # (a truncated npz: BadZipFile)
        raise ModelConfigError(f"{version_dir / HEAD_WEIGHTS_FILE}: {exc!r}") from None
    if weight.ndim != 2 or bias.shape != (weight.shape[1],):
        raise ModelConfigError(f"{version_dir / HEAD_WEIGHTS_FILE}: weight {weight.shape} and bias {bias.shape} "
                               "do not make a dim x classes layer")
    return weight, bias


def head_scores(features: np.ndarray, weight: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """softmax(features @ weight + bias) per row, in FP32 (features in their stored form: FP16 or FP32)."""
    logits = features.astype(np.float32) @ weight
    logits += bias
    logits -= logits.max(axis=1, keepdims=True)
    np.exp(logits, out=logits)
    logits /= logits.sum(axis=1, keepdims=True)
    return logits


def load_head(spec: ModelSpec, version: str, ref: HeadRef, encoder: ModelSpec) -> tuple[np.ndarray, np.ndarray, list]:
    """A head version's (weight, bias, labels), checked against its encoder's spec (`ref.encoder`):
    the same tokenizer and max_tokens (frontends tokenize for the encoder with the head's, and a feature is
    keyed by the normalized text alone), and an output the head reads. ModelConfigError otherwise."""
    directory = spec.version_dir(version)
    weight, bias = read_weights(directory)
    if ((directory / TOKENIZER_FILE).read_bytes() != (encoder.version_dir(ref.encoder_version) / TOKENIZER_FILE).read_bytes()
            or spec.max_tokens != encoder.max_tokens):
        raise ModelConfigError(f"{directory}: its tokenizer and max_tokens must be its encoder's")
    if ref.input not in encoder.outputs:
        raise ModelConfigError(f"{directory}: its encoder {ref.encoder} has no output {ref.input!r}")
    try:
        labels = json.loads((directory / LABELS_FILE).read_text()) if spec.task == "classification" else []
    except (OSError, ValueError) as exc:
        raise ModelConfigError(f"{directory / LABELS_FILE}: {exc}") from None
    return weight, bias, labels
