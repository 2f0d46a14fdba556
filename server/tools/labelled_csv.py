"""Labelled CSV files (a text column and a label column), as train-head and eval-semantic read them."""

from __future__ import annotations

import csv
from pathlib import Path


class LabelledDataError(ValueError):
    """The file cannot be used; the message says why (missing column, too few labels, unreadable)."""


def read_labelled_csv(path: Path, text_column: str, label_column: str, limit: int | None) -> list[tuple[str, str]]:
    """(text, label) rows with a non-empty text, the first `limit` of them; at least two distinct labels."""
    try:
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            missing = [c for c in (text_column, label_column) if c not in (reader.fieldnames or [])]
            if missing:
                raise LabelledDataError(
                    f"{path}: no column {missing[0]!r} (columns: {', '.join(reader.fieldnames or [])})")
            rows = [(r[text_column], r[label_column]) for r in reader if (r[text_column] or "").strip()]
    except OSError as exc:
        raise LabelledDataError(f"cannot read {path}: {exc}") from None
    rows = rows[:limit] if limit else rows
    if len({label for _, label in rows}) < 2:
        raise LabelledDataError(f"{path}: need at least two distinct labels in {label_column!r}")
    return rows
