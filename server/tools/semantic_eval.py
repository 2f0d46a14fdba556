"""`infercache eval-semantic --folds K`: consensus settings swept offline over k folds.

(Without --folds, server/tools/semantic_heldout.py measures the server's own decisions.)

Against a running server, through gRPC, with k-fold cross-validation over a labelled CSV:
  1. warm: one tenant per fold; every row outside the fold is sent once (semantic matching off), so its
     computed answer is cached and indexed;
  2. replay: every row of the fold is sent with NO_STORE, `explain` and min_similarity 1.0, which returns
     the model's own answer for the query together with its nearest cached neighbours;
  3. any match policy is then evaluated offline on those neighbours: a hit is *faithful* when the
     neighbour's answer equals the model's answer for the query (what BYPASS would compute);
  4. a sample is replayed once more with the recommended policy itself, and the server's decisions are
     compared with the offline ones.
Reported: exact hits, semantic hits among exact misses, fidelity (to the model) and the hits' agreement
with the labels, each with its 95% Wilson interval, accuracy against the labels, the hits-vs-fidelity curve of consensus policies beside a fixed-threshold baseline (JSON and PNG).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import grpc

from infercache.v1 import infercache_pb2 as pb
from infercache.v1 import infercache_pb2_grpc
from server.tools.labelled_csv import read_labelled_csv
from server.shared.match_policy import MatchPolicy, Neighbor

THRESHOLDS = tuple(round(0.60 + 0.02 * i, 2) for i in range(20))  # 0.60 .. 0.98
NEIGHBORHOODS = (0.55, 0.60, 0.65, 0.70, 0.75)
MIN_AGREE = (1, 2, 3)
TARGET_FIDELITY = 0.99
# The recommendation is chosen on the data it is measured on; a margin keeps it off the knife's edge.
SAFETY_MARGIN = 0.0025


@dataclass
class Query:
    fold: int
    text: str
    label: str            # the dataset's label
    exact: bool = False   # answered by an exact (normalized) match
    answer: str = ""      # the model's own answer for this query
    neighbors: tuple[tuple[float, str], ...] = ()


async def send_all(stub, requests: list[pb.InferRequest], concurrency: int) -> list[pb.InferResponse]:
    out: list[pb.InferResponse | None] = [None] * len(requests)
    position = iter(range(len(requests)))

    async def caller() -> None:
        for i in position:
            for attempt in range(5):
                try:
                    out[i] = await stub.Infer(requests[i], timeout=60)
                    break
                except grpc.aio.AioRpcError as exc:
                    if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or attempt == 4:
                        raise
                    await asyncio.sleep(0.05 * (attempt + 1))

    await asyncio.gather(*(caller() for _ in range(concurrency)))
    return out  # type: ignore[return-value]


async def _wait_indexed(stub, at_least: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = await stub.GetStats(pb.GetStatsRequest(), timeout=10)
        if stats.worker.counters["semantic.indexed"] >= at_least:
            return
        await asyncio.sleep(0.1)
    raise TimeoutError(f"the server indexed fewer than {at_least} entries in {timeout} s")


def evaluate(policy: MatchPolicy, queries: list[Query]) -> dict:
    misses = [q for q in queries if not q.exact]
    hits = faithful = by_labels = correct = 0
    for q in misses:
        chosen = policy.decide([Neighbor(s, b"", a) for s, a in q.neighbors])
        answer = q.answer
        if chosen is not None:
            hits += 1
            faithful += chosen.answer == q.answer
            by_labels += chosen.answer == q.label
            answer = chosen.answer
        correct += answer == q.label
    return {
        "exact_misses": len(misses), "semantic_hits": hits,
        "hit_rate": hits / max(1, len(misses)), "fidelity": faithful / hits if hits else 1.0,
        # the hits' agreement with the model (the judge of a classifier's hits) and with the data set's labels
        "fidelity_95": _wilson(faithful, hits), "fidelity_labels": by_labels / hits if hits else None,
        "fidelity_labels_95": _wilson(by_labels, hits), "accuracy": correct / max(1, len(misses)),
    }


def _wilson(agreed: int, n: int) -> list[float] | None:
    """The 95% Wilson interval of a rate (None where n is 0)."""
    from server.worker.semantic.calibration import wilson_lower, wilson_upper

    return [round(wilson_lower(agreed, n), 4), round(wilson_upper(agreed, n, 1.96), 4)] if n else None


def sweep(queries: list[Query]) -> dict:
    baseline = [{"min_similarity": t, **evaluate(MatchPolicy(min_similarity=t, neighborhood=t, k=1, min_agree=1), queries)}
                for t in THRESHOLDS]
    consensus = []
    for t in THRESHOLDS:
        for n in NEIGHBORHOODS:
            for agree in MIN_AGREE:
                policy = MatchPolicy(min_similarity=t, neighborhood=n, k=5, min_agree=agree)
                consensus.append({"min_similarity": t, "neighborhood": n, "min_agree": agree, **evaluate(policy, queries)})
    return {"fixed_threshold": baseline, "consensus": consensus}


def best(points: list[dict], fidelity: float = TARGET_FIDELITY + SAFETY_MARGIN, min_agree: int = 1) -> dict | None:
    """Most hits at the fidelity target (plus margin). Consensus policies must have two agreeing
    neighbours: with one, a lone entry in a sparse cache answers whatever is nearest."""
    ok = [p for p in points if p["fidelity"] >= fidelity and p["semantic_hits"] > 0
          and p.get("min_agree", min_agree) >= min_agree]
    return max(ok, key=lambda p: (p["hit_rate"], p["fidelity"])) if ok else None


def frontier(points: list[dict]) -> list[dict]:
    """Pareto front: no other point has both more hits and higher fidelity."""
    ordered = sorted(points, key=lambda p: (-p["hit_rate"], -p["fidelity"]))
    front, best_fidelity = [], -1.0
    for p in ordered:
        if p["fidelity"] > best_fidelity:
            front.append(p)
            best_fidelity = p["fidelity"]
    return front


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    base = result["sweep"]["fixed_threshold"]
    ax.plot([p["hit_rate"] for p in base], [p["fidelity"] for p in base], "o-", label="fixed threshold (one neighbour)")
    front = frontier(result["sweep"]["consensus"])
    ax.plot([p["hit_rate"] for p in front], [p["fidelity"] for p in front], "s-", label="consensus policies (Pareto front)")
    chosen = result["recommended"]
    if chosen:
        ax.plot([chosen["hit_rate"]], [chosen["fidelity"]], "r*", markersize=16, label="recommended default")
    ax.axhline(TARGET_FIDELITY, color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel("semantic hits among exact misses")
    ax.set_ylabel("fidelity (hit answer = model's answer)")
    ax.set_ylim(0.85, 1.002)
    ax.set_title(f"{result['model']}: {result['folds']}-fold CV on {result['rows']} rows")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


async def run(address: str, model: str, rows: list[tuple[str, str]], folds: int, *, concurrency: int = 16,
              validate: int = 300, progress=print) -> dict:
    run_id = uuid.uuid4().hex[:8]
    queries: list[Query] = []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = infercache_pb2_grpc.InferenceCacheStub(channel)
        indexed = (await stub.GetStats(pb.GetStatsRequest(), timeout=10)).worker.counters["semantic.indexed"]
        fold_tenants = []
        for fold in range(folds):
            tenant = f"eval-{run_id}-{fold}"
            fold_tenants.append(tenant)
            warm = [t for i, (t, _) in enumerate(rows) if i % folds != fold]
            replay = [(t, l) for i, (t, l) in enumerate(rows) if i % folds == fold]
            started = time.monotonic()
            off = pb.SemanticPolicy(enabled=False)
            responses = await send_all(stub, [pb.InferRequest(model=model, tenant=tenant, text=t, semantic=off)
                                               for t in warm], concurrency)
            indexed += sum(r.cache.source == pb.CacheInfo.MISS for r in responses)
            await _wait_indexed(stub, indexed)
            explain = pb.SemanticPolicy(enabled=True, min_similarity=1.0, explain=True)
            policy = pb.CachePolicy(mode=pb.CachePolicy.NO_STORE)
            responses = await send_all(stub, [pb.InferRequest(model=model, tenant=tenant, text=t, cache=policy,
                                                               semantic=explain) for t, _ in replay], concurrency)
            fold_queries = [Query(fold, t, l) for t, l in replay]
            recheck = []
            for q, r in zip(fold_queries, responses):
                q.exact = r.cache.source == pb.CacheInfo.RESULT_EXACT
                q.neighbors = tuple((n.similarity, n.answer) for n in r.cache.neighbors)
                q.answer = r.classification.label
                if r.cache.source == pb.CacheInfo.RESULT_SEMANTIC:
                    recheck.append(q)  # a neighbour at similarity 1.0 answered: ask the model itself
            if recheck:
                again = await send_all(stub, [pb.InferRequest(model=model, tenant=tenant, text=q.text, cache=policy,
                                                               semantic=off) for q in recheck], concurrency)
                for q, r in zip(recheck, again):
                    q.answer = r.classification.label
            queries += fold_queries
            progress(f"  fold {fold + 1}/{folds}: warmed {len(warm)}, replayed {len(replay)} "
                     f"in {time.monotonic() - started:.0f} s")

        result = {"model": model, "rows": len(rows), "folds": folds, "sweep": sweep(queries)}
        result["exact_hits"] = sum(q.exact for q in queries)
        result["recommended"] = best(result["sweep"]["consensus"], min_agree=2)
        result["best_fixed_threshold"] = best(result["sweep"]["fixed_threshold"])
        if result["recommended"] and validate:
            result["validation"] = await _validate(stub, model, fold_tenants, result["recommended"], queries, validate)
        await _cleanup(stub, fold_tenants)
    return result


async def _validate(stub, model: str, tenants: list[str], chosen: dict, queries: list[Query], count: int) -> dict:
    """Replays a sample (spread over the folds) with the recommended policy on the server itself, one
    request at a time so the latency figures are the semantic path's own, and compares its decisions
    with the offline ones."""
    policy = MatchPolicy(min_similarity=chosen["min_similarity"], neighborhood=chosen["neighborhood"], k=5,
                         min_agree=chosen["min_agree"])
    misses = [q for q in queries if not q.exact]
    sample = misses[:: max(1, len(misses) // count)][:count]
    agree = server_hits = 0
    latencies = []
    for q in sample:
        started = time.perf_counter()
        r = await stub.Infer(pb.InferRequest(model=model, tenant=tenants[q.fold], text=q.text,
                                             cache=pb.CachePolicy(mode=pb.CachePolicy.NO_STORE),
                                             semantic=pb.SemanticPolicy(min_similarity=policy.min_similarity)),
                             timeout=30)
        hit = r.cache.source == pb.CacheInfo.RESULT_SEMANTIC
        if hit:
            latencies.append((time.perf_counter() - started) * 1000)
        server_hits += hit
        agree += hit == (policy.decide([Neighbor(s, b"", a) for s, a in q.neighbors]) is not None)
    latencies.sort()
    return {
        "checked": len(sample), "decisions_agreeing_with_offline": agree / max(1, len(sample)),
        "server_hits": server_hits,
        "semantic_hit_p50_ms": round(latencies[len(latencies) // 2], 2) if latencies else None,
        "note": ("meaningful for a model under the consensus rule: the server uses its configured neighborhood and "
                 "min_agree (only min_similarity is per request); under the calibrated rule it decides otherwise"),
    }


async def _cleanup(stub, tenants: list[str]) -> None:
    for tenant in tenants:
        await stub.Invalidate(pb.InvalidateRequest(tenant=tenant), timeout=60)


def report(result: dict) -> str:
    lines = [f"{result['model']}: {result['folds']}-fold CV over {result['rows']} rows; "
             f"exact hits {result['exact_hits']}"]
    for name in ("best_fixed_threshold", "recommended"):
        p = result[name]
        if p is None:
            lines.append(f"  {name}: no setting reaches fidelity {TARGET_FIDELITY + SAFETY_MARGIN:.4f}")
            continue
        setting = ", ".join(f"{k}={p[k]}" for k in ("min_similarity", "neighborhood", "min_agree") if k in p)
        lines.append(f"  {name:<21} {setting}: semantic hits {p['hit_rate']:.1%} of exact misses, "
                     f"fidelity {p['fidelity']:.2%} {p['fidelity_95']} (by the labels {p['fidelity_labels']:.2%} "
                     f"{p['fidelity_labels_95']}), accuracy {p['accuracy']:.2%}")
    if "validation" in result:
        v = result["validation"]
        lines.append(f"  validation on the server: {v['decisions_agreeing_with_offline']:.1%} of {v['checked']} "
                     f"decisions as offline; semantic hit p50 {v['semantic_hit_p50_ms']} ms")
    return "\n".join(lines)


def main(address: str, model: str, csv_path: Path, *, text_column: str, label_column: str, folds: int,
         limit: int | None, out: Path, png: Path | None) -> dict:
    rows = read_labelled_csv(csv_path, text_column, label_column, limit)
    print(f"infercache: evaluating {model} at {address} on {len(rows)} rows, {folds} folds ...", flush=True)
    result = asyncio.run(run(address, model, rows, folds, progress=lambda m: print(m, flush=True)))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    if png is not None:
        plot(result, png)
    print(report(result))
    print(f"wrote {out}" + (f" and {png}" if png else ""))
    return result
