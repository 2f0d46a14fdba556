"""Where bench processes run on a many-core host: the load generator on whole physical cores of its
own, the servers it measures on the others.

Left to the scheduler, a server's frontend can land on the SMT sibling of the load generator's core
for its whole life, and on the 16-core H200 host that alone moved a one-caller p50 between 0.70 and
0.97 ms across identical servers. Children inherit the affinity of the process that starts them, so
servers are started inside `affinity(split.servers)` and the load runs inside `affinity(split.load)`.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

MIN_CPUS = 8  # below this, splitting starves one side: the scheduler is left alone


@dataclass(frozen=True)
class Split:
    load: frozenset[int]
    servers: frozenset[int]

    def describe(self) -> dict:
        return {"load_cpus": sorted(self.load), "server_cpus": sorted(self.servers)}


def _cpu_list(text: str) -> set[int]:
    """'0-3,8,10-11' -> {0, 1, 2, 3, 8, 10, 11}"""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if part:
            first, _, last = part.partition("-")
            cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def physical_cores(allowed: set[int]) -> list[frozenset[int]]:
    """The allowed logical CPUs grouped by the physical core they share (one group each without SMT)."""
    groups: dict[frozenset[int], None] = {}
    for cpu in sorted(allowed):
        siblings = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
        try:
            group = frozenset(_cpu_list(siblings.read_text()) & allowed) or frozenset({cpu})
        except (OSError, ValueError):
            group = frozenset({cpu})
        groups.setdefault(group, None)
    return list(groups)


def split(load_cores: int = 2) -> Split | None:
    """`load_cores` physical cores for the load generator, the rest for servers; None on a small host."""
    allowed = os.sched_getaffinity(0)
    if len(allowed) < MIN_CPUS:
        return None
    cores = physical_cores(allowed)
    load = frozenset().union(*cores[:load_cores])
    return Split(load, frozenset(allowed - load))


def _set_all_threads(cpus: set[int]) -> None:
    """Every thread of this process (gRPC's own threads too), not only the calling one."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass


@contextmanager
def affinity(cpus: frozenset[int] | None):
    """This process (and what it starts meanwhile) on `cpus`; None leaves placement alone."""
    if cpus is None:
        yield
        return
    before = os.sched_getaffinity(0)
    _set_all_threads(cpus)
    try:
        yield
    finally:
        _set_all_threads(before)
