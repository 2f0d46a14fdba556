"""What a writer process was sent and has not confirmed (server/worker/store/writer.py): the frames written
to it, each kept until the process has handled all of it (its puts, by number, and its requests), and the
frames made while no process runs. A process started after one died is handed both, less what the dead
one confirmed. On the worker's loop only."""

from __future__ import annotations

from collections import deque

from infercache.v1 import writer_pb2
from server.shared.framing import FrameProtocol


class Unconfirmed:
    def __init__(self) -> None:
        self.framed = 0  # the last put number written in a frame
        self._written: deque[tuple[int, writer_pb2.StoreOps]] = deque()  # (its last put number, frame)
        self._held: list[writer_pb2.StoreOps] = []

    def frame(self, protocol: FrameProtocol | None, put: bool) -> writer_pb2.StoreOps:
        """The frame the next operation goes into: the protocol's, or while a process starts (protocol
        None), the last held one. A frame applies its puts before its requests, so a put that follows a
        request starts a new frame."""
        if protocol is None:
            if not self._held or (put and self._held[-1].requests):
                self._held.append(writer_pb2.StoreOps())
            return self._held[-1]
        if put and protocol.out.requests:
            protocol.flush_now()
        return protocol.out

    def written(self, frame: writer_pb2.StoreOps) -> None:
        self.framed += len(frame.puts)
        self._written.append((self.framed, frame))

    def confirmed(self, handled: int, requests: dict) -> None:
        """The frames the process has handled all of let go: every put up to `handled`, and no request
        still waiting (in `requests`, by id)."""
        written = self._written
        while written and written[0][0] <= handled and not any(r.id in requests for r in written[0][1].requests):
            written.popleft()

    def replay(self, handled: int, requests: dict) -> list[writer_pb2.StoreOps]:
        """What a new process is handed, in order: the frames written less the puts up to `handled` and
        the requests answered, then the held ones. Nothing is kept here after it."""
        frames = []
        for last, frame in self._written:
            first = last - len(frame.puts) + 1
            left = writer_pb2.StoreOps()
            left.puts.extend(frame.puts[max(0, handled - first + 1):])
            left.requests.extend(r for r in frame.requests if r.id in requests)
            if left.ListFields():
                frames.append(left)
        frames += self._held
        self.clear()
        self.framed = handled
        return frames

    def clear(self) -> None:
        self._written.clear()
        self._held = []
