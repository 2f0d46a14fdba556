"""`infercache eval-semantic` (without --folds): the server's own semantic decisions on held-out queries.

Against a running server, through gRPC, with the model's configured rule (the calibrated one by default):
  1. split: every `1/holdout`-th row is replayed, the rest warm the cache (or, with a replay file, every
     row of the first file warms it and the replay file's rows are replayed); with `leave_out`, the rows
     of that share of the labels (every k-th label in sorted order) never warm it; with `warm_share`,
     only that share of the file's rows warms it (a cache that has seen less of its traffic);
  2. warm: the warm rows (shuffled, as traffic comes) are sent to a fresh tenant in DEFAULT mode, so the
     rule learns from its misses as it would in service;
  3. held-out replay: each replay row of the warmed labels, NO_STORE (the cache does not change); a
     semantic hit's answer is compared with the model's own, asked in a tenant with an empty cache;
  4. novel replay: the rows of the left-out labels, NO_STORE (a static cache: the stress case) and/or
     DEFAULT (they join the cache as they miss, as a new topic does in traffic);
  5. the live fidelity the server estimated by shadow verification over the held-out replay (GetStats,
     read before and after) beside the offline figure.
Reported: hits among exact misses, fidelity with a 95% Wilson interval, the hits' agreement with the
labels (with its interval, beside the model's own on the same questions), accuracy against the labels,
the share of novel queries answered from the cache and how many of those answers differ from the model's.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
import uuid
from pathlib import Path

import grpc

from infercache.v1 import infercache_pb2 as pb
from infercache.v1 import infercache_pb2_grpc
from server.worker.semantic.calibration import wilson_lower, wilson_upper
from server.tools.labelled_csv import read_labelled_csv
from server.tools.semantic_eval import send_all

SEMANTIC, EXACT = pb.CacheInfo.RESULT_SEMANTIC, pb.CacheInfo.RESULT_EXACT
LATENCY_SAMPLE = 300  # replay rows re-sent one at a time for the semantic hit p50 (and computed again)
# How the novel rows are replayed, in this order: against the cache as warmed (NO_STORE), and as traffic
# (DEFAULT: they join the cache as they miss). The second follows the first on the same server, which
# has then learnt from the first's verified hits: run one per server to measure each alone.
NOVEL_MODES = {"static": pb.CachePolicy.NO_STORE, "streaming": pb.CachePolicy.DEFAULT}


def split(rows: list[tuple[str, str]], holdout: int, leave_out: int,
          replay_rows: list[tuple[str, str]] | None = None) -> tuple[list, list, list]:
    """(warm, held-out replay, novel replay); `leave_out`: every leave_out-th label is novel (0: none).
    With `replay_rows` (another file), `rows` all warm and `replay_rows` are replayed; novel rows come
    from both."""
    labels = sorted({label for _, label in rows + (replay_rows or [])})
    novel = {label for i, label in enumerate(labels) if leave_out and i % leave_out == 0}
    if replay_rows is not None:
        warm, replay = [r for r in rows if r[1] not in novel], [r for r in replay_rows if r[1] not in novel]
        return warm, replay, [r for r in rows + replay_rows if r[1] in novel]
    warm = [r for i, r in enumerate(rows) if i % holdout != 0 and r[1] not in novel]
    replay = [r for i, r in enumerate(rows) if i % holdout == 0 and r[1] not in novel]
    return warm, replay, [r for r in rows if r[1] in novel]


async def _figures(stub, model: str) -> tuple[dict[str, int], int]:
    """The model's semantic figures and the index's size; and the shadow checks not settled yet."""
    counters = (await stub.GetStats(pb.GetStatsRequest(), timeout=10)).worker.counters
    prefix = f"semantic.{model}."  # then the version, then the figure's name
    figures = {k.rsplit(".", 1)[1]: v for k, v in counters.items() if k.startswith(prefix)}
    return figures | {"indexed": counters["semantic.indexed"]}, counters.get("semantic.shadow_pending", 0)


async def settle(stub, model: str, timeout: float = 120) -> dict[str, int]:
    """Waits until the index and the shadow checks stop moving (write-behind and background work done)."""
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        now, pending = await _figures(stub, model)
        if now == last and not pending:
            return now
        last = now
        await asyncio.sleep(0.5)
    return last or {}


def _interval(agreed: int, n: int) -> dict:
    return {"fidelity": agreed / n if n else None, "fidelity_95_low": wilson_lower(agreed, n) if n else None,
            "fidelity_95_high": wilson_upper(agreed, n, 1.96) if n else None}


async def _replay(stub, model: str, tenant: str, oracle: str, rows: list[tuple[str, str]], mode: int,
                  concurrency: int) -> dict:
    requests = [pb.InferRequest(model=model, tenant=tenant, text=t, cache=pb.CachePolicy(mode=mode)) for t, _ in rows]
    served = await send_all(stub, requests, concurrency)
    off = pb.SemanticPolicy(enabled=False)
    own = await send_all(stub, [pb.InferRequest(model=model, tenant=oracle, text=t, semantic=off,
                                                 cache=pb.CachePolicy(mode=pb.CachePolicy.NO_STORE))
                                 for t, _ in rows], concurrency)
    exact = sum(r.cache.source == EXACT for r in served)
    hits = [(r.classification.label, o.classification.label) for r, o in zip(served, own) if r.cache.source == SEMANTIC]
    agreed = sum(a == b for a, b in hits)
    # The hits by the data set's labels, beside the model's own answers to the same questions by them.
    labelled = [(r.classification.label, o.classification.label, label) for r, o, (_, label) in zip(served, own, rows)
                if r.cache.source == SEMANTIC]
    by_labels = sum(hit == label for hit, _, label in labelled)
    model_by_labels = sum(answer == label for _, answer, label in labelled)
    correct = sum(r.classification.label == label for r, (_, label) in zip(served, rows) if r.cache.source != EXACT)
    misses = len(rows) - exact
    return {"queries": len(rows), "exact_hits": exact, "exact_misses": misses, "semantic_hits": len(hits),
            "hit_rate": len(hits) / misses if misses else 0.0, "disagreed": len(hits) - agreed,
            **_interval(agreed, len(hits)), "accuracy": correct / misses if misses else None,
            "labels": {"agreed": by_labels, **_interval(by_labels, len(hits)),
                       "model_on_the_same_questions": model_by_labels / len(hits) if hits else None}}


async def one_at_a_time(stub, model: str, tenant: str, oracle: str, rows: list[tuple[str, str]]) -> dict:
    """p50 of the semantic hits among `rows` sent one at a time (the hit path's own latency), beside the
    same texts computed (matching off, in the tenant with an empty cache) in the same run: both run the
    embedder once, so on a head whose encoder is the embedder they cost about the same."""
    hits, computed = [], []
    no_store = pb.CachePolicy(mode=pb.CachePolicy.NO_STORE)
    for text, _ in rows:
        started = time.perf_counter()
        response = await stub.Infer(pb.InferRequest(model=model, tenant=tenant, text=text, cache=no_store), timeout=30)
        if response.cache.source == SEMANTIC:
            hits.append((time.perf_counter() - started) * 1000)
            started = time.perf_counter()
            await stub.Infer(pb.InferRequest(model=model, tenant=oracle, text=text, cache=no_store,
                                             semantic=pb.SemanticPolicy(enabled=False)), timeout=30)
            computed.append((time.perf_counter() - started) * 1000)
    if not hits:
        return {}
    return {"semantic_hit_p50_ms": round(statistics.median(hits), 2),
            "computed_p50_ms": round(statistics.median(computed), 2),
            "semantic_hit_vs_computed": round(statistics.median(hits) / statistics.median(computed), 3)}


async def run(address: str, model: str, rows: list[tuple[str, str]], *, holdout: int = 5, leave_out: int = 0,
              novel_modes: tuple[str, ...] = tuple(NOVEL_MODES), concurrency: int = 16, progress=print,
              replay_rows: list[tuple[str, str]] | None = None, warm_share: float | None = None) -> dict:
    warm, replay, novel = split(rows, holdout, leave_out, replay_rows)
    random.Random(0).shuffle(warm)
    if warm_share is not None:
        warm = warm[:round(len(rows) * warm_share)]
    run_id = uuid.uuid4().hex[:8]
    tenant, oracle = f"heldout-{run_id}", f"oracle-{run_id}"
    result: dict = {"model": model, "rows": len(rows), "warm": len(warm), "replay": len(replay), "novel": len(novel),
                    "split": ("the replay file's rows replayed" if replay_rows is not None else f"every {holdout}th row replayed")
                    + (f"; every {leave_out}th label left out" if leave_out else "")
                    + (f"; {warm_share:.0%} of the rows warm" if warm_share is not None else "")}
    async with grpc.aio.insecure_channel(address) as channel:
        stub = infercache_pb2_grpc.InferenceCacheStub(channel)
        started = time.monotonic()
        responses = await send_all(stub, [pb.InferRequest(model=model, tenant=tenant, text=t) for t, _ in warm],
                                    concurrency)
        result["warm_semantic_hits"] = sum(r.cache.source == SEMANTIC for r in responses)
        before = await settle(stub, model)
        progress(f"  warmed {len(warm)} in {time.monotonic() - started:.0f} s; threshold "
                 f"{before.get('threshold_milli', 'none')} (thousandths), {before.get('outcomes', 0)} outcomes")
        result["heldout"] = await _replay(stub, model, tenant, oracle, replay, pb.CachePolicy.NO_STORE, concurrency)
        after = await settle(stub, model)
        weight = after.get("verified_weight_milli", 0) - before.get("verified_weight_milli", 0)
        agreed = after.get("agreed_weight_milli", 0) - before.get("agreed_weight_milli", 0)
        result["heldout"]["live_fidelity"] = agreed / weight if weight else None
        result["heldout"]["live_verified"] = after.get("verified", 0) - before.get("verified", 0)
        result["server"] = after
        result["heldout"].update(await one_at_a_time(stub, model, tenant, oracle, replay[:LATENCY_SAMPLE]))
        progress(f"  replayed {len(replay)} held-out queries")
        for mode in novel_modes if novel else ():
            result[f"novel_{mode}"] = await _replay(stub, model, tenant, oracle, novel, NOVEL_MODES[mode], concurrency)
            progress(f"  replayed {len(novel)} queries of left-out labels ({mode})")
        for name in (tenant, oracle):
            await stub.Invalidate(pb.InvalidateRequest(tenant=name), timeout=60)
    return result


def report(result: dict) -> str:
    lines = [f"{result['model']}: {result['rows']} rows ({result['split']}); warmed {result['warm']}"]
    for name in ("heldout", "novel_static", "novel_streaming"):
        r = result.get(name)
        if not r:
            continue
        fidelity = "no hits" if r["fidelity"] is None else (
            f"fidelity {r['fidelity']:.2%} (95% {r['fidelity_95_low']:.2%} .. {r['fidelity_95_high']:.2%})")
        lines.append(f"  {name:<16} semantic hits {r['hit_rate']:.1%} of {r['exact_misses']} exact misses, {fidelity}, "
                     f"{r['disagreed']} differ from the model; accuracy {r['accuracy']:.2%}")
        labels = r["labels"]
        if labels["fidelity"] is not None:
            lines.append(f"  {'':<16} by the labels: the hits {labels['fidelity']:.2%} (95% {labels['fidelity_95_low']:.2%}"
                         f" .. {labels['fidelity_95_high']:.2%}), the model on the same questions "
                         f"{labels['model_on_the_same_questions']:.2%}")
    if (p50 := result.get("heldout", {}).get("semantic_hit_p50_ms")) is not None:
        lines.append(f"  one call at a time: semantic hit p50 {p50} ms; the same texts computed "
                     f"{result['heldout']['computed_p50_ms']} ms ({result['heldout']['semantic_hit_vs_computed']}x)")
    live = result.get("heldout", {}).get("live_fidelity")
    if live is not None:
        lines.append(f"  live fidelity (shadow verification over the held-out replay) {live:.2%} "
                     f"from {result['heldout']['live_verified']} checks")
    return "\n".join(lines)


def main(address: str, model: str, csv_path: Path, *, text_column: str, label_column: str, limit: int | None,
         holdout: int, leave_out: int, out: Path, novel_modes: tuple[str, ...] = tuple(NOVEL_MODES),
         replay_path: Path | None = None, warm_share: float | None = None) -> dict:
    rows = read_labelled_csv(csv_path, text_column, label_column, limit)
    replay_rows = None if replay_path is None else read_labelled_csv(replay_path, text_column, label_column, limit)
    print(f"infercache: evaluating {model} at {address} on {len(rows)} rows"
          + (f" warming, {len(replay_rows)} replayed" if replay_rows is not None else " (held-out replay)") + " ...",
          flush=True)
    result = asyncio.run(run(address, model, rows, holdout=holdout, leave_out=leave_out, novel_modes=novel_modes,
                             progress=lambda m: print(m, flush=True), replay_rows=replay_rows,
                             warm_share=warm_share))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(report(result))
    print(f"wrote {out}")
    return result
