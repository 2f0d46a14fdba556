"""`make bench`: `python -m bench --sections serving,l3,...` runs the sections bench/sections.py registers
(`--help` lists them with what each measures), each in its own module (`section(run)`), against baselines
measured in the same run; `make bench ARGS=--quick` for a short run.

Writes one file per section to bench/results/, named for the section and the machine (`serving-2core.json`,
`gpu-h200.json`; `--out FILE` puts the whole run in one file instead), each recording its command, machine,
commit and date, and prints a table. `--quick` (fewer requests and rounds) and `--dry-run` (every step of
each section at its smallest: tests/test_bench_tools.py runs each section so) write to var/bench/ instead
(`serving-quick-2core.json`, `serving-dry-2core.json`), which git ignores: they replace no current figure.
Sections that read Banking77 are skipped, with one line saying so, where bench/data/banking77/train.csv is
missing.
"""

from __future__ import annotations

import argparse
import importlib
import json
import tempfile
import time
from pathlib import Path

from bench import banking77_missing, machine, recorded
from bench.fixtures import load_texts, make_models
from bench.gpu import PARTS
from bench.sections import BY_NAME, REGISTRY, SECTIONS, Run, result_path


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench")
    parser.add_argument("--quick", action="store_true",
                        help="fewer requests and rounds (a smoke run); files to var/bench/, not bench/results/")
    parser.add_argument("--dry-run", action="store_true",
                        help="each section's every step at its smallest (the tests run it); files to var/bench/")
    parser.add_argument("--write-baseline", default="", metavar="REF",
                        help="the write section also runs the store writer of this commit, in the same rounds")
    parser.add_argument("--out", default="",
                        help="one file for the whole run (default: bench/results/<section>-<machine>.json per section)")
    parser.add_argument("--sections", default="serving,l3,semantic",
                        help="comma-separated: " + "; ".join(f"{s.name} ({s.about})" for s in REGISTRY))
    parser.add_argument("--rounds", type=int, default=0,
                        help="rounds of the repeated measurements (default 3, 1 with --quick; security runs 2n-1)")
    parser.add_argument("--gpu-parts", default=",".join(PARTS),
                        help=f"gpu section steps, comma-separated (default all: {','.join(PARTS)})")
    parser.add_argument("--prefix-parts", default="tiers,reuse",
                        help="prefix section on a GPU host, parts comma-separated: tiers (TTFT by tier), reuse (no "
                             "reuse and conversations, two 8B models: an H200's memory)")
    parser.add_argument("--peers-parts", default="hits,semantic",
                        help="peers section parts, comma-separated: hits (exact hits against Triton's response "
                             "cache), semantic (semantic hits against GPTCache), infinity (misses against infinity: "
                             "the lent GPU, bench/device.sh; elsewhere a dry run on the CPU)")
    parser.add_argument("--gpu-workers", default="1",
                        help="gpu section: worker processes sharing the GPU, comma-separated; the first serves every "
                             "step, the others repeat the MiniLM runs (e.g. 1,2,4)")
    parser.add_argument("--gpu-callers", default="2",
                        help="gpu section, part callers: multiples of the calls in flight to run again, comma-separated")
    parser.add_argument("--overload-deadline", type=float, default=10.0,
                        help="overload section: each call's deadline in seconds (0.5 on a GPU host: an overload there)")
    parser.add_argument("--overload-settings", default="",
                        help="overload section: the server's settings, comma-separated key=value (e.g. "
                             "engines.runtime=onnxruntime,server.engine_threads=4: a CPU-bound model on a GPU host)")
    parser.add_argument("--l2-settings", default="",
                        help="l2 section: the servers' settings, comma-separated key=value (e.g. "
                             "engines.runtime=onnxruntime,server.engine_threads=8: the CPU path on a GPU host)")
    parser.add_argument("--load-generator", choices=("native", "python"), default="native",
                        help="l2 section: its callers, C++ (bench/native/loadgen.cc, where gRPC's C++ library is "
                             "installed; else Python) or Python (grpc.aio)")
    parser.add_argument("--generate-models", default="llama3-8b,smollm2-135m",
                        help="generate section on a GPU host: the random-weight model shapes, comma-separated")
    args = parser.parse_args()
    for option, value, known in (("--peers-parts", args.peers_parts, {"hits", "semantic", "infinity"}),
                                 ("--prefix-parts", args.prefix_parts, {"tiers", "reuse"})):
        if set(value.split(",")) - known:
            parser.error(f"{option}: {sorted(set(value.split(',')) - known)} unknown; the parts are {sorted(known)}")
    sections = set(args.sections.split(","))
    if sections - set(SECTIONS):
        parser.error(f"--sections: {sorted(sections - set(SECTIONS))} unknown; the sections are {', '.join(SECTIONS)}")
    if "serving" in sections:
        sections.discard("metrics")  # (the serving section measures it)
    missing = banking77_missing()
    for name in sorted(s for s in sections if BY_NAME[s].banking77) if missing else ():
        print(f"skipping section {name}: {missing}", flush=True)
        sections.discard(name)
    args.quick = args.quick or args.dry_run
    scale, rounds = (0.02, 1) if args.dry_run else (0.2, 1) if args.quick else (1.0, 3)
    report: dict = {"recorded": recorded("bench"), "machine": machine(),
                    "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    trial = "dry" if args.dry_run else "quick" if args.quick else ""
    written: set[Path] = set()

    def save() -> None:  # after each section and step: a run cut short (a device lease) keeps what it measured
        files: dict[Path, dict] = {Path(args.out): report} if args.out else {}
        for section in REGISTRY if not args.out else ():
            if section.name in sections:
                for key in section.parts:
                    if key in report:
                        path = result_path(section.file_stem, report["machine"]["tag"], trial)
                        part = files.setdefault(path, {k: report[k] for k in ("recorded", "machine", "started")})
                        part[key] = report[key]
        for path, content in files.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(content, indent=2))
            written.add(path)

    with tempfile.TemporaryDirectory(prefix="infercache-bench-") as tmp:
        run = Run(args, sections, Path(tmp), make_models(Path(tmp) / "models"), load_texts(), args.rounds or rounds,
                  scale, report, save)
        for section in REGISTRY:
            if section.name in sections:
                try:
                    importlib.import_module(section.module).section(run)
                finally:  # what it measured is kept, however it ended
                    save()
    print("\nwrote " + (", ".join(str(p) for p in sorted(written)) or "nothing"))


if __name__ == "__main__":
    main()
