"""A CPU worker's engine niceness against its event loop's and the frontends' (`server.cpu_worker_nice`):
`python -m bench.priority`.

On shared cores the engine's batches (milliseconds each) and a frontend's hit or refusal (microseconds)
compete for the same CPUs. Three measurements, on pairs of fresh servers run back to back, the
setting's value alternating (0 = the same priority, else the value under test):
1. the overload section (bench/overload.py): 3,000 misses at once; the refusals' p50 and p99, also
   against the refusal floor of the same run;
2. hits under misses: one caller's exact hits (300 texts, cached first) while 32 callers send misses of
   texts never seen; the hits' p50 and p99 and the misses' throughput;
3. a mix: 6,000 calls from 32 callers, 90% exact hits (300 texts cached first) and 10% misses; the
   throughput, and the p50 and p99 of all calls (the p50 a hit's, the p99 among the misses).
Writes bench/results/priority-<machine>.json (`--out` names another file).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import uuid
from pathlib import Path

from bench import default_out, recorded
from bench.fixtures import load_texts
from bench.load import minilm_only, run_each_once, run_load
from bench.overload import bench_overload
from harness.servers import ServerProcess
from infercache.v1 import infercache_pb2 as pb

MISS_CALLERS, HIT_TEXTS, HITS = 32, 300, 600
MIXED_CALLS, MIXED_HIT_SHARE = 6000, 0.9


async def _hits_under_misses(address: str, texts: list[str]) -> dict:
    hits = [pb.InferRequest(model="minilm", text=t) for t in texts[:HIT_TEXTS]]
    await run_load(address, hits, concurrency=4, total=len(hits))  # computed, then cached
    tag = uuid.uuid4().hex[:8]
    misses = [pb.InferRequest(model="minilm", text=f"{t} ({tag} {n})") for n, t in enumerate(texts)]
    flood = asyncio.ensure_future(run_load(address, misses, concurrency=MISS_CALLERS, total=len(misses)))
    await asyncio.sleep(0.5)  # the misses' batches are running
    hit = (await run_load(address, hits, concurrency=1, total=HITS)).summary()
    missed = (await flood).summary()
    assert hit["sources"] == {"RESULT_EXACT": HITS} and hit["errors"] == missed["errors"] == 0, (hit, missed)
    return {"hit_p50_ms": hit["p50_ms"], "hit_p99_ms": hit["p99_ms"], "miss_rps": missed["throughput_rps"],
            "miss_p50_ms": missed["p50_ms"]}


def _mixed(address: str, texts: list[str]) -> dict:
    hits = [pb.InferRequest(model="minilm", text=t) for t in texts[:HIT_TEXTS]]
    run_each_once(address, hits, concurrency=4)  # computed, then cached
    tag, misses = uuid.uuid4().hex[:8], texts[HIT_TEXTS:]
    every = round(1 / (1 - MIXED_HIT_SHARE))  # one miss in `every` calls
    calls = [pb.InferRequest(model="minilm", text=f"{misses[n % len(misses)]} ({tag} {n})") if n % every == every - 1
             else hits[n % len(hits)] for n in range(MIXED_CALLS)]
    summary = run_each_once(address, calls, concurrency=MISS_CALLERS, timeout=60).summary()
    assert summary["errors"] == 0, summary
    return {"mixed_rps": summary["throughput_rps"], "mixed_p50_ms": summary["p50_ms"], "mixed_p99_ms": summary["p99_ms"]}


def _medians(runs: list[dict]) -> dict:
    return {k: round(statistics.median(r[k] for r in runs), 3) for k in runs[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nice", type=int, default=19, help="the value under test (against 0)")
    parser.add_argument("--pairs", type=int, default=7)
    parser.add_argument("--out", default=str(default_out("priority")))
    args = parser.parse_args()
    texts = load_texts()
    values = (0, args.nice)
    overload: dict[int, list[dict]] = {v: [] for v in values}
    hits: dict[int, list[dict]] = {v: [] for v in values}
    with tempfile.TemporaryDirectory(prefix="infercache-priority-") as tmp:
        workdir = Path(tmp)
        models = minilm_only(workdir / "models")
        for n in range(args.pairs):
            for value in values if n % 2 else values[::-1]:
                # onnxruntime: on a GPU host too (auto would pick a GPU runtime, whose workers keep their priority)
                settings = (f"server.cpu_worker_nice={value}", "engines.runtime=onnxruntime")
                run = bench_overload(workdir / f"overload-{n}-{value}", texts, 1.0, settings=settings)
                assert run["refused"]["count"] and run["refused_vs_floor"], f"no refusals to compare: {run['codes']}"
                overload[value].append({"refused_p50_ms": run["refused"]["p50_ms"],
                                        "refused_p99_ms": run["refused"]["p99_ms"],
                                        **run["refused_vs_floor"], "codes": run["codes"]})
                (workdir / f"hits-{n}-{value}").mkdir()
                with ServerProcess(workdir / f"hits-{n}-{value}", models, settings=settings) as server:
                    hits[value].append(asyncio.run(_hits_under_misses(server.address, texts[:3000])))
                    hits[value][-1].update(_mixed(server.address, texts[3000:9000]))
                    assert server.stop() == 0
                print(f"  pair {n + 1}/{args.pairs}, nice {value}: refusals p50 {overload[value][-1]['refused_p50_ms']} "
                      f"ms ({overload[value][-1]['p50_ratio']}x the floor), p99 {overload[value][-1]['refused_p99_ms']} "
                      f"ms ({overload[value][-1]['p99_ratio']}x); hits under misses p50 {hits[value][-1]['hit_p50_ms']} "
                      f"p99 {hits[value][-1]['hit_p99_ms']} ms, misses {hits[value][-1]['miss_rps']}/s; mixed "
                      f"{hits[value][-1]['mixed_rps']}/s, p50 {hits[value][-1]['mixed_p50_ms']} p99 "
                      f"{hits[value][-1]['mixed_p99_ms']} ms", flush=True)
    report = {"recorded": recorded("bench.priority"), "pairs": args.pairs, "values": list(values),
              "overload": {str(v): {"median": _medians([{k: r[k] for k in r if k != "codes"} for r in overload[v]]),
                                    "runs": overload[v]} for v in values},
              "hits_under_misses": {str(v): {"median": _medians(hits[v]), "runs": hits[v]} for v in values}}
    Path(args.out).write_text(json.dumps(report, indent=2))
    for v in values:
        o, h = report["overload"][str(v)]["median"], report["hits_under_misses"][str(v)]["median"]
        print(f"nice {v} (medians of {args.pairs}): refusals p50 {o['refused_p50_ms']} ms ({o['p50_ratio']}x the floor), "
              f"p99 {o['refused_p99_ms']} ms ({o['p99_ratio']}x); hits under misses p50 {h['hit_p50_ms']} ms, "
              f"p99 {h['hit_p99_ms']} ms; misses {h['miss_rps']}/s; mixed {h['mixed_rps']}/s, p50 {h['mixed_p50_ms']} ms, "
              f"p99 {h['mixed_p99_ms']} ms")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
