"""A model's upstream servers: which one computes a text, retries, and a circuit breaker per server.

A text goes to the first of the servers ranked by rendezvous hashing of its cache key (highest hash(key,
url) first; with upstream.routing round_robin, the servers in turn) whose breaker is closed: a key keeps its
server while the set of healthy servers holds it (what that server caches for it stays useful), and a
failing server's keys spread over the others, coming back when it recovers. A call that fails for a reason
worth retrying (Failure.retryable) is tried again, on the next server of its ranking, after a jittered
backoff, within the model's upstream.timeout_s; a server whose calls fail breaker_failures times in a row is
skipped for breaker_open_s, then tried by one call. When every server's breaker is open, calls fail at once.

Called from the batcher's threads: the breakers' state is under one lock."""

from __future__ import annotations

import hashlib
import itertools
import logging
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from server.shared.errors import InferCacheError, InvalidArgument, UpstreamFailed
from server.shared.telemetry import Recorder
from server.shared.upstream_spec import UpstreamSpec
from server.worker.upstream.errors import Abandoned, Failure

if TYPE_CHECKING:
    from server.worker.upstream.clients import Client

log = logging.getLogger("infercache.upstream")


@dataclass(eq=False)
class Server:
    client: Client
    failures: int = 0           # failed calls in a row (those that count against it)
    open_until: float = 0.0     # time.monotonic() until which its breaker is open (0: closed)
    trial: bool = False         # a call is trying it after its breaker opened
    seed: bytes = field(default=b"")

    @property
    def url(self) -> str:
        return self.client.url


class TextRow(str):
    """A text to compute, with what routes it (its cache key) and whom it is for (its tenant)."""

    key: bytes = b""
    tenant: str = ""

    @classmethod
    def of(cls, text: str, key: bytes, tenant: str) -> "TextRow":
        row = cls(text)
        row.key, row.tenant = key, tenant
        return row


class UpstreamPool:
    def __init__(self, model: str, version: str, spec: UpstreamSpec, clients: list[Client]) -> None:
        self.model = model
        self.name = f"{model}-{version}"
        self.spec = spec
        self.servers = [Server(c, seed=hashlib.blake2b(c.url.encode(), digest_size=8).digest()) for c in clients]
        self.counters: Counter[str] = Counter()  # GetStats' figures; written under the lock
        self._figures = Recorder()               # /metrics' (figures()); written under the lock
        self._lock = threading.Lock()
        self._turns = itertools.count()  # upstream.routing round_robin (next() is atomic under the GIL)

    def figures(self) -> Recorder:
        """A copy of the calls' /metrics figures."""
        with self._lock:
            return Recorder().plus(self._figures)

    def in_rotation(self) -> dict[str, bool]:
        with self._lock:
            return {server.url: not server.open_until for server in self.servers}

    def _ranked(self, key: bytes) -> list[Server]:
        if len(self.servers) == 1:
            return self.servers
        if self.spec.routing == "round_robin":
            first = next(self._turns) % len(self.servers)
            return self.servers[first:] + self.servers[:first]
        return sorted(self.servers, key=lambda s: hashlib.blake2b(key, digest_size=8, key=s.seed).digest(),
                      reverse=True)

    def _usable(self, server: Server, now: float) -> bool:
        """Closed, or open past its time with no call trying it yet (this call becomes the trial)."""
        if not server.open_until:
            return True
        if now >= server.open_until and not server.trial:
            server.trial = True
            return True
        return False

    def _choose(self, ranked: list[Server], tried: set[Server]) -> Server | None:
        now = time.monotonic()
        with self._lock:
            for server in ranked:
                if server not in tried and self._usable(server, now):
                    return server
        return None

    def _succeeded(self, server: Server, seconds: float, texts: int) -> None:
        with self._lock:
            if server.open_until:
                log.warning("%s: upstream %s answers again", self.name, server.url)
            server.failures, server.open_until, server.trial = 0, 0.0, False
            self._figures.inc(("infercache_upstream_calls_total", self.model, server.url, "ok"))
            self._figures.observe(("infercache_upstream_call_seconds", self.model, server.url), seconds)
            self.counters["calls"] += 1
            self.counters["texts"] += texts
            self.counters["call_us"] += int(seconds * 1e6)

    def _failed(self, server: Server, failure: Failure) -> None:
        outcome = failure.kind if failure.kind != "status" else str(failure.status)
        with self._lock:
            self._figures.inc(("infercache_upstream_calls_total", self.model, server.url, outcome))
            self.counters["calls"] += 1
            self.counters[f"errors_{outcome}"] += 1
            if not failure.counts_against:
                server.trial = False
                return
            server.failures += 1
            if server.trial or server.failures >= self.spec.breaker_failures:
                if not server.open_until or server.trial:
                    log.warning("%s: upstream %s taken out of rotation for %.1f s after %d failed call(s): %s",
                                self.name, server.url, self.spec.breaker_open_s, server.failures, failure)
                    self.counters["breaker_opened"] += 1
                server.open_until = time.monotonic() + self.spec.breaker_open_s
            server.trial = False

    def embed(self, rows: list[TextRow]) -> list[np.ndarray | InferCacheError]:
        """A vector, or the error its caller gets, for each row: rows go to their key's first usable
        server, each server's share in one call (per tenant), tried again as the module says. An input
        the upstream refuses fails its own row alone: a refused call of several texts is sent again one
        text a call."""
        groups: dict[tuple[Server, str], tuple[list[Server], list[int]]] = {}  # the first row's ranking, the rows
        for n, row in enumerate(rows):
            ranked = self._ranked(row.key)
            groups.setdefault((ranked[0], row.tenant), (ranked, []))[1].append(n)
        out: list[np.ndarray | InferCacheError | None] = [None] * len(rows)
        for (_, tenant), (ranked, members) in groups.items():
            try:
                vectors = self._texts(ranked, [str(rows[n]) for n in members], tenant)
            except InvalidArgument as exc:
                vectors = [exc] if len(members) == 1 else [self._one(ranked, str(rows[n]), tenant) for n in members]
            except InferCacheError as exc:
                vectors = [exc] * len(members)
            for n, vector in zip(members, vectors):
                out[n] = vector
        return out

    def _one(self, ranked: list[Server], text: str, tenant: str) -> np.ndarray | InferCacheError:
        try:
            return self._texts(ranked, [text], tenant)[0]
        except InferCacheError as exc:
            return exc

    def _texts(self, ranked: list[Server], texts: list[str], tenant: str) -> list[np.ndarray]:
        return self._call(ranked, lambda client, timeout_s: client.embed(texts, tenant, timeout_s), len(texts))

    def generate(self, route: bytes, request: dict, tenant: str, on_piece) -> tuple[str, dict]:
        """One generation (server/worker/upstream/generative.py): its pieces of text to on_piece as the
        upstream streams them; (finish reason, usage) once it ended. `route` ranks the servers (what a
        conversation starts with: its next turns reach the server whose prefix cache holds it). A call
        that failed before its first piece is tried again as an embedding call is; one cut off after it
        is not (its callers have that text already)."""
        return self._call(self._ranked(route), lambda client, timeout_s: client.generate(request, tenant, on_piece,
                                                                                         timeout_s), 1)

    def _call(self, ranked: list[Server], work, units: int):
        """work(client, seconds left) on the first usable server of `ranked`, tried again as the module
        says; units: texts (or generations) it computes, for the counters."""
        spec = self.spec
        deadline = time.monotonic() + spec.timeout_s
        tried: set[Server] = set()
        last: tuple[Server, Failure] | None = None
        for attempt in range(spec.retries + 1):
            if attempt:
                pause = random.uniform(0, spec.retry_backoff_ms / 1000 * (1 << (attempt - 1)))
                if time.monotonic() + pause >= deadline:
                    break
                time.sleep(pause)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            server = self._choose(ranked, tried) or (self._choose(ranked, set()) if last is not None else None)
            if server is None:
                if last is not None:
                    break
                raise UpstreamFailed(f"{self.name}: every upstream ({', '.join(s.url for s in self.servers)}) is out "
                                     f"of rotation after failing (tried again in {self._reopens_in():.1f} s)")
            tried.add(server)
            if attempt:
                with self._lock:
                    self.counters["retries"] += 1
            started = time.monotonic()
            try:  # (whatever happens, the call ends in _succeeded or _failed: a trial is never left open)
                answer = work(server.client, remaining)
            except Abandoned:
                self._succeeded(server, time.monotonic() - started, units)  # (it was answering)
                raise
            except Failure as failure:
                last = (server, failure)
            except Exception as exc:  # noqa: BLE001 (an answer a client could not read: malformed, never a crash)
                last = (server, Failure("malformed", f"an answer that could not be read ({type(exc).__name__})"))
            else:
                self._succeeded(server, time.monotonic() - started, units)
                return answer
            self._failed(server, last[1])
            if not last[1].retryable:
                break
        if last is None:
            raise UpstreamFailed(f"{self.name}: no upstream answered within upstream.timeout_s ({spec.timeout_s} s)")
        server, failure = last
        raise failure.domain(server.url)

    def _reopens_in(self) -> float:
        with self._lock:
            return max(0.0, min(s.open_until for s in self.servers) - time.monotonic())

    def close(self) -> None:
        for server in self.servers:
            server.client.close()
