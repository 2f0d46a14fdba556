"""Process counters, reported through GetStats.

Each owner keeps its own collections.Counter (the batcher, the writer, the cores); this module only
gathers them into the API message, so no counter has two owners.
"""

from __future__ import annotations

import os
import time
from typing import Mapping

from infercache.v1 import infercache_pb2 as pb

_STARTED = time.monotonic()


def process_stats(role: str, *groups: tuple[str, Mapping[str, int]]) -> pb.ProcessStats:
    """groups: (prefix, counters) pairs; keys become "prefix.name"."""
    counters = {f"{prefix}.{name}": int(value) for prefix, group in groups for name, value in group.items()}
    return pb.ProcessStats(role=role, pid=os.getpid(), uptime_s=time.monotonic() - _STARTED, counters=counters)
