"""The store writer process's own side (server/worker/store/writer.py is the worker's): it opens the store
read-write, reads the worker's StoreOps frames from its socket, has a WriteBehind without a thread of its
own commit them, and answers with StoreEvents. One thread does all of it, so nothing inside contends."""

from __future__ import annotations

import select
import signal
import socket
import time
from collections import Counter

import numpy as np

from cachestore import integrity, records
from cachestore.env import Store, StoreSettings
from cachestore.errors import StoreDamaged, StoreError
from cachestore.keys import NS_ID_BYTES, Selector, namespace
from cachestore.semantic_log import Row, SemanticEntry
from cachestore.writer import WriteBehind
from infercache.v1 import writer_pb2
from server.shared import process
from server.shared.framing import HEADER, complete_frames

COUNTERS_EVERY_S = 1.0   # the process sends its counters at least this often while they change
ROWS_PER_FRAME = 10_000  # semantic rows per StoreEvents frame (a 384-float row is about 1.6 KB)
# Bytes each side of the worker's socket buffers (server/worker/store/writer.py sets them), and the most one
# read takes. With the kernel's default (about 200 KB, an eighth of a frame of 256 MiniLM puts) the two
# processes took turns: the writer waited in select for the worker's loop to refill the socket, and on
# a 2-core host committed 15,800 puts/s where it commits 28,000 with 4 MiB (bench/write_path.py's
# puts, no flushes). The kernel caps it at net.core.wmem_max / rmem_max (4 MiB where it was measured).
SOCKET_BUFFER = 4 << 20


class _Channel:
    """The process's side of the socket (one thread: it reads, has the writer commit, and answers)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buffer = bytearray()
        self.counters: Counter[str] = Counter()  # the writer's (set once it exists)
        self._told: dict[str, int] = {}

    def send(self, events: writer_pb2.StoreEvents, with_counters: bool = True) -> None:
        if with_counters:
            counters = dict(self.counters)
            if counters != self._told:
                events.counters.update(counters)
                self._told = counters
        if events.ByteSize() == 0:
            return
        payload = events.SerializeToString()
        try:
            self.sock.sendall(len(payload).to_bytes(HEADER, "little") + payload)
        except OSError:  # the worker is gone: what was received still gets committed
            pass

    def semantic(self, added: list[Row], removed: list[tuple[bytes, int]]) -> None:
        """A commit's semantic rows, in frames of at most ROWS_PER_FRAME (a large invalidation removes
        many: one frame must stay under MAX_FRAME)."""
        for start in range(0, max(len(added), len(removed)), ROWS_PER_FRAME):
            events = writer_pb2.StoreEvents()
            for row in added[start:start + ROWS_PER_FRAME]:  # (the worker kept each put's vector)
                events.added.add(ns_id=row.ns_id, label=row.label, key=row.key, answer=row.answer)
            for ns_id, label in removed[start:start + ROWS_PER_FRAME]:
                events.removed.add(ns_id=ns_id, label=label)
            self.send(events, with_counters=False)

    def receive(self, timeout: float) -> list[bytes] | None:
        """The complete frames that arrived (waiting up to `timeout` for some; [] if none did); None once
        the worker has closed its side (or died)."""
        if not select.select([self.sock], [], [], timeout)[0]:
            return []
        try:
            data = self.sock.recv(SOCKET_BUFFER)
        except OSError:
            return None
        if not data:
            return None
        self._buffer += data
        return list(complete_frames(self._buffer))


def _selector(wanted: writer_pb2.StoreSelector) -> Selector:
    return Selector(*(getattr(wanted, f) if wanted.HasField(f) else None for f in ("tenant", "model", "version", "key")))


# Group commit (`cache.group_commit_ms`, passed as group_commit_s): puts wait up to that long for others
# to share their transaction. A commit under random keys writes about a page per put and fsyncs: with one
# put per commit, as at a few thousand misses/s, the writer spent 169-185 us of CPU per miss (2-core
# machine, null engine), 54-61 us with a 10 ms wait. At a CPU host's few hundred misses/s a 10 ms wait
# still left a handful of puts per commit; 50 ms cuts the writer's CPU per put there (bench/group_commit.py:
# 240 vs 140 us at 500 puts/s in frames of 8; frames of 32, one per 64 ms, gain nothing). Invalidations and
# flushes commit at once. The worker answers a computed key from memory until its put is handled
# (COALESCED), so an exact repeat is not recomputed meanwhile; a near-duplicate may be (semantic index rows
# come from commits: a text's row is searchable up to the window plus a commit later).


def main(settings: StoreSettings, batch_max: int, sweep_interval_s: float, max_ttl_s: int, group_commit_s: float,
          sock: socket.socket, log_level: str, role: str, first_put: int = 0,
          fences: list[tuple[Selector, int]] = (), what: str = "store") -> None:
    """`first_put`: the number of the put before the first this process is sent (puts are numbered on
    across the processes a worker starts); `fences`: the recent invalidations a process before it made;
    `what`: the store, for the log."""
    # It stops when its worker closes the socket (or dies), never on a signal meant for its group.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    process.setup_logging(log_level, role)
    channel = _Channel(sock)
    replaced = ""
    try:
        try:
            store = Store(settings, readonly=False)
        except StoreDamaged as exc:  # (what a write would meet later: set aside now, as it would be then)
            replaced = f"at open: {exc.__cause__ or exc}"
            integrity.set_aside(settings.path, replaced, what)
            store = Store(settings, readonly=False)
    except (StoreError, OSError) as exc:
        channel.send(writer_pb2.StoreEvents(failed=str(exc)))
        return
    writer = WriteBehind(store, batch_max=batch_max, sweep_interval_s=sweep_interval_s, max_ttl_s=max_ttl_s,
                         on_semantic=channel.semantic, threaded=False, fences=fences, what=what,
                         on_replaced=lambda why: channel.send(writer_pb2.StoreEvents(replaced=why), with_counters=False))
    channel.counters = writer.counters
    channel.send(writer_pb2.StoreEvents(ready=True))
    if replaced:  # (a worker that had a read handle on the damaged store opens the fresh one)
        writer.counters["replaced"] += 1
        channel.send(writer_pb2.StoreEvents(replaced=replaced), with_counters=False)
    handled = first_put  # puts received (numbered as the worker numbers them), all handled after each drain
    requests: list = []
    held_since: float | None = None  # when the oldest put not committed yet arrived
    while True:
        wait = min(COUNTERS_EVERY_S, sweep_interval_s) if held_since is None \
            else max(0.0, held_since + group_commit_s - time.monotonic())
        writer.sync_to_disk()  # the commits due to be flushed
        if (flush_in := writer.flush_due_in()) is not None:
            wait = min(wait, flush_in)
        if (frames := channel.receive(wait)) is None:
            break
        for frame in frames:
            ops = writer_pb2.StoreOps.FromString(frame)
            for put in ops.puts:
                entry = None
                if put.semantic:
                    entry = SemanticEntry(put.key[:NS_ID_BYTES], put.answer, np.frombuffer(put.embedding, dtype="<f4"))
                writer.put(put.key, namespace(put.tenant, put.model, put.version),
                           records.Record(put.created_us, put.expires_us, put.payload), semantic=entry,
                           ttl_class=put.ttl_class)
            handled += len(ops.puts)
            for request in ops.requests:
                if request.HasField("invalidate"):
                    requests.append((request.id, writer.invalidate(_selector(request.invalidate))))
                else:
                    requests.append((request.id, writer.check(request.check) if request.check else writer.flush()))
        if frames and held_since is None:
            held_since = time.monotonic()
        if held_since is not None and not requests and writer.queued() < batch_max \
                and time.monotonic() - held_since < group_commit_s:
            continue  # more puts may come for the same transaction
        writer.drain()  # commits what arrived (and sweeps when due): every future above is done now
        events = writer_pb2.StoreEvents(handled=handled) if held_since is not None else writer_pb2.StoreEvents()
        held_since = None
        for request_id, future in requests:
            done = events.done.add(id=request_id)
            if (exc := future.exception()) is not None:
                done.error = f"{type(exc).__name__}: {exc}"
            else:
                done.removed = int(future.result() or 0)  # (a check's: whether it replaced the store)
        requests.clear()
        channel.send(events)
    writer.close()  # commits what it still holds: everything received is committed
    channel.send(writer_pb2.StoreEvents(handled=handled))  # (a worker that closed its side is gone: dropped)
    writer.store.close()  # (the one it opened, or a fresh one that replaced it)
