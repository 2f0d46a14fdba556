"""Where a worker's start went: each phase timed, for the log, GetStats and /metrics.

Phases of the process (seconds; the worker's start sequence writes them, once each):
    imports         the process's start until its code runs (the interpreter, the spawn, the imports)
    runtime_import  the engine runtime's library (torch on a GPU: seconds of its own)
    device_init     the device's context (CUDA)
    ready           the process's start until the worker takes requests (a mark, not a length)
    warm            the process's start until every engine runs at full speed: a GPU engine takes
                    requests once its weights are on the device and captures its CUDA graphs behind
                    live traffic (a mark; absent until then)
Each engine's own phases (load, capture, warmup) are its model runtime's (ModelRuntime.phases).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

MARKS = ("ready", "warm")


def _process_age() -> float | None:
    """Seconds since this process started (Linux: /proc/self/stat, in clock ticks since boot)."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: starttime
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - started)
    except (OSError, ValueError, IndexError, AttributeError):
        return None


class StartupProfile:
    def __init__(self) -> None:
        now = time.monotonic()
        age = _process_age()
        self.started = now - (age if age is not None else 0.0)  # the process's start, on the monotonic clock
        self.phases: dict[str, float] = {"imports": round(now - self.started, 3)}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        started = time.monotonic()
        try:
            yield
        finally:
            self.phases[name] = round(time.monotonic() - started, 3)

    def mark(self, name: str, at: float | None = None) -> float:
        """Records `name` at `at` (monotonic; now by default) as seconds since the process started."""
        self.phases[name] = seconds = round((time.monotonic() if at is None else at) - self.started, 3)
        return seconds

    def summary(self) -> str:
        return ", ".join(f"{name} {seconds:.2f} s" for name, seconds in self.phases.items() if name not in MARKS)
