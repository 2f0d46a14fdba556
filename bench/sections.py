"""The bench's sections and where their files go: what `python -m bench` runs, read also by the tests
without importing the sections themselves (some load KServe's messages, whose proto package tritonclient's
shares: one process holds only one of the two)."""

from __future__ import annotations

from pathlib import Path

from bench import RESULTS, TRIAL_RESULTS

# Every section, in the order a run takes them (the names --sections takes).
SECTIONS = ("serving", "metrics", "l3", "semantic", "security", "fleet", "overload", "l2", "groups", "worker",
            "generate", "prefix", "synonyms", "doors", "ttl", "generate-semantic", "peers", "upstream", "commit",
            "write", "workers", "gpu")
NEEDS_BANKING77 = {"semantic", "l2", "groups", "prefix", "synonyms", "generate-semantic", "peers"}  # sections that train a head on it or replay its texts
# Each part of the report goes to the result file of its section (metrics_cost alone: metrics-cost).
FILES = {"exact_hits": "serving", "misses": "serving", "metrics_cost": "serving", "engine_alone": "serving",
         "startup": "serving", "l3_engines": "l3", "semantic": "semantic", "security": "security", "fleet": "fleet",
         "overload": "overload", "l2": "l2", "length_groups": "length-groups", "worker_capacity": "worker-capacity",
         "group_commit": "group-commit", "workers": "workers", "gpu": "gpu", "generate": "generate",
         "prefix": "prefix", "synonyms": "synonyms", "doors": "doors", "ttl": "ttl", "write_path": "write",
         "generate_semantic": "generate-semantic", "peers": "peers", "upstream": "upstream"}


def result_path(stem: str, tag: str, trial: str = "") -> Path:
    """Where a section's file goes: bench/results/<stem>-<tag>.json; a trial run's (trial "quick" or "dry")
    var/bench/<stem>-<trial>-<tag>.json, which git ignores and which replaces no current figure."""
    return RESULTS / f"{stem}-{tag}.json" if not trial else TRIAL_RESULTS / f"{stem}-{trial}-{tag}.json"
