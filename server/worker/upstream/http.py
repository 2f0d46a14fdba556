"""HTTP/1.1 JSON calls to one upstream server, from the batcher's threads: a kept-alive connection per
thread, opened again when the server closed it. Blocking by design: it runs off the event loop, in the
threads that run an engine's batches for a local model.

The request is written as bytes made once per call (its fixed head made once per endpoint) and the
answer read with httptools (llhttp, the parser the HTTP door uses): a miss's call costs the upstream's
time and little more, where http.client's header parsing (the email package) cost more than a fast
upstream's answer."""

from __future__ import annotations

import json
import socket
import ssl
import threading
from collections.abc import Iterator
from urllib.parse import urlsplit

import httptools
import orjson

from server.worker.upstream.errors import Failure

MAX_ANSWER_BYTES = 64 << 20  # an answer's body, at most (as the gRPC kinds' message limit)
MAX_EVENT_BYTES = 1 << 20  # one line of a streamed answer, at most
READ_BYTES = 1 << 16


class _Gone(Exception):
    """The connection ended before any byte of the answer: a kept-alive one the server closed meanwhile."""


class _Exchange:
    """One response read from a connection, fed until its head, then until more body or its end; it is
    httptools' protocol object (the parser calls its on_* methods)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.parser = httptools.HttpResponseParser(self)
        self.read = 0
        self.head = False
        self.complete = False
        self.body = bytearray()
        self.framed = False      # its length is said (content-length, chunked): not its connection's end
        self.keep_alive = False  # (as its head says: llhttp forgets it once the message is complete)

    def feed(self) -> None:
        """One read from the socket into the parser; _Gone where it ended before the answer began,
        ConnectionResetError where it ended inside it."""
        data = self.sock.recv(READ_BYTES)
        if not data:
            if not self.read:
                raise _Gone()
            if self.head and not self.framed:
                self.complete = True  # (an answer whose length is its connection's end)
            if not self.complete:
                raise ConnectionResetError("the connection ended inside the answer")
            return
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
        exchange = self._send(path, body, timeout_s, b"application/json")
        try:
            while not exchange.complete:
                exchange.feed()
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

    def events(self, path: str, body: dict, timeout_s: float) -> Iterator[dict]:
        """The JSON objects of a server-sent event stream (OpenAI's `stream: true`), as they come, up to its
        `data: [DONE]`; each awaited for at most timeout_s. Failure otherwise: one raised after the first
        event has kind "cut" (never retried: the caller has those events)."""
        started = False

        def broken(message: str) -> Failure:  # (after the first event the caller has some of the answer)
            return Failure("cut" if started else "malformed", message)

        try:
            exchange = self._send(path, body, timeout_s, b"text/event-stream")
            if exchange.status >= 400:
                while not exchange.complete and len(exchange.body) <= MAX_ANSWER_BYTES:
                    exchange.feed()
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
                    exchange.feed()
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

    def _send(self, path: str, body: dict, timeout_s: float, accept: bytes) -> _Exchange:
        """The upstream's response to a POST of `body`, its head read; Failure otherwise."""
        if self._broken:
            raise Failure("connect", "a header of this upstream (its credential?) holds a line break")
        payload = orjson.dumps(body)
        request = b"POST %s HTTP/1.1\r\n%saccept: %s\r\ncontent-length: %d\r\n\r\n%s" % (
            (self.prefix + path).encode(), self._head, accept, len(payload), payload)
        for attempt in (0, 1):  # a kept-alive connection the server closed meanwhile: once more, on a new one
            try:
                sock, reused = self._connection(timeout_s)
            except OSError as exc:
                raise _lost(exc, timeout_s) from None
            try:
                sock.settimeout(timeout_s)
                sock.sendall(request)
                exchange = _Exchange(sock)
                while not exchange.head:
                    exchange.feed()
                    if exchange.read > MAX_EVENT_BYTES and not exchange.head:
                        raise Failure("malformed", "answered a head over 1 MiB")
                return exchange
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
