"""Reaching Redis within a time budget, and not at all while it is failing.

Every call has a budget (a few milliseconds on the request path): a slow Redis costs a miss, not a slow
answer. The budget measures Redis, not this process: when it runs out, the loop first gets a few turns to
read what already arrived (after a stall of this process's own loop, timers fire before sockets are read,
and a reply that came in time would count as late). A call that is late after all is left to finish in
the background, so its connection is not torn down mid-reply. Consecutive failures open a circuit
breaker: while it is open the tier is skipped without a call, and a background probe (with a generous
budget, off the request path) closes it once Redis answers again. MOVED, ASK and a cluster's failover are the cluster client's business
(redis-py's RedisCluster refreshes its slot map); a call that fails meanwhile is one more failure here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from urllib.parse import urlsplit

log = logging.getLogger("infercache.fleet")

LATE_LOOK_TURNS = 2  # loop turns a late call gets to deliver a reply that already arrived
SOCKET_TIMEOUT_S = 2.0  # a connection that stops answering is dropped (ends a late call in the background)
PROBE_BUDGET_S = 2.0  # room for a cluster client to re-read the slot map after a failover
CONNECT_TIMEOUT_S = 0.5


class FleetUnavailable(Exception):
    """Redis did not answer within the budget, failed, or the breaker is open: treat as a miss."""


def seed_nodes(url: str) -> list[tuple[str, int]]:
    """host:port pairs of a redis-cluster:// URL (or the one node of a redis:// URL)."""
    netloc = url.split("://", 1)[1].split("/", 1)[0]
    nodes = []
    for part in netloc.split(","):
        host, _, port = part.rpartition(":")
        nodes.append((host.strip("[]") or "127.0.0.1", int(port or 6379)))
    return nodes


def is_cluster(url: str) -> bool:
    return url.startswith("redis-cluster://")


def connect(url: str):
    """A redis.asyncio client for `fleet.redis` (values as bytes)."""
    options = dict(socket_connect_timeout=CONNECT_TIMEOUT_S, socket_timeout=SOCKET_TIMEOUT_S, socket_keepalive=True)
    if is_cluster(url):
        from redis.asyncio.cluster import ClusterNode, RedisCluster

        return RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in seed_nodes(url)], **options)
    import redis.asyncio as redis

    return redis.Redis.from_url(url, **options)


@contextlib.asynccontextmanager
async def subscribed(url: str, channel: str, attempt: int, budget_s: float):
    """A pub/sub connection subscribed to `channel` (subscriber's client), closed quietly on the way out."""
    client = subscriber(url, attempt)
    pubsub = client.pubsub()
    try:
        async with asyncio.timeout(budget_s):
            await pubsub.subscribe(channel)
        yield pubsub
    finally:
        for closing in (pubsub, client):
            try:
                await closing.aclose()
            except Exception:
                pass


def subscriber(url: str, attempt: int):
    """A plain client for the broadcast channel: in a cluster every node relays every PUBLISH, so any
    seed node will do; `attempt` rotates through them when one is down. No retries: a lost connection
    must be noticed (messages published meanwhile are lost, and the tier catches up from the hash)."""
    import redis.asyncio as redis
    from redis.backoff import NoBackoff
    from redis.asyncio.retry import Retry

    options = dict(socket_connect_timeout=CONNECT_TIMEOUT_S, socket_keepalive=True, retry=Retry(NoBackoff(), 0))
    if not is_cluster(url):
        return redis.Redis.from_url(url, **options)
    nodes = seed_nodes(url)
    host, port = nodes[attempt % len(nodes)]
    return redis.Redis(host=host, port=port, **options)


def describe(url: str) -> str:
    """The URL without a password, for logs."""
    parts = urlsplit(url)
    return url.replace(parts.password, "***") if parts.password else url


def _settled(task: asyncio.Task) -> None:
    """A late call's end, whatever it is (nobody waits for it any more)."""
    if not task.cancelled():
        task.exception()


class Link:
    """The tier's Redis client, its per-call budget and its breaker. Used on one event loop only."""

    def __init__(self, url: str, *, timeout_s: float, failures: int, open_s: float, counters: Counter,
                 probe_key: str) -> None:
        """probe_key: what the probe reads. A keyed read, not PING: a cluster client sends PING to every
        node it knows, and one dead node would keep the breaker open for good."""
        self.url = url
        self.probe_key = probe_key
        self.redis = connect(url)
        self.timeout_s = timeout_s
        self.failures_to_open = failures
        self.open_s = open_s
        self.counters = counters
        self.open = False
        self._failures = 0
        self._probe: asyncio.Task | None = None

    async def call(self, command, *args, budget: float | None = None, force: bool = False, **kwargs):
        """`await command(*args, **kwargs)` within the budget; FleetUnavailable when it fails, or when the
        breaker is open (unless `force`: an administrator's invalidation is tried whatever the breaker says)."""
        if self.open and not force:
            self.counters["skipped_breaker_open"] += 1
            raise FleetUnavailable("breaker open")
        task = asyncio.ensure_future(command(*args, **kwargs))
        await asyncio.wait((task,), timeout=budget or self.timeout_s)
        for _ in range(LATE_LOOK_TURNS):
            if task.done():
                break
            await asyncio.sleep(0)
        if not task.done():
            task.add_done_callback(_settled)
            self.failed("timeouts", "no answer within the budget")
            raise FleetUnavailable("timeout")
        if (exc := task.exception()) is not None:  # redis.RedisError, OSError, a cluster in failover
            self.failed("errors", repr(exc))
            raise FleetUnavailable(repr(exc))
        self.succeeded()
        return task.result()

    def succeeded(self) -> None:
        self._failures = 0

    def failed(self, counter: str, why: str) -> None:
        """One more failure (counted under `counter`); opens the breaker after enough in a row."""
        self.counters[counter] += 1
        self._failures += 1
        if self._failures >= self.failures_to_open and not self.open:
            self.open = True
            self.counters["breaker_opened"] += 1
            log.warning("fleet tier %s failing (%s); skipped, probing every %.1f s", describe(self.url), why,
                        self.open_s)
            self._probe = asyncio.get_running_loop().create_task(self._probe_until_back())

    async def _probe_until_back(self) -> None:
        while True:
            await asyncio.sleep(self.open_s)
            try:
                async with asyncio.timeout(PROBE_BUDGET_S):
                    await self.redis.exists(self.probe_key)
            except Exception:
                continue
            self.open, self._failures = False, 0
            self.counters["breaker_closed"] += 1
            log.info("fleet tier %s answers again", describe(self.url))
            return

    async def close(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
        try:
            await self.redis.aclose()
        except Exception:
            pass
