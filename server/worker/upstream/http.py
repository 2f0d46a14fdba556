"""HTTP/1.1 JSON calls to one upstream server, opened again when the server closed a kept-alive one:
- on the worker's event loop (`post_async`, embedding calls): a connection of the loop's own per call in
  flight, kept alive between calls; a miss's call then costs no thread hand-offs;
- blocking, from a generation's thread (`post`, `events`): a kept-alive connection per thread.

The request is written as bytes made once per call (its fixed head made once per endpoint) and the
answer read with httptools (llhttp, the parser the HTTP door uses): a miss's call costs the upstream's
time and little more, where http.client's header parsing (the email package) cost more than a fast
upstream's answer."""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
import threading
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit

import httptools
import orjson

from server.worker.upstream.errors import Failure

MAX_ANSWER_BYTES = 64 << 20  # an answer's body, at most (as the gRPC kinds' message limit)
MAX_EVENT_BYTES = 1 << 20  # one line of a streamed answer, at most
READ_BYTES = 1 << 16
READ_ON_LOOP_BYTES = 128 << 10  # larger answers are decoded off the event loop (post_async)


class _Gone(Exception):
    """The connection ended before any byte of the answer: a kept-alive one the server closed meanwhile."""


def _as_is(answer: dict) -> dict:
    return answer


class _Exchange:
    """One response read from a connection, fed until its head, then until more body or its end; it is
    httptools' protocol object (the parser calls its on_* methods)."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.read = 0
        self.head = False
        self.complete = False
        self.body = bytearray()
        self.framed = False      # its length is said (content-length, chunked): not its connection's end
        self.keep_alive = False  # (as its head says: llhttp forgets it once the message is complete)

    def feed(self, sock: socket.socket) -> None:
        """One read from `sock` into the parser."""
        data = sock.recv(READ_BYTES)
        if data:
            self.take(data)
        else:
            self.ended()

    def ended(self) -> None:
        """The connection ended: _Gone where before the answer began, ConnectionResetError where inside it."""
        if not self.read:
            raise _Gone()
        if self.head and not self.framed:
            self.complete = True  # (an answer whose length is its connection's end)
        if not self.complete:
            raise ConnectionResetError("the connection ended inside the answer")

    def take(self, data: bytes) -> None:
        self.read += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            raise Failure("malformed", f"answered what is not HTTP/1.1 ({type(exc).__name__})") from None

    @property
    def status(self) -> int:
        return self.parser.get_status_code()

    @property
    def keeps_alive(self) -> bool:
        return self.framed and self.keep_alive

    # httptools' callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() in (b"content-length", b"transfer-encoding"):
            self.framed = True

    def on_headers_complete(self) -> None:
        self.head = True
        self.keep_alive = self.parser.should_keep_alive()

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        self.complete = True


class _Connection(asyncio.Protocol):
    """A connection of the event loop's to the upstream: one exchange at a time, its answer to `waiter`."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.exchange: _Exchange | None = None  # (made by each call, with its waiter)
        self.waiter: asyncio.Future | None = None
        self.lost = False

    def call(self, request: bytes) -> asyncio.Future:
        """Writes a request; the future ends once its answer is whole (or with why not)."""
        self.exchange = _Exchange()
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        return self.waiter

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.waiter is None or self.waiter.done():
            self.transport.close()  # (bytes nobody asked for: the connection is not reused)
            return
        try:
            self.exchange.take(data)
            if len(self.exchange.body) > MAX_ANSWER_BYTES:
                raise Failure("malformed", f"answered over {MAX_ANSWER_BYTES} bytes")
        except Failure as failure:
            self.waiter.set_exception(failure)
            self.transport.close()
            return
        if self.exchange.complete:
            self.waiter.set_result(self.exchange)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self.waiter is not None and not self.waiter.done():
            try:
                self.exchange.ended()
                self.waiter.set_result(self.exchange)
            except (_Gone, ConnectionResetError) as ended:
                self.waiter.set_exception(ended)


class JsonEndpoint:
    """POSTs JSON to paths under one base URL (its path included: "http://host:8000/v1")."""

    def __init__(self, base_url: str, headers: dict[str, str], timeout_s: float) -> None:
        parts = urlsplit(base_url)
        self.url = base_url
        self.secure = parts.scheme == "https"
        self.host, self.port = parts.hostname, parts.port or (443 if self.secure else 80)
        self.prefix = parts.path.rstrip("/")
        self.timeout_s = timeout_s
        self._local = threading.local()
        self._tls = ssl.create_default_context() if self.secure else None
        host = self.host if parts.port is None else f"{self.host}:{self.port}"
        fields = {"host": host, "content-type": "application/json", "user-agent": "infercache", **headers}
        # A line break in a header (a credential file's) would end the head early: every call fails
        # instead, saying so without quoting it.
        self._broken = any(c in f"{name}{value}" for name, value in fields.items() for c in "\r\n\0")
        self._head = "".join(f"{name}: {value}\r\n" for name, value in fields.items()).encode("latin-1", "replace")
        self._idle: list[_Connection] = []  # the event loop's kept-alive connections between calls

    def _connection(self, timeout_s: float) -> tuple[socket.socket, bool]:
        """This thread's connection, and whether it was open already."""
        sock = getattr(self._local, "sock", None)
        if sock is not None:
            return sock, True
        sock = socket.create_connection((self.host, self.port), timeout=timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self._tls is not None:
            try:
                sock = self._tls.wrap_socket(sock, server_hostname=self.host)
            except BaseException:
                sock.close()
                raise
        self._local.sock = sock
        return sock, False

    def _drop(self) -> None:
        sock = getattr(self._local, "sock", None)
        if sock is not None:
            self._local.sock = None
            try:
                sock.close()
            except OSError:
                pass

    def post(self, path: str, body: dict, timeout_s: float) -> dict:
        """The JSON object the upstream answered; Failure (with its kind) otherwise."""
        sock, exchange = self._send(path, body, timeout_s, b"application/json")
        try:
            while not exchange.complete:
                exchange.feed(sock)
                if len(exchange.body) > MAX_ANSWER_BYTES:
                    raise Failure("malformed", f"answered over {MAX_ANSWER_BYTES} bytes")
        except (OSError, _Gone) as exc:
            self._drop()
            raise _lost(exc, timeout_s) from None
        except Failure:
            self._drop()
            raise
        if not exchange.keeps_alive:
            self._drop()
        return _decoded(exchange.status, bytes(exchange.body))

    async def post_async(self, path: str, body: dict, timeout_s: float, read: Callable[[dict], Any] = _as_is) -> Any:
        """post() on the event loop, the answer given to read(): the same answers and Failures. An answer
        over READ_ON_LOOP_BYTES is decoded and read in the loop's executor (JSON numbers of a large batch
        would hold the loop for milliseconds)."""
        request = self._request(path, body, b"application/json")
        try:
            async with asyncio.timeout(timeout_s):
                for attempt in (0, 1):  # a kept-alive connection the server closed meanwhile: once more, on a new one
                    connection, reused = await self._loop_connection()
                    try:
                        exchange = await connection.call(request)
                    except (_Gone, ConnectionResetError) as exc:
                        connection.transport.close()
                        if attempt == 0 and reused:
                            continue
                        raise _lost(exc, timeout_s) from None
                    except BaseException:  # (a Failure, the timeout, a cancel: its answer is not read to its end)
                        connection.transport.close()
                        raise
                    if exchange.keeps_alive and not connection.lost:
                        self._idle.append(connection)
                    else:
                        connection.transport.close()
                    status, data = exchange.status, bytes(exchange.body)
                    if len(data) <= READ_ON_LOOP_BYTES:
                        return read(_decoded(status, data))
                    return await asyncio.get_running_loop().run_in_executor(None, lambda: read(_decoded(status, data)))
        except OSError as exc:  # (TimeoutError included)
            raise _lost(exc, timeout_s) from None
        raise Failure("connect", "connection lost")  # (not reached: the loop returns or raises)

    async def _loop_connection(self) -> tuple[_Connection, bool]:
        """An idle kept-alive connection of the loop's, or a new one; and whether it was idle."""
        while self._idle:
            connection = self._idle.pop()
            if not connection.lost:
                return connection, True
        _, connection = await asyncio.get_running_loop().create_connection(
            _Connection, self.host, self.port, ssl=self._tls, server_hostname=self.host if self._tls else None)
        return connection, False

    def close(self) -> None:
        """Closes the loop's idle connections (a thread's close with their threads)."""
        while self._idle:
            self._idle.pop().transport.close()

    def events(self, path: str, body: dict, timeout_s: float) -> Iterator[dict]:
        """The JSON objects of a server-sent event stream (OpenAI's `stream: true`), as they come, up to its
        `data: [DONE]`; each awaited for at most timeout_s. Failure otherwise: one raised after the first
        event has kind "cut" (never retried: the caller has those events)."""
        started = False

        def broken(message: str) -> Failure:  # (after the first event the caller has some of the answer)
            return Failure("cut" if started else "malformed", message)

        try:
            sock, exchange = self._send(path, body, timeout_s, b"text/event-stream")
            if exchange.status >= 400:
                while not exchange.complete and len(exchange.body) <= MAX_ANSWER_BYTES:
                    exchange.feed(sock)
                raise Failure.of_status(exchange.status, _message(bytes(exchange.body[:MAX_ANSWER_BYTES])))
            pending = exchange.body  # (bytes of the stream not yet split into lines)
            while True:
                end = pending.find(b"\n")
                if end < 0:
                    if len(pending) > MAX_EVENT_BYTES:
                        raise broken(f"an event over {MAX_EVENT_BYTES} bytes")
                    if exchange.complete:
                        raise (Failure("cut", "the stream ended before its [DONE]") if started else
                               Failure("malformed", "answered no event (data:) before the end of its answer"))
                    exchange.feed(sock)
                    continue
                line = bytes(pending[:end])
                del pending[:end + 1]
                if len(line) > MAX_EVENT_BYTES:
                    raise broken(f"an event over {MAX_EVENT_BYTES} bytes")
                if not line.startswith(b"data:"):
                    continue  # blank lines between events, comments, event names
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                try:
                    event = json.loads(data)
                except ValueError:
                    raise broken("an event that is not JSON") from None
                if not isinstance(event, dict):
                    raise broken("an event that is not a JSON object")
                started = True
                yield event
        except (OSError, _Gone) as exc:
            failure = _lost(exc, timeout_s)
            raise (Failure("cut", f"the stream broke off: {failure}") if started else failure) from None
        finally:  # (read to its [DONE] or not, failed or left early: the next call opens a fresh connection)
            self._drop()

    def _request(self, path: str, body: dict, accept: bytes) -> bytes:
        if self._broken:
            raise Failure("connect", "a header of this upstream (its credential?) holds a line break")
        payload = orjson.dumps(body)
        return b"POST %s HTTP/1.1\r\n%saccept: %s\r\ncontent-length: %d\r\n\r\n%s" % (
            (self.prefix + path).encode(), self._head, accept, len(payload), payload)

    def _send(self, path: str, body: dict, timeout_s: float, accept: bytes) -> tuple[socket.socket, _Exchange]:
        """The connection and the upstream's response to a POST of `body`, its head read; Failure otherwise."""
        request = self._request(path, body, accept)
        for attempt in (0, 1):  # a kept-alive connection the server closed meanwhile: once more, on a new one
            try:
                sock, reused = self._connection(timeout_s)
            except OSError as exc:
                raise _lost(exc, timeout_s) from None
            try:
                sock.settimeout(timeout_s)
                sock.sendall(request)
                exchange = _Exchange()
                while not exchange.head:
                    exchange.feed(sock)
                    if exchange.read > MAX_EVENT_BYTES and not exchange.head:
                        raise Failure("malformed", "answered a head over 1 MiB")
                return sock, exchange
            except (_Gone, BrokenPipeError, ConnectionResetError) as exc:
                self._drop()
                if attempt == 0 and reused:
                    continue
                raise _lost(exc, timeout_s) from None
            except OSError as exc:
                self._drop()
                raise _lost(exc, timeout_s) from None
            except Failure:
                self._drop()
                raise
        raise Failure("connect", "connection lost")  # (not reached: the loop returns or raises)


def _lost(exc: Exception, timeout_s: float) -> Failure:
    """A call's transport failure as a Failure of kind timeout or connect (never quoting a header)."""
    if isinstance(exc, TimeoutError):
        return Failure("timeout", f"no answer within {timeout_s:.1f} s")
    if isinstance(exc, _Gone):
        return Failure("connect", "connection lost: the server closed it without answering")
    if isinstance(exc, (BrokenPipeError, ConnectionResetError)):
        return Failure("connect", f"connection lost: {type(exc).__name__}")
    if isinstance(exc, OSError) and exc.strerror:
        return Failure("connect", f"cannot reach it: {exc.strerror}")
    return Failure("connect", f"cannot reach it: {type(exc).__name__}")


def _decoded(status: int, data: bytes) -> dict:
    if status >= 400:
        raise Failure.of_status(status, _message(data))
    try:
        found = orjson.loads(data)
    except orjson.JSONDecodeError:
        raise Failure("malformed", f"answered {len(data)} bytes that are not JSON") from None
    if not isinstance(found, dict):
        raise Failure("malformed", "answered JSON that is not an object")
    return found


def _message(data: bytes) -> str:
    """The upstream's own reason (OpenAI's error.message, or the body's start), cut short."""
    try:
        found = json.loads(data)
        error = found.get("error") if isinstance(found, dict) else None
        message = error.get("message") if isinstance(error, dict) else (error if isinstance(error, str) else None)
        if isinstance(message, str):
            return message[:300]
    except ValueError:
        pass
    return data[:300].decode("utf-8", "replace")
