"""A frontend's figures out and the other processes' in, through the files of server/shared/telemetry.py:
its /metrics snapshot (frontend-N.json, summed by the supervisor) and its hot keys (frontend-N.hot, read
by the frontend that answers GetHotKeys)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from server.frontend.core import FrontendCore
from server.shared import telemetry


class Published:
    """This frontend's figures out, the other processes' in, through the files of server/shared/telemetry.py:
    its /metrics snapshot (frontend-N.json, summed by the supervisor) and its hot keys (frontend-N.hot,
    read by the frontend that answers GetHotKeys; apart, so that no scrape parses them, and rewritten
    only when they changed)."""

    def __init__(self, core: FrontendCore, directory: Path, index: int) -> None:
        self.core = core
        self.directory = directory
        self.path = telemetry.snapshot_path(directory, "frontend", index)
        self.hot_path = self.path.with_suffix(".hot")
        self.base = telemetry.predecessor(self.path)  # a restarted frontend continues its counters
        self._hot_written = -1                        # core.hot.changes when last written
        if core.hot is not None:                        # and its hot keys
            core.hot.adopt(telemetry.read_snapshot(self.hot_path) or {})

    def snapshot(self) -> dict:
        core = self.core
        recorded = self.base.plus(core.metrics.recorder) if core.metrics is not None else telemetry.Recorder()
        return recorded.snapshot()

    def _others(self, pattern: str) -> list[dict]:
        found = [telemetry.read_snapshot(path) for path in sorted(self.directory.glob(pattern))
                 if path not in (self.path, self.hot_path)]
        return [snapshot for snapshot in found if snapshot is not None]

    def hot_keys(self) -> list[dict]:
        """The other frontends' published hot keys (in a thread: file reads)."""
        return self._others("frontend-*.hot")

    async def refresh(self) -> None:
        """Before each publish: hits into model time saved at the workers' latest times (their mean per
        bucket where several serve the model), and the hot keys out if they changed."""
        if self.core.metrics is not None:
            seen: dict[tuple[str, str], dict[int, list[float]]] = {}
            for snapshot in await asyncio.to_thread(self._others, "worker-*.json"):
                for name, times in (snapshot.get("means") or {}).items():
                    model, _, version = name.partition(telemetry.MEANS_SEP)
                    for bucket, seconds in times.items():
                        seen.setdefault((model, version), {}).setdefault(int(bucket), []).append(float(seconds))
            self.core.metrics.settle({key: {bucket: sum(values) / len(values) for bucket, values in times.items()}
                                      for key, times in seen.items()})
        hot = self.core.hot
        if hot is not None and hot.changes != self._hot_written:
            self._hot_written = hot.changes
            await asyncio.to_thread(telemetry.write_snapshot, self.hot_path, hot.published())
