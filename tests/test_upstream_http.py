"""The upstream HTTP client (server/worker/upstream/http.py) against a real TCP server on a free port that
answers each request with the bytes a test gives it: the ways real servers frame an answer (a length,
chunks, the connection's end), keep-alive and a connection the server closed meanwhile, event streams,
and answers that are not HTTP. A JSON call is made both ways the worker makes it: blocking, from a thread,
and on an event loop (post_async)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest
import uvloop

from server.worker.upstream.errors import Failure
from server.worker.upstream.http import JsonEndpoint


HANG = b"(no answer)"


class CannedServer:
    """Accepts connections; reads each request (head and content-length body) and writes the next of
    `answers` (bytes, or None: close the connection without answering, or HANG: answer nothing for a
    while), closing after it where the answer says `connection: close`."""

    def __init__(self, answers: list[bytes | None]) -> None:
        self.answers = list(answers)
        self.connections = 0
        self.requests: list[bytes] = []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}/v1"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        data = b""
        with conn:
            while self.answers:
                while b"\r\n\r\n" not in data:
                    more = conn.recv(65536)
                    if not more:
                        return
                    data += more
                head, _, data = data.partition(b"\r\n\r\n")
                length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                                  if line.lower().startswith(b"content-length")))
                while len(data) < length:
                    data += conn.recv(65536)
                self.requests.append(head + b"\r\n\r\n" + data[:length])
                data = data[length:]
                answer = self.answers.pop(0)
                if answer is None:
                    return
                if answer is HANG:
                    time.sleep(2.0)
                    return
                conn.sendall(answer)
                if b"connection: close" in answer.lower():
                    return

    def close(self) -> None:
        self.listener.close()


@pytest.fixture
def canned():
    servers: list[CannedServer] = []

    def start(*answers: bytes | None) -> CannedServer:
        servers.append(CannedServer(list(answers)))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


@pytest.fixture(params=["thread", "loop"])
def post(request):
    """post(endpoint, path, body, timeout_s): a call as a generation's thread makes it, or as the event
    loop does (uvloop's, as the worker runs; one for the test, so that kept-alive connections carry over)."""
    if request.param == "thread":
        yield lambda endpoint, *call: endpoint.post(*call)
        return
    loop = uvloop.new_event_loop()
    used: list[JsonEndpoint] = []

    def call(endpoint, *args):
        used.append(endpoint)
        return loop.run_until_complete(endpoint.post_async(*args))

    yield call
    for endpoint in used:
        endpoint.close()
    loop.run_until_complete(asyncio.sleep(0))  # (the closed transports' callbacks)
    loop.close()


def _json(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n%s" % (
        len(body), extra, body)


def _chunked(*chunks: bytes, status: bytes = b"200 OK", kind: bytes = b"application/json") -> bytes:
    body = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n"
    return b"HTTP/1.1 %s\r\ncontent-type: %s\r\ntransfer-encoding: chunked\r\n\r\n%s" % (status, kind, body)


def test_answers_by_length_and_by_chunks_share_one_kept_alive_connection(canned, post):
    server = canned(_json(b'{"n": 1}'), _chunked(b'{"n"', b': 2}'))
    endpoint = JsonEndpoint(server.url, {"authorization": "Bearer k"}, 5.0)
    assert post(endpoint, "/embeddings", {"input": ["a"]}, 5.0) == {"n": 1}
    assert post(endpoint, "/embeddings", {"input": ["b"]}, 5.0) == {"n": 2}
    assert server.connections == 1
    first = server.requests[0]
    assert first.startswith(b"POST /v1/embeddings HTTP/1.1\r\n") and b"authorization: Bearer k\r\n" in first
    assert first.endswith(b'{"input":["a"]}')


def test_an_answer_ended_by_its_connection_is_read_whole_and_the_next_call_connects_again(canned, post):
    server = canned(b'HTTP/1.1 200 OK\r\nconnection: close\r\n\r\n{"whole": true}', _json(b'{"n": 2}'))
    endpoint = JsonEndpoint(server.url, {}, 5.0)
    assert post(endpoint, "/embeddings", {}, 5.0) == {"whole": True}
    assert post(endpoint, "/embeddings", {}, 5.0) == {"n": 2}
    assert server.connections == 2


def test_a_kept_alive_connection_the_server_closed_is_opened_again_once(canned, post):
    server = canned(_json(b'{"n": 1}'), None, _json(b'{"n": 2}'))
    endpoint = JsonEndpoint(server.url, {}, 5.0)
    assert post(endpoint, "/embeddings", {}, 5.0) == {"n": 1}
    assert post(endpoint, "/embeddings", {}, 5.0) == {"n": 2}  # (closed unanswered: sent again on a new one)
    assert server.connections == 2


def test_errors_not_http_and_cut_answers_are_failures_of_their_kind(canned, post):
    server = canned(_json(b'{"error": {"message": "slow down"}}').replace(b"200 OK", b"429 Too Many Requests"),
                    b"SSH-2.0-not-http\r\n\r\n")
    endpoint = JsonEndpoint(server.url, {}, 5.0)
    with pytest.raises(Failure) as refused:
        post(endpoint, "/embeddings", {}, 5.0)
    assert refused.value.status == 429 and "slow down" in str(refused.value)
    with pytest.raises(Failure) as garbage:
        post(endpoint, "/embeddings", {}, 5.0)
    assert garbage.value.kind == "malformed"
    cut = canned(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n{\"n\"")
    with pytest.raises(Failure) as broken:
        post(JsonEndpoint(cut.url, {}, 5.0), "/embeddings", {}, 5.0)
    assert broken.value.kind == "connect"


def test_an_event_stream_yields_its_events_and_a_stream_cut_after_one_is_cut(canned):
    stream = _chunked(b'data: {"i": 1}\n\n', b'data: {"i"', b': 2}\n\n: a comment\n\ndata: [DONE]\n\n',
                      kind=b"text/event-stream")
    cut = _chunked(b'data: {"i": 1}\n\n', kind=b"text/event-stream")
    server = canned(stream, cut)
    endpoint = JsonEndpoint(server.url, {}, 5.0)
    assert list(endpoint.events("/chat/completions", {}, 5.0)) == [{"i": 1}, {"i": 2}]
    seen = []
    with pytest.raises(Failure) as ended:
        for event in endpoint.events("/chat/completions", {}, 5.0):
            seen.append(event)
    assert seen == [{"i": 1}] and ended.value.kind == "cut"


def test_a_header_with_a_line_break_fails_every_call_without_quoting_it(canned, post):
    server = canned(_json(b"{}"))
    endpoint = JsonEndpoint(server.url, {"authorization": "Bearer secret\r\nx-evil: 1"}, 5.0)
    with pytest.raises(Failure) as refused:
        post(endpoint, "/embeddings", {}, 5.0)
    assert "secret" not in str(refused.value) and server.requests == []


def test_an_upstream_that_does_not_answer_in_time_is_a_timeout_and_its_connection_is_not_reused(canned, post):
    server = canned(HANG, _json(b'{"n": 2}'))
    endpoint = JsonEndpoint(server.url, {}, 5.0)
    began = time.monotonic()
    with pytest.raises(Failure) as late:
        post(endpoint, "/embeddings", {}, 0.3)
    assert late.value.kind == "timeout" and time.monotonic() - began < 1.5
    assert post(endpoint, "/embeddings", {}, 5.0) == {"n": 2} and server.connections == 2


def test_an_unreachable_upstream_is_a_connect_failure(post):
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    listener.close()  # (nothing listens there now)
    with pytest.raises(Failure) as refused:
        post(JsonEndpoint(f"http://127.0.0.1:{port}/v1", {}, 5.0), "/embeddings", {}, 5.0)
    assert refused.value.kind == "connect"


def test_a_large_answer_is_read_off_the_event_loop_and_a_small_one_on_it(canned):
    numbers = b'{"v": [%s]}' % b",".join([b"0.125"] * 40_000)  # (JSON numbers: about 240 KB)
    server = canned(_json(b'{"v": [1]}'), _json(numbers))
    endpoint = JsonEndpoint(server.url, {}, 5.0)
    loop, readers = uvloop.new_event_loop(), []

    def read(answer: dict) -> int:
        readers.append(threading.get_ident())
        return len(answer["v"])

    try:
        small = loop.run_until_complete(endpoint.post_async("/embeddings", {}, 5.0, read=read))
        large = loop.run_until_complete(endpoint.post_async("/embeddings", {}, 5.0, read=read))
    finally:
        endpoint.close()
        loop.close()
    assert (small, large) == (1, 40_000)
    assert readers[0] == threading.get_ident() != readers[1]  # (the loop runs in this test's thread)
