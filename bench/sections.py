"""The bench's sections: one entry each (its name for --sections, the module whose `section(run)` runs it,
the parts of the report it writes, its result file, what it measures), and where their files go. Read also
by the tests without importing the sections themselves (some load KServe's messages, whose proto package
tritonclient's shares: one process holds only one of the two).

A section's runner takes the run's shared state (Run), writes its parts into run.report and prints its
table; the run saves the report after each section, however it ended, and a long section calls run.save()
after each step worth keeping on its way (a run cut short, a device lease, keeps what it measured)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from bench import RESULTS, TRIAL_RESULTS


@dataclass(frozen=True)
class Section:
    name: str                # what --sections takes
    module: str              # bench.<module>: its section(run) runs it
    parts: tuple[str, ...]   # the keys of the report it writes
    about: str               # what it measures (--help)
    stem: str = ""           # its result file's name before the machine's tag (default: its name)
    banking77: bool = False  # it trains a head on Banking77 or replays its texts

    @property
    def file_stem(self) -> str:
        return self.stem or self.name


# Every section, in the order a run takes them.
REGISTRY = (
    Section("serving", "bench.serving", ("exact_hits", "misses", "metrics_cost", "engine_alone", "startup"),
            "hits, misses, /metrics cost, start-up"),
    Section("metrics", "bench.metrics_cost", ("metrics_cost",), "the serving section's /metrics part alone",
            stem="metrics-cost"),
    Section("l3", "bench.l3", ("l3_engines",), "the L3 engine store: cold against warm"),
    Section("semantic", "bench.semantic", ("semantic",), "the semantic tier on Banking77, its index, its shadow "
            "checks", banking77=True),
    Section("security", "bench.security", ("security",), "hits with auth, encryption and redaction on against off"),
    Section("fleet", "bench.fleet", ("fleet",), "the fleet tier: two pods on one Redis"),
    Section("overload", "bench.overload", ("overload",), "misses at once against one worker"),
    Section("l2", "bench.l2", ("l2",), "the feature tier against the whole graph", banking77=True),
    Section("groups", "bench.length_groups", ("length_groups",), "batches by length group against by bucket",
            stem="length-groups", banking77=True),
    Section("worker", "bench.worker_capacity", ("worker_capacity",), "one worker's capacity",
            stem="worker-capacity"),
    Section("generate", "bench.generate", ("generate",), "SmolLM2 misses and hits; on a GPU host the torch "
            "decoder against its raw loop"),
    Section("prefix", "bench.prefix", ("prefix",), "the prefix cache against computing the prompt", banking77=True),
    Section("synonyms", "bench.synonyms", ("synonyms",), "exact hits with a synonym dictionary", banking77=True),
    Section("doors", "bench.doors", ("doors",), "hits through the OpenAI and KServe doors"),
    Section("ttl", "bench.ttl", ("ttl",), "TTL classes' cost, expiry jitter's spread"),
    Section("generate-semantic", "bench.generate_semantic", ("generate_semantic",), "semantic answers of SmolLM2 on "
            "Banking77 against GPTCache", banking77=True),
    Section("peers", "bench.peers", ("peers",), "exact hits against Triton's response cache, semantic hits "
            "against GPTCache, misses against infinity", banking77=True),
    Section("upstream", "bench.upstream", ("upstream",), "in front of an upstream server against LiteLLM's "
            "proxy cache"),
    Section("commit", "bench.group_commit", ("group_commit",), "the writer's CPU per put by group-commit window",
            stem="group-commit"),
    Section("write", "bench.write_path", ("write_path",), "the writer's sustained rate against LMDB's ceiling"),
    Section("workers", "bench.workers", ("workers",), "one worker against two, and a kill -9 of one (the lent "
            "GPU host: bench/device.sh; elsewhere a dry run on ONNX Runtime)"),
    Section("gpu", "bench.gpu", ("gpu",), "the GPU path (the lent GPU host: bench/device.sh; elsewhere a dry run "
            "on ONNX Runtime)"),
)
SECTIONS = tuple(section.name for section in REGISTRY)
BY_NAME = {section.name: section for section in REGISTRY}


@dataclass
class Run:
    """What the sections of one `python -m bench` share."""

    args: argparse.Namespace  # the command line (each section reads its own options)
    sections: set[str]        # the sections this run takes
    workdir: Path             # a temporary folder, gone after the run
    models: Path              # minilm (bench.fixtures.make_models)
    texts: list[str]
    rounds: int
    scale: float              # of the requests each load sends (0.02 dry, 0.2 quick, 1 full)
    report: dict
    save: Callable[[], None]

    @property
    def dry(self) -> bool:
        return self.args.dry_run

    @property
    def quick(self) -> bool:
        """--quick or --dry-run."""
        return self.args.quick

    @property
    def size(self) -> str:
        return "dry" if self.dry else "quick" if self.quick else "full"


def result_path(stem: str, tag: str, trial: str = "") -> Path:
    """Where a section's file goes: bench/results/<stem>-<tag>.json; a trial run's (trial "quick" or "dry")
    var/bench/<stem>-<trial>-<tag>.json, which git ignores and which replaces no current figure."""
    return RESULTS / f"{stem}-{tag}.json" if not trial else TRIAL_RESULTS / f"{stem}-{trial}-{tag}.json"
