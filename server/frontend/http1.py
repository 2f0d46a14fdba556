"""HTTP/1.1 on the frontend's event loop: the transport of the OpenAI-compatible door
(server/frontend/openai_api.py). Requests are parsed by httptools (llhttp, the parser uvicorn uses);
connections are kept alive, and take one request at a time (pipelined ones wait their turn); a body is
read up to a limit; an answer is written whole, in one write, or streamed in chunks (server-sent events).
A request is read under bounds that need no token (Limits): its head's bytes, its target's, its body's, a
deadline from its first byte to its last, and the connections one client address holds open. No routing
or JSON here: a handler takes a Request and returns a Response or a Stream. Why this stack:
docs/architecture.md#the-doors."""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
from collections import deque
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import AsyncIterator, Awaitable, Callable

import httptools

log = logging.getLogger("infercache.http")

KEEP_ALIVE_S = 75.0        # an idle connection is closed after this (clients' pools expire theirs sooner)
MAX_HEADER_BYTES = 64 << 10  # a request's headers, at most (more: 431)
MAX_URL_BYTES = 8 << 10    # a request's target (path and query), at most (more: 414)
MAX_HEAD_BYTES = MAX_HEADER_BYTES + MAX_URL_BYTES + 1024  # bytes of a request line and headers held before
                           # its headers end, whatever their shape (the parser buffers a header until it ends)
LINGER_S = 1.0            # a refused request's connection stays open this long, its input discarded, so
                           # that a client still sending its body reads the refusal instead of a reset
MAX_PIPELINED = 32         # complete requests waiting on one connection; past it, reading pauses
_REASONS = {status.value: status.phrase.encode() for status in HTTPStatus}


@dataclass(slots=True)
class Request:
    method: bytes
    path: bytes                      # without the query string
    headers: dict[bytes, bytes]      # names lower-cased; a repeated header keeps its last value
                                     # (those of Limits.single_headers are refused)
    body: bytes = b""


@dataclass(slots=True)
class Response:
    status: int
    body: bytes
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    content_type: bytes = b"application/json"


@dataclass(slots=True)
class Stream:
    """An answer sent as it is made: `chunks` (each written as one HTTP chunk) after the head."""

    chunks: AsyncIterator[bytes]
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    content_type: bytes = b"text/event-stream"
    status: int = 200


Handler = Callable[[Request], Awaitable[Response | Stream]]


@dataclass(frozen=True, slots=True)
class Limits:
    """What one client may hold of a frontend before its request is whole (no token is checked before)."""

    max_body: int                       # a request body's bytes, at most (more: 413)
    header_timeout_s: float = 10.0      # from a request's first byte to its headers' end (past it: 408)
    request_timeout_s: float = 30.0     # from a request's first byte to its body's end (past it: 408)
    max_client_connections: int = 1024  # connections one client address holds open at once; 0 = no bound
    single_headers: frozenset[bytes] = frozenset()  # names a request may carry once (twice: 400)


def head(status: int, content_type: bytes, headers: list[tuple[bytes, bytes]], length: int | None,
         keep_alive: bool) -> bytes:
    """A response's status line and headers; `length` None: chunked."""
    out = [b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\n" % (status, _REASONS.get(status, b""), content_type)]
    out.append(b"content-length: %d\r\n" % length if length is not None else b"transfer-encoding: chunked\r\n")
    for name, value in headers:
        out.append(b"%s: %s\r\n" % (name, value))
    if not keep_alive:
        out.append(b"connection: close\r\n")
    out.append(b"\r\n")
    return b"".join(out)


class _Connection(asyncio.Protocol):
    """One client connection: parses requests, runs the handler for one at a time, writes its answer."""

    def __init__(self, server: "HttpServer") -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.pending: deque[tuple[Request, bool]] = deque()  # complete requests waiting their turn
        self.task: asyncio.Task | None = None                # the request being answered
        self.request: Request | None = None                  # the request being read
        self.header_bytes = 0
        self.head_bytes = 0                                  # bytes received while a request's head is read
        self.in_body = False                                 # the request being read has its headers
        self.body: list[bytes] = []
        self.body_bytes = 0
        self.url: list[bytes] = []
        self.url_bytes = 0
        self.closing = False
        self.client: str | None = None                       # the peer's address (counted in server.clients)
        self.idle: asyncio.TimerHandle | None = None
        self.deadline: asyncio.TimerHandle | None = None     # the request being read must be whole by then
        self.began = 0.0                                     # the loop's time at its first byte
        self.writable: asyncio.Future | None = None          # set while the transport asks us to pause

    # --- asyncio.Protocol -----------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport
        self.server.connections.add(self)
        peer = transport.get_extra_info("peername")
        client = str(peer[0]) if isinstance(peer, tuple) and peer else None
        bound = self.server.limits.max_client_connections
        if client is not None and bound:
            held = self.server.clients.get(client, 0)
            if held >= bound:
                self._refuse(503, b"this client holds %d connections already; reuse them" % held)
                return
            self.server.clients[client] = held + 1
            self.client = client
        self._idle_timer()

    def connection_lost(self, exc) -> None:
        self.server.connections.discard(self)
        if self.client is not None:
            clients = self.server.clients
            if clients[self.client] <= 1:
                del clients[self.client]
            else:
                clients[self.client] -= 1
            self.client = None
        self.closing = True
        if self.task is not None:
            self.task.cancel()  # the client went away: its work is dropped (a generation is cancelled)
        if self.idle is not None:
            self.idle.cancel()
        if self.deadline is not None:
            self.deadline.cancel()
        if self.writable is not None and not self.writable.done():
            self.writable.set_exception(ConnectionResetError("client disconnected"))

    def pause_writing(self) -> None:
        if self.writable is None or self.writable.done():
            self.writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self.writable is not None and not self.writable.done():
            self.writable.set_result(None)

    def data_received(self, data: bytes) -> None:
        if self.closing:
            return  # a refused request's rest, discarded
        if self.idle is not None:
            self.idle.cancel()
            self.idle = None
        if not self.in_body:  # (a chunk that ends one request's body and begins the next one's head is
            self.head_bytes += len(data)  # not counted: the head held stays within a chunk of the bound)
            if self.deadline is None:  # a head's first byte, blank lines before a request line included
                self._begin_head()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._refuse(400, b"protocol upgrades are not served here")
        except httptools.HttpParserError as exc:
            if not self.closing:
                self._refuse(400, f"malformed HTTP request: {exc}".encode())
        else:
            if not self.in_body and self.head_bytes > MAX_HEAD_BYTES:
                self._refuse(431, b"request line and headers over %d bytes" % MAX_HEAD_BYTES)

    # --- httptools callbacks ----------------------------------------------------------------------
    def on_message_begin(self) -> None:
        self.request = Request(b"", b"", {})
        self.url, self.url_bytes, self.header_bytes, self.body, self.body_bytes = [], 0, 0, [], 0
        if self.deadline is None:  # (pipelined: its bytes came with the request before it)
            self._begin_head()

    def on_url(self, url: bytes) -> None:
        self.url_bytes += len(url)
        if self.url_bytes > MAX_URL_BYTES:
            self._refuse(414, b"request target over %d bytes" % MAX_URL_BYTES)
            return
        self.url.append(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self.header_bytes += len(name) + len(value)
        if self.header_bytes > MAX_HEADER_BYTES:
            self._refuse(431, b"request headers over %d bytes" % MAX_HEADER_BYTES)
            return
        name = name.lower()
        if name in self.request.headers and name in self.server.limits.single_headers:
            self._refuse(400, b"header %s sent more than once" % name)
            return
        self.request.headers[name] = value

    def on_headers_complete(self) -> None:
        self.in_body, self.head_bytes = True, 0
        if self.closing:
            return
        request = self.request
        limits = self.server.limits
        request.method = self.parser.get_method()
        request.path = b"".join(self.url).split(b"?", 1)[0]
        self._deadline(limits.request_timeout_s, b"request body")
        length = request.headers.get(b"content-length")
        if length is not None and length.isdigit() and (len(length) > 18 or int(length) > limits.max_body):
            self._refuse(413, b"request body is %s bytes; at most %d" % (length[:20], limits.max_body))
        elif request.headers.get(b"expect", b"").lower() == b"100-continue":
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        self.body_bytes += len(body)
        if self.body_bytes > self.server.limits.max_body:
            self._refuse(413, b"request body over %d bytes" % self.server.limits.max_body)
            return
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.in_body = False
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None
        if self.closing:
            return
        request, self.request = self.request, None
        request.body = self.body[0] if len(self.body) == 1 else b"".join(self.body)
        keep_alive = self.parser.should_keep_alive()
        if self.task is None:
            self._start(request, keep_alive)
        else:
            self.pending.append((request, keep_alive))
            if len(self.pending) >= MAX_PIPELINED:
                self.transport.pause_reading()

    # --- answering ----------------------------------------------------------------------------------
    def _start(self, request: Request, keep_alive: bool) -> None:
        self.server.calls += 1
        self.task = asyncio.get_running_loop().create_task(self._answer(request, keep_alive))

    async def _answer(self, request: Request, keep_alive: bool) -> None:
        try:
            answer = await self.server.handler(request)
            keep_alive = keep_alive and not self.server.stopping
            if isinstance(answer, Response):  # (a HEAD request's answer is its head alone, as RFC 9110 says)
                self.transport.write(head(answer.status, answer.content_type, answer.headers, len(answer.body),
                                          keep_alive) + (answer.body if request.method != b"HEAD" else b""))
            elif request.method == b"HEAD":
                self.transport.write(head(answer.status, answer.content_type, answer.headers, None, keep_alive))
                if hasattr(answer.chunks, "aclose"):
                    await answer.chunks.aclose()
            else:
                await self._stream(answer, keep_alive)
        except asyncio.CancelledError:
            self.task = None
            raise
        except Exception:  # noqa: BLE001 (the handler answers its errors; this is a bug: logged, connection closed)
            log.exception("unhandled error answering %s %s", request.method.decode(), request.path[:200])
            keep_alive = False
            if not self.closing:
                body = b'{"error": {"message": "internal error (logged on the server)", "type": "server_error"}}'
                self.transport.write(head(500, b"application/json", [], len(body), False) + body)
        self.task = None
        if not keep_alive or self.closing:
            self._close()
        elif self.pending:
            if len(self.pending) >= MAX_PIPELINED:
                self.transport.resume_reading()
            self._start(*self.pending.popleft())
        else:
            self._idle_timer()

    async def _stream(self, answer: Stream, keep_alive: bool) -> None:
        write = self.transport.write
        write(head(answer.status, answer.content_type, answer.headers, None, keep_alive))
        try:
            async for chunk in answer.chunks:
                if chunk:
                    write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                if self.writable is not None and not self.writable.done():
                    await self.writable  # the client reads slower than we write: wait for it
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("stream ended by an error")
            self._close()  # the client sees a cut stream, not a well-formed end
            raise asyncio.CancelledError from None
        write(b"0\r\n\r\n")

    def _refuse(self, status: int, message: bytes) -> None:
        """Answers a request that cannot be read with `status` and closes the connection."""
        if self.closing:
            return
        self.closing = True
        body = b'{"error": {"message": "%s", "type": "invalid_request_error"}}' % message.replace(b'"', b"'")
        if self.task is None:  # (else the answer under way is cut: the connection closes after it)
            self.transport.write(head(status, b"application/json", [], len(body), False) + body)
            asyncio.get_running_loop().call_later(LINGER_S, self._close)

    def _begin_head(self) -> None:
        self.began = asyncio.get_running_loop().time()
        self._deadline(self.server.limits.header_timeout_s, b"request headers")

    def _deadline(self, within_s: float, what: bytes) -> None:
        """`what` must be received within `within_s` of the request's first byte, or the request is refused
        (408) and the connection closed: a client that trickles a request holds no connection for long."""
        if self.deadline is not None:
            self.deadline.cancel()
        self.deadline = asyncio.get_running_loop().call_at(
            self.began + within_s, self._refuse, 408, b"%s not received within %g s" % (what, within_s))

    def _idle_timer(self) -> None:
        self.idle = asyncio.get_running_loop().call_later(KEEP_ALIVE_S, self._close)

    def _close(self) -> None:
        self.closing = True
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def close_if_idle(self) -> bool:
        if self.task is None and not self.pending:
            self._close()
            return True
        return False


def tls_context(cert: bytes, key: bytes, client_ca: bytes | None) -> ssl.SSLContext:
    """The HTTP door's TLS from the PEM bytes the gRPC port uses (read once, at start, by server/config.py):
    a client CA makes it mutual. ssl loads a certificate chain from a file only: an anonymous memory file."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    fd = os.memfd_create("infercache-tls")
    try:
        os.write(fd, cert + b"\n" + key)
        context.load_cert_chain(f"/proc/self/fd/{fd}")
    finally:
        os.close(fd)
    if client_ca is not None:
        context.load_verify_locations(cadata=client_ca.decode())
        context.verify_mode = ssl.CERT_REQUIRED
    return context


class HttpServer:
    """Listens on (host, port), several processes sharing it (SO_REUSEPORT) as the gRPC port is shared."""

    def __init__(self, handler: Handler, limits: Limits) -> None:
        self.handler = handler
        self.limits = limits
        self.connections: set[_Connection] = set()
        self.clients: dict[str, int] = {}  # connections open by client address (limits.max_client_connections)
        self.calls = 0  # requests begun (a drain waits until this stops moving)
        self.stopping = False
        self._server: asyncio.base_events.Server | None = None

    async def start(self, host: str, port: int, tls: ssl.SSLContext | None = None) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self), host, port, ssl=tls, reuse_port=True,
                                                backlog=2048)

    async def stop(self, grace_s: float) -> None:
        """Stops listening, closes idle connections, lets answers under way finish within grace_s (each
        connection closing after its answer), then closes whatever is left."""
        self.stopping = True
        if self._server is not None:
            self._server.close()
        loop = asyncio.get_running_loop()
        until = loop.time() + grace_s
        while loop.time() < until:
            busy = [c for c in list(self.connections) if not c.close_if_idle()]
            if not busy:
                break
            await asyncio.sleep(0.05)
        for connection in list(self.connections):
            if connection.transport is not None:
                connection.transport.abort()
