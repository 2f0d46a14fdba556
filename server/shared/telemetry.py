"""Prometheus figures: what each process records, and the snapshot file it publishes them in.

Each frontend and worker records into its own `Recorder`, on its event loop only (one writer). A task
(`Publisher`) writes a JSON snapshot to `<metrics dir>/<role>-<index>.json` every PUBLISH_S,
atomically (a temporary file renamed over the old one); the supervisor's /metrics endpoint
(server/metrics_http.py) reads and adds them up on each scrape. A process that restarts starts from its
predecessor's counters (`Recorder.adopt`), so a counter summed over the server never goes down while
the server runs. Recording is a dict increment or two; publishing, one small write per second.

JSON, not pickle: the files are read by another process.
"""

from __future__ import annotations

import asyncio
import bisect
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Awaitable, Callable

log = logging.getLogger("infercache.telemetry")

PUBLISH_S = 1.0
MEANS_SEP = "\t"  # "model<TAB>version": keys of the per-bucket times workers publish (JSON keys are strings)
LATENCY_BOUNDS = (.0005, .001, .002, .005, .01, .02, .05, .1, .2, .5, 1.0, 2.0, 5.0, 10.0)
BATCH_BOUNDS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
SIMILARITY_BOUNDS = (.5, .6, .7, .75, .8, .85, .9, .95, .98, .99, 1.0)

# name -> (type, help, label names, histogram bounds). Every series the server exposes is named here.
SCHEMA: dict[str, tuple[str, str, tuple[str, ...], tuple[float, ...]]] = {
    "infercache_requests_total": (
        "counter", "Texts of Infer and InferBatch calls, by the tier that answered (none: the call failed) "
        "and the call's status code.", ("model", "source", "code"), ()),
    "infercache_request_duration_seconds": (
        "histogram", "Infer and InferBatch call latency in the frontend, by the call's costliest source.",
        ("model", "source"), LATENCY_BOUNDS),
    "infercache_generate_ttft_seconds": (
        "histogram", "Generate calls' time to the first text, by where the answer came from.",
        ("model", "source"), LATENCY_BOUNDS),
    "infercache_generate_duration_seconds": (
        "histogram", "Generate calls' time to the whole answer, by where it came from.", ("model", "source"),
        LATENCY_BOUNDS),
    "infercache_generate_inter_token_seconds": (
        "histogram", "Time between a streamed answer's tokens as its caller got them (misses and streams "
        "joined in flight; deltas that arrive together count each token at their gap over their tokens).",
        ("model",), LATENCY_BOUNDS),
    "infercache_generate_prefill_seconds": (
        "histogram", "A generation's time from taking its place in the running batch to its first token, by "
        "the slowest tier its reused prompt prefix came from (none: nothing reused).", ("model", "tier"),
        LATENCY_BOUNDS),
    "infercache_prefix_tokens_total": (
        "counter", "Prompt tokens of generations looked up in the prefix cache (tier queried) and those reused, "
        "by the tier their blocks came from (memory: the decoder's own; host; disk).", ("model", "tier"), ()),
    "infercache_prefix_bytes": (
        "gauge", "Bytes of prefix blocks a worker holds in memory (the decoder's: device memory on a GPU) and "
        "in pinned host memory (the disk tier's are the kv store's).", ("model", "tier", "worker"), ()),
    "infercache_prefix_moves_total": (
        "counter", "Prefix blocks moved between tiers: kept (computed into memory), demoted to host or disk, "
        "evicted from memory or host, read back from disk.", ("model", "move"), ()),
    "infercache_generated_tokens_total": (
        "counter", "Tokens of the answers Generate calls got, by where they came from (all but miss: tokens "
        "the model did not generate again).", ("model", "source"), ()),
    "infercache_misses_total": (
        "counter", "Texts the model computed for their request, by why no cache tier answered.",
        ("model", "reason"), ()),
    "infercache_compute_seconds_saved_total": (
        "counter", "Model time that hits saved: each hit counts its model's recent mean compute time per "
        "text for the input's sequence-length bucket.", ("model",), ()),
    "infercache_compute_seconds_total": (
        "counter", "Engine time spent running batches.", ("model",), ()),
    "infercache_batch_size": (
        "histogram", "Texts per engine launch.", ("model",), BATCH_BOUNDS),
    "infercache_queue_depth": ("gauge", "Texts waiting in the model's batch queue.", ("model",), ()),
    "infercache_store_entries": ("gauge", "Entries in the store.", ("store",), ()),
    "infercache_store_class_entries": (
        "gauge", "Entries in the store by the TTL class they were stored for (entries stored before the store "
        "counted classes are left out).", ("store", "ttl_class"), ()),
    "infercache_store_bytes": ("gauge", "Bytes of live pages in the store.", ("store",), ()),
    "infercache_store_budget_bytes": ("gauge", "The store's byte budget (eviction starts above it).",
                                      ("store",), ()),
    "infercache_store_evictions_total": ("counter", "Entries evicted to stay under the budget.", ("store",), ()),
    "infercache_store_swept_total": ("counter", "Expired entries removed by sweeps.", ("store",), ()),
    "infercache_store_writes_dropped_total": (
        "counter", "Writes dropped because the store's writer was too far behind (their texts are computed "
        "again on their next miss).", ("store",), ()),
    "infercache_store_write_backlog": (
        "gauge", "Writes the workers sent to their store writers and not yet committed.", ("store",), ()),
    "infercache_store_replaced_total": (
        "counter", "Damaged stores set aside and replaced by a fresh, empty one: at start (a truncated or "
        "garbage data file) or while serving (LMDB reported corrupted pages to a read or a write).", ("store",), ()),
    "infercache_store_writer_restarts_total": (
        "counter", "Store writer processes that died (kill -9, the OOM killer, a crash) and were started again "
        "by their worker, which handed the new one every write not yet committed.", ("store",), ()),
    "infercache_semantic_index_entries": ("gauge", "Entries in the semantic indexes of the workers.", (), ()),
    "infercache_semantic_nearest_similarity": (
        "histogram", "Cosine similarity of the nearest neighbour found by each semantic search.", ("model",),
        SIMILARITY_BOUNDS),
    "infercache_semantic_verifications_total": (
        "counter", "Semantic hits recomputed by shadow verification, by whether the model agreed.",
        ("model", "outcome"), ()),
    "infercache_semantic_fidelity": (
        "gauge", "Live fidelity of the semantic hits served (shadow verification, weighted by each check's "
        "chance); absent before the first check.", ("model", "version", "worker"), ()),
    "infercache_semantic_threshold": (
        "gauge", "The calibrated rule's margin threshold in force for hits decided without a fit (absent while outcomes support none).",
        ("model", "version", "worker"), ()),
    "infercache_semantic_reach": (
        "gauge", "The calibrated rule's residual reach in force (the farthest from the neighbours' hull a hit may lie; "
        "2: any), for hits decided without the fit (fit=false) and those the fit agreed with (fit=true).",
        ("model", "version", "worker", "fit"), ()),
    "infercache_engines_built_total": (
        "counter", "Engines built when the server started (not found in the engine store): a cold start.",
        ("model", "runtime", "device"), ()),
    "infercache_engine_build_seconds": (
        "gauge", "Seconds this server spent building the engine at start (0: loaded from the engine store).",
        ("model", "version", "runtime", "device", "worker"), ()),
    "infercache_engine_warmup_seconds": (
        "gauge", "Seconds of each phase of the engine's start: load (weights to the device, a first batch), "
        "warmup (timed batches), capture (CUDA graphs, behind traffic; once done).",
        ("model", "version", "runtime", "device", "worker", "phase"), ()),
    "infercache_worker_start_seconds": (
        "gauge", "Where a worker's start went: imports, runtime_import (torch), device_init (CUDA) in seconds; "
        "ready and warm (every engine at full speed) in seconds since the process started.",
        ("worker", "phase"), ()),
    "infercache_upstream_calls_total": (
        "counter", "Calls to an upstream model's servers (runtime: upstream), by server and outcome: ok, or "
        "why it failed (connect, timeout, malformed, or the HTTP status it answered).",
        ("model", "upstream", "outcome"), ()),
    "infercache_upstream_call_seconds": (
        "histogram", "Duration of an upstream model's calls that its servers answered, by server.",
        ("model", "upstream"), LATENCY_BOUNDS),
    "infercache_upstream_tokens_saved_total": (
        "counter", "Tokens an upstream generative model was not asked for, because a cache tier answered (or "
        "the call joined one in flight): input (the prompt, as the upstream counted it) and output.",
        ("model", "kind"), ()),
    "infercache_upstream_cost_saved_total": (
        "counter", "What those tokens would have cost at the model's upstream.input_cost_per_mtok and "
        "output_cost_per_mtok (in their unit of money).", ("model",), ()),
    "infercache_upstream_in_rotation": (
        "gauge", "1 while an upstream server takes calls, 0 while its circuit breaker has it out of rotation.",
        ("model", "upstream", "worker"), ()),
    "infercache_process_restarts_total": ("counter", "Child processes the supervisor restarted.", ("role",), ()),
    "infercache_processes": ("gauge", "Live child processes.", ("role",), ()),
}


class Recorder:
    """One process's counters and histograms. Keys are (metric name, *label values)."""

    def __init__(self) -> None:
        self.counters: dict[tuple, float] = {}
        self.histograms: dict[tuple, list[float]] = {}  # per-bound counts (the last is +Inf), then the sum

    def inc(self, key: tuple, amount: float = 1) -> None:
        self.counters[key] = self.counters.get(key, 0) + amount

    def observe(self, key: tuple, value: float, count: int = 1) -> None:
        found = self.histograms.get(key)
        if found is None:
            found = self.histograms[key] = [0] * (len(SCHEMA[key[0]][3]) + 2)
        found[bisect.bisect_left(SCHEMA[key[0]][3], value)] += count
        found[-1] += value * count

    def adopt(self, snapshot: dict) -> None:
        """A predecessor's counters and histograms (its published snapshot) as this one's start."""
        for name, labels, value in snapshot.get("counters", ()):
            if SCHEMA.get(name, ("",))[0] == "counter":
                self.inc((name, *labels), value)
        for name, labels, values in snapshot.get("histograms", ()):
            spec = SCHEMA.get(name)
            if spec is not None and len(values) == len(spec[3]) + 2:
                self._add_histogram((name, *labels), values)

    def add(self, other: Recorder) -> None:
        """The other's counters and histograms added to this one's."""
        for key, value in other.counters.items():
            self.inc(key, value)
        for key, values in other.histograms.items():
            self._add_histogram(key, values)

    def _add_histogram(self, key: tuple, values: list[float]) -> None:
        found = self.histograms.setdefault(key, [0] * len(values))
        for n, value in enumerate(values):
            found[n] += value

    def plus(self, *others: Recorder) -> Recorder:
        """A new recorder holding this one's figures and the others' (a predecessor's, or figures derived
        at publish time from the counters their owners keep, such as a batcher's batch sizes)."""
        out = Recorder()
        for source in (self, *others):
            out.add(source)
        return out

    def snapshot(self, gauges: list[tuple[tuple, float]] = (), **extra) -> dict:
        """A copy, safe to serialize on another thread."""
        return {
            "pid": os.getpid(),
            "counters": [[key[0], list(key[1:]), value] for key, value in self.counters.items()],
            "histograms": [[key[0], list(key[1:]), list(values)] for key, values in self.histograms.items()],
            "gauges": [[key[0], list(key[1:]), value] for key, value in gauges],
            **extra,
        }


def snapshot_path(directory: Path, role: str, index: int) -> Path:
    return directory / f"{role}-{index}.json"


def read_snapshot(path: Path) -> dict | None:
    """A published snapshot, or None when it is missing or unreadable (a process killed mid-write
    leaves only its temporary file: the rename is atomic)."""
    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def predecessor(path: Path) -> Recorder:
    """The counters a restarted process continues: what its predecessor last published, if anything."""
    recorder = Recorder()
    found = read_snapshot(path)
    if found is not None:
        recorder.adopt(found)
    return recorder


def write_snapshot(path: Path, snapshot: dict) -> None:
    """Atomically: a temporary file of its own (a write still running from a cancelled publish cannot
    meet this one's), renamed over the old snapshot."""
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w") as out:
            out.write(json.dumps(snapshot, separators=(",", ":")))
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


class Publisher:
    """Writes `snapshot()` (taken on the event loop) to `path` every PUBLISH_S, off the loop, after
    `refresh()` (awaited first, each time: a frontend reads the workers' figures then, a worker its
    store sizes). `close()` publishes once more and stops. Any failure is logged once and retried next
    time: figures are never worth a request, nor a crash."""

    def __init__(self, path: Path, snapshot: Callable[[], dict],
                 refresh: Callable[[], Awaitable[None]] | None = None) -> None:
        self.path = path
        self.snapshot = snapshot
        self.refresh = refresh
        self._warned = False
        self._stop = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._stop.wait(), PUBLISH_S)
            except TimeoutError:
                pass
            await self._once()
            if self._stop.is_set():
                return

    async def _once(self) -> None:
        try:
            if self.refresh is not None:
                await self.refresh()
            await asyncio.to_thread(write_snapshot, self.path, self.snapshot())
            self._warned = False
        except Exception as exc:
            if not self._warned:
                log.warning("metrics snapshot %s not published (retrying every %.0f s): %r", self.path, PUBLISH_S, exc)
                self._warned = True

    async def close(self) -> None:
        self._stop.set()
        await self._task
