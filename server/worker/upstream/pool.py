"""A model's upstream servers: which one computes a text, retries, and a circuit breaker per server.

A text goes to the first of the servers ranked by rendezvous hashing of its cache key (highest hash(key,
url) first; with upstream.routing round_robin, the servers in turn) whose breaker is closed: a key keeps its
server while the set of healthy servers holds it (what that server caches for it stays useful), and a
failing server's keys spread over the others, coming back when it recovers. A call that fails for a reason
worth retrying (Failure.retryable) is tried again, on the next server of its ranking, after a jittered
backoff, within the model's upstream.timeout_s; a server whose calls fail breaker_failures times in a row is
skipped for breaker_open_s, then tried by one call. When every server's breaker is open, calls fail at once.

Embedding calls run on the worker's event loop (`embed`), generations in their own threads (`generate`):
both take their tries from one `_Tries`, and the breakers' state is under one lock."""

from __future__ import annotations

import asyncio
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

    async def embed(self, rows: list[TextRow]) -> list[np.ndarray | InferCacheError]:
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
                vectors = await self._texts(ranked, [str(rows[n]) for n in members], tenant)
            except InvalidArgument as exc:
                vectors = [exc] if len(members) == 1 else [await self._one(ranked, str(rows[n]), tenant)
                                                            for n in members]
            except InferCacheError as exc:
                vectors = [exc] * len(members)
            for n, vector in zip(members, vectors):
                out[n] = vector
        return out

    async def _one(self, ranked: list[Server], text: str, tenant: str) -> np.ndarray | InferCacheError:
        try:
            return (await self._texts(ranked, [text], tenant))[0]
        except InferCacheError as exc:
            return exc

    async def _texts(self, ranked: list[Server], texts: list[str], tenant: str) -> list[np.ndarray]:
        tries = _Tries(self, ranked, len(texts))
        while (pause := tries.pause()) is not None:
            if pause:
                await asyncio.sleep(pause)
            if (chosen := tries.next()) is None:
                break
            server, remaining = chosen
            try:
                vectors = await server.client.embed(texts, tenant, remaining)
            except asyncio.CancelledError:
                tries.left(server)
                raise
            except Exception as exc:  # noqa: BLE001 (a Failure, or an answer a client could not read)
                tries.failed(server, exc)
            else:
                tries.succeeded(server)
                return vectors
        raise tries.error()

    def generate(self, route: bytes, request: dict, tenant: str, on_piece) -> tuple[str, dict]:
        """One generation (server/worker/upstream/generative.py), in the caller's thread: its pieces of text
        to on_piece as the upstream streams them; (finish reason, usage) once it ended. `route` ranks the
        servers (what a conversation starts with: its next turns reach the server whose prefix cache holds
        it). A call that failed before its first piece is tried again as an embedding call is; one cut off
        after it is not (its callers have that text already)."""
        tries = _Tries(self, self._ranked(route), 1)
        while (pause := tries.pause()) is not None:
            if pause:
                time.sleep(pause)
            if (chosen := tries.next()) is None:
                break
            server, remaining = chosen
            try:
                answer = server.client.generate(request, tenant, on_piece, remaining)
            except Abandoned:
                tries.succeeded(server)  # (it was answering)
                raise
            except Exception as exc:  # noqa: BLE001 (a Failure, or an answer a client could not read)
                tries.failed(server, exc)
            else:
                tries.succeeded(server)
                return answer
        raise tries.error()

    def _reopens_in(self) -> float:
        with self._lock:
            return max(0.0, min(s.open_until for s in self.servers) - time.monotonic())

    def close(self) -> None:
        for server in self.servers:
            server.client.close()


class _Tries:
    """One call's tries, as the module says: the pause before each, its server and the seconds left, and
    each try's end (every try ends in succeeded, failed or left: a breaker's trial is never left open)."""

    def __init__(self, pool: UpstreamPool, ranked: list[Server], units: int) -> None:
        self.pool = pool
        self.ranked = ranked
        self.units = units  # texts (or generations) a try computes, for the counters
        self.deadline = time.monotonic() + pool.spec.timeout_s
        self.tried: set[Server] = set()
        self.last: tuple[Server, Failure] | None = None
        self.count = 0
        self.started = 0.0

    def pause(self) -> float | None:
        """Seconds to wait before the next try (0 before the first); None: no try is left."""
        spec = self.pool.spec
        if self.count > spec.retries or (self.last is not None and not self.last[1].retryable):
            return None
        if not self.count:
            return 0.0
        pause = random.uniform(0, spec.retry_backoff_ms / 1000 * (1 << (self.count - 1)))
        return None if time.monotonic() + pause >= self.deadline else pause

    def next(self) -> tuple[Server, float] | None:
        """The next try's server and its seconds left; None: none left in time. UpstreamFailed when every
        server is out of rotation before any try."""
        pool, remaining = self.pool, self.deadline - time.monotonic()
        if remaining <= 0:
            return None
        server = pool._choose(self.ranked, self.tried) or (pool._choose(self.ranked, set()) if self.last else None)
        if server is None:
            if self.last is not None:
                return None
            raise UpstreamFailed(f"{pool.name}: every upstream ({', '.join(s.url for s in pool.servers)}) is out "
                                 f"of rotation after failing (tried again in {pool._reopens_in():.1f} s)")
        self.tried.add(server)
        if self.count:
            with pool._lock:
                pool.counters["retries"] += 1
        self.count += 1
        self.started = time.monotonic()
        return server, remaining

    def succeeded(self, server: Server) -> None:
        self.pool._succeeded(server, time.monotonic() - self.started, self.units)

    def failed(self, server: Server, exc: Exception) -> None:
        failure = exc if isinstance(exc, Failure) else Failure(
            "malformed", f"an answer that could not be read ({type(exc).__name__})")
        self.last = (server, failure)
        self.pool._failed(server, failure)

    def left(self, server: Server) -> None:
        """The try was cancelled (its worker stops): neither the server's success nor its failure."""
        with self.pool._lock:
            server.trial = False

    def error(self) -> Exception:
        if self.last is None:
            return UpstreamFailed(f"{self.pool.name}: no upstream answered within upstream.timeout_s "
                                  f"({self.pool.spec.timeout_s} s)")
        server, failure = self.last
        return failure.domain(server.url)
