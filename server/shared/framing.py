"""Length-prefixed protobuf frames over a unix stream socket: the frontend <-> worker item path.

Why not a gRPC stream: measured on an H200 host, a grpc.aio bidirectional stream costs the worker's
event loop tens of microseconds per message read or written, and with one text per call there is about
one item per message, so the worker spent most of its time on the transport. A bare asyncio protocol
(uvloop) parses every complete frame of each read in one callback and writes with one syscall per loop
iteration. Frames: 4-byte little-endian length, then a serialized ComputeBatch (to the worker) or
ResultBatch (to the frontend), both from protos/infercache/v1/worker.proto.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Callable

log = logging.getLogger("infercache.framing")

HEADER = 4
MAX_FRAME = 256 * 1024 * 1024


def items_socket(grpc_socket: Path) -> Path:
    """The item socket beside a worker's gRPC socket (worker-0.sock -> worker-0.items)."""
    return grpc_socket.with_suffix(".items")


class FrameTooLarge(ValueError):
    pass


def complete_frames(buffer: bytearray):
    """Yields each complete frame at the start of `buffer` and removes what it yielded (also when the
    caller stops early); FrameTooLarge for a length over MAX_FRAME."""
    start = 0
    try:
        while len(buffer) - start >= HEADER:
            size = int.from_bytes(buffer[start:start + HEADER], "little")
            if size > MAX_FRAME:
                raise FrameTooLarge(f"frame of {size} bytes is over the limit")
            end = start + HEADER + size
            if len(buffer) < end:
                break
            frame = bytes(buffer[start + HEADER:end])
            start = end
            yield frame
    finally:
        if start:
            del buffer[:start]


class FrameProtocol(asyncio.Protocol):
    """Calls on_frame(bytes) for each complete frame and on_lost(exc) once the connection ends. `queue`
    appends to an outgoing message that is written once per event-loop iteration."""

    def __init__(self, on_frame: Callable[[bytes], None], on_lost: Callable[[Exception | None], None],
                 new_message: Callable[[], object], on_flush: Callable[[object], None] | None = None) -> None:
        self.on_frame = on_frame
        self.on_lost = on_lost
        self.new_message = new_message
        self.on_flush = on_flush  # sees each message before it is written (counters)
        self.transport: asyncio.Transport | None = None
        self.out = new_message()
        self._buffer = bytearray()
        self._flush_scheduled = False
        self._flush_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        try:
            for frame in complete_frames(self._buffer):
                try:
                    self.on_frame(frame)
                except Exception:  # a frame that does not parse: whose items were in it is unknown
                    log.exception("failed to handle a frame; closing the connection (the peer resends)")
                    self.transport.close()
                    return
        except FrameTooLarge as exc:
            log.error("%s; closing the connection", exc)
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.on_lost(exc)

    def flush_soon(self) -> None:
        """Writes `out` at the end of this loop iteration (everything queued meanwhile goes with it)."""
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def flush_later(self, delay_s: float) -> None:
        """Writes `out` within `delay_s` (with the next flush_soon, if one comes first): for items nobody
        waits on, so that many go in one write instead of one write per loop iteration."""
        if not self._flush_scheduled and self._flush_timer is None:
            self._flush_timer = asyncio.get_running_loop().call_later(delay_s, self._flush)

    def flush_now(self) -> None:
        """Writes what `out` holds at once (a later flush_soon of this iteration sends only what follows)."""
        self._flush()

    def _flush(self) -> None:
        self._flush_scheduled = False
        self._cancel_timer()
        out, self.out = self.out, self.new_message()
        if self.transport is None or self.transport.is_closing() or not out.ListFields():
            return
        if self.on_flush is not None:
            self.on_flush(out)
        payload = out.SerializeToString()
        self.transport.write(len(payload).to_bytes(HEADER, "little") + payload)

    def close(self) -> None:
        self._cancel_timer()
        if self.transport is not None:
            self.transport.close()

    def _cancel_timer(self) -> None:
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None
