"""`infercache cache warm` and `infercache cache hot`: start a pod or a model version hot.

`warm` replays texts (one per line, or a column of a CSV file) through a running server in InferBatch
calls, so their answers land in the caches as any request's would; it shows progress and ends with what
happened to the texts (already cached, computed, failed). `hot` prints a model's hottest keys
(GetHotKeys); with `--texts` (for models whose config sets hot_keys.keep_text) it prints the texts of
one tenant's (`--tenant`, default ""), one per line, which is a warm file for the next pod or version:

    infercache cache hot --model faq --texts --limit 256 > hot.txt
    infercache cache warm --model faq hot.txt --address new-pod:50051
"""

from __future__ import annotations

import csv
import sys
import time
from collections import Counter
from pathlib import Path

import grpc

from infercache.client import Client
from server.shared.printable import printable

RETRIES = 5            # an UNAVAILABLE or RESOURCE_EXHAUSTED call is retried this often, backing off
REPORT_EVERY_S = 0.5   # progress line refresh (a terminal), or every 10% (a log)
RETRIED = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED)


class WarmError(Exception):
    """A warm that cannot start: the file, its column, the model."""


def read_texts(path: Path, column: str | None) -> list[str]:
    """The texts of a file: a CSV's `column` (when given, or the file ends in .csv: default "text"),
    else one per line; empty ones are skipped."""
    try:
        with path.open(newline="", encoding="utf-8") as handle:
            if column is None and path.suffix.lower() != ".csv":
                return [line.rstrip("\r\n") for line in handle if line.strip()]
            column = column or "text"
            reader = csv.DictReader(handle)
            if reader.fieldnames is None or column not in reader.fieldnames:
                raise WarmError(f"{path}: no column {column!r} (columns: {', '.join(reader.fieldnames or [])}); "
                                "pick one with --column")
            return [row[column] for row in reader if (row.get(column) or "").strip()]
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise WarmError(f"{path}: {exc}") from None


class _Progress:
    def __init__(self, total: int, out=sys.stderr) -> None:
        self.total, self.out, self.started = total, out, time.monotonic()
        self.tty = out.isatty()
        self._next_at, self._next_share = 0.0, 0.1

    def show(self, done: int, outcomes: Counter, final: bool = False) -> None:
        now = time.monotonic()
        share = done / self.total if self.total else 1.0
        if not final and (now < self._next_at if self.tty else share < self._next_share):
            return
        self._next_at, self._next_share = now + REPORT_EVERY_S, share + 0.1
        rate = done / max(now - self.started, 1e-9)
        line = (f"warm: {done:,}/{self.total:,} texts ({share:.0%}), {rate:,.0f} texts/s, "
                f"{outcomes['cached']:,} already cached, {outcomes['failed']:,} failed")
        print(f"\r{line}" if self.tty else line, end="\n" if final or not self.tty else "", file=self.out,
              flush=True)


def _call(client: Client, model: str, texts: list[str], **options):
    for attempt in range(RETRIES + 1):
        try:
            return client.infer_batch(model, texts, **options)
        except grpc.RpcError as exc:
            if exc.code() not in RETRIED or attempt == RETRIES:
                raise
            time.sleep(min(5.0, 0.2 * 2 ** attempt))


def warm(client: Client, model: str, texts: list[str], *, batch: int = 32, version: str = "", tenant: str = "",
         out=sys.stderr) -> Counter:
    """Replays `texts`; returns the outcome counts: cached (answered from a cache tier), computed,
    failed, and one count per source (CacheInfo.Source, lowercase)."""
    served = {m.name: m for m in client.models()}
    if model not in served:
        raise WarmError(f"the server does not serve model {model!r} (it serves {', '.join(sorted(served)) or 'none'})")
    batch = max(1, min(batch, served[model].max_batch_texts or batch))
    outcomes: Counter = Counter()
    progress = _Progress(len(texts), out)
    errors_shown = 0  # the first few bad texts are named; all are counted
    for start in range(0, len(texts), batch):
        chunk = texts[start:start + batch]
        try:
            results = _call(client, model, chunk, version=version, tenant=tenant)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.INVALID_ARGUMENT or len(chunk) == 1:
                raise
            results = []  # one bad text fails its call: the others one by one
            for text in chunk:
                try:
                    results.extend(_call(client, model, [text], version=version, tenant=tenant))
                except grpc.RpcError as one:
                    if one.code() != grpc.StatusCode.INVALID_ARGUMENT:
                        raise
                    outcomes["failed"] += 1
                    if errors_shown < 5:
                        errors_shown += 1
                        print(f"\nwarm: text {start + chunk.index(text) + 1} not warmed: {printable(one.details())}", file=out)
        for result in results:
            source = result.source.lower()
            outcomes[source] += 1
            outcomes["computed" if source in ("miss", "feature") else "cached"] += 1
        progress.show(min(start + batch, len(texts)), outcomes)
    progress.show(len(texts), outcomes, final=True)
    return outcomes


def run_warm(address: str, model: str, path: Path, *, column: str | None, batch: int, version: str, tenant: str,
             token: str | None) -> int:
    try:
        texts = read_texts(path, column)
        if not texts:
            raise WarmError(f"{path}: no texts")
        started = time.monotonic()
        with Client(address, token=token, timeout_s=60.0) as client:
            outcomes = warm(client, model, texts, batch=batch, version=version, tenant=tenant)
    except WarmError as exc:
        print(f"infercache: {exc}", file=sys.stderr)
        return 2
    except grpc.RpcError as exc:
        print(f"infercache: warm stopped: {exc.code().name}: {printable(exc.details())}", file=sys.stderr)
        return 1
    took = time.monotonic() - started
    sources = ", ".join(f"{n:,} {name}" for name, n in sorted(outcomes.items())
                        if name not in ("cached", "computed", "failed"))
    print(f"warmed {model}: {len(texts):,} texts in {took:.1f} s: {outcomes['computed']:,} computed, "
          f"{outcomes['cached']:,} already cached, {outcomes['failed']:,} failed ({sources})")
    return 1 if outcomes["failed"] else 0


def run_hot(address: str, model: str, *, limit: int, texts: bool, tenant: str, token: str | None) -> int:
    """The hottest keys as a table; with `texts`, the texts of `tenant`'s keys, one per line (a warm
    file for that tenant)."""
    try:
        with Client(address, token=token) as client:
            keys = client.hot_keys(model, limit)
    except grpc.RpcError as exc:
        print(f"infercache: {exc.code().name}: {printable(exc.details())}", file=sys.stderr)
        return 1
    if texts:  # (normalized texts hold no control characters: escaping leaves them as they are)
        if keys and not any(key.text for key in keys):
            print(f"infercache: model {model!r} keeps no texts of its hot keys (set hot_keys.keep_text: true in "
                  "its config.yaml)", file=sys.stderr)
            return 1
        print("\n".join(printable(key.text) for key in keys if key.text and key.tenant == tenant))
        return 0
    print(f"{'count':>9} {'±':>7} {'version':<8} {'tenant':<12} {'key':<48} text")
    for key in keys:
        print(f"{key.count:>9,} {key.error:>7,} {printable(key.version):<8} {printable(key.tenant):<12} "
              f"{printable(key.key):<48} {printable(key.text)}")
    return 0
