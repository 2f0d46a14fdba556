"""The HTTP door's bounds on what a client holds before its request is whole (no token is checked before
that), through a real server and raw sockets: a trickled or stalled request is refused at its deadline, an
endless request line or header at its size, a client's connections are bounded; and the answers a client
reads on a kept-alive connection stay in step (HEAD, repeated headers, bad values)."""

from __future__ import annotations

import http.client
import json
import socket
import time

import pytest

from tests.conftest import MINILM_CONFIG, MODEL_VERSION_DIR
from harness.servers import ServerProcess, free_port, link_model

HEADER_TIMEOUT_S, REQUEST_TIMEOUT_S, CLIENT_CONNECTIONS = 1.0, 2.0, 4


@pytest.fixture(scope="module")
def door(tmp_path_factory, engines_dir):
    """One frontend with the HTTP door, short request deadlines and a small bound on a client's connections."""
    models = tmp_path_factory.mktemp("limits-models")
    link_model(models, "minilm", MINILM_CONFIG, {"1": MODEL_VERSION_DIR})
    port = free_port()
    server = ServerProcess(tmp_path_factory.mktemp("limits"), models, engines_dir=engines_dir, frontends=1,
                           settings=(f"server.http_port={port}", f"server.http_header_timeout_s={HEADER_TIMEOUT_S}",
                                     f"server.http_request_timeout_s={REQUEST_TIMEOUT_S}",
                                     f"server.http_max_client_connections={CLIENT_CONNECTIONS}"))
    server.http_port = port
    yield server
    assert server.stop() == 0, server.log_text()


def _connect(door) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", door.http_port), timeout=10)
    return sock


def _read_answer(sock: socket.socket, within_s: float = 10.0) -> bytes:
    """Everything the server writes until it closes the connection (or within_s passes)."""
    sock.settimeout(within_s)
    out = b""
    try:
        while chunk := sock.recv(65536):
            out += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return out


def _status(answer: bytes) -> int:
    assert answer.startswith(b"HTTP/1.1 "), answer[:200]
    return int(answer[9:12])


def test_a_trickled_request_head_is_refused_at_its_deadline(door):
    sock = _connect(door)
    sock.sendall(b"POST /v1/embeddings HTTP/1.1\r\nhost: x\r\n")
    for _ in range(4):  # a byte at a time, never ending the head
        time.sleep(0.3)
        try:
            sock.sendall(b"x")
        except OSError:
            break
    answer = _read_answer(sock)
    assert _status(answer) == 408 and b"request headers not received within 1 s" in answer  # (not the body's 2 s)
    sock.close()


def test_blank_lines_before_a_request_line_start_its_deadline(door):
    sock = _connect(door)  # (the parser skips them without starting a request)
    sock.sendall(b"\r\n\r\n")
    answer = _read_answer(sock)
    assert _status(answer) == 408 and b"headers" in answer
    sock.close()


def test_a_stalled_body_is_refused_at_the_request_deadline(door):
    sock = _connect(door)
    sock.sendall(b"POST /v1/embeddings HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"content-length: 1000\r\n\r\n{\"model\": ")
    answer = _read_answer(sock)
    assert _status(answer) == 408 and b"body" in answer
    sock.close()


def test_an_http09_line_is_answered_not_held(door):
    sock = _connect(door)
    sock.sendall(b"GET /v1/models\r\n")
    assert _status(_read_answer(sock)) in (400, 408)
    sock.close()


def test_an_endless_request_line_or_header_is_refused_at_its_size(door):
    for opening, status in ((b"GET /v1/" + b"a" * 200_000, 414),
                            (b"GET /v1/models HTTP/1.1\r\nx-long: " + b"b" * 200_000, 431),
                            (b"GET /v1/models HTTP/1.1\r\n" + b"x-many: c\r\n" * 20_000, 431)):
        sock = _connect(door)
        try:
            sock.sendall(opening)
        except OSError:
            pass  # the server may close before it has read everything
        assert _status(_read_answer(sock)) == status
        sock.close()
    status, _, _ = _request(door, "GET", "/v1/models")
    assert status == 200


def test_a_client_holds_a_bounded_number_of_connections(door):
    held = [_connect(door) for _ in range(CLIENT_CONNECTIONS)]
    try:
        time.sleep(0.2)  # (the server has taken them)
        extra = _connect(door)
        answer = _read_answer(extra)
        assert _status(answer) == 503 and b"connections" in answer
        extra.close()
        held.pop().close()
        time.sleep(0.2)
        status, _, _ = _request(door, "GET", "/v1/models")  # a place again
        assert status == 200
    finally:
        for sock in held:
            sock.close()


def _request(door, method: str, path: str, body: bytes | None = None, headers: dict | None = None,
             connection: http.client.HTTPConnection | None = None):
    own = connection is None
    connection = connection or http.client.HTTPConnection("127.0.0.1", door.http_port, timeout=30)
    try:
        connection.request(method, path, body=body, headers=headers or {})
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        if own:
            connection.close()


def test_a_head_request_is_answered_without_a_body(door):
    sock = _connect(door)  # two requests on one connection: the second's answer must be the next bytes read
    sock.sendall(b"HEAD /v1/embeddings HTTP/1.1\r\nhost: x\r\n\r\nGET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n")
    time.sleep(0.5)
    sock.settimeout(5)
    answer = sock.recv(65536)
    first, _, rest = answer.partition(b"\r\n\r\n")
    assert first.startswith(b"HTTP/1.1 405") and b"content-length" in first
    assert rest.startswith(b"HTTP/1.1 200"), rest[:200]
    sock.close()


def test_repeated_identity_headers_and_bad_values_are_400_not_500(door):
    json_type = {"content-type": "application/json"}
    body = json.dumps({"model": "minilm", "input": "hello"}).encode()
    sock = _connect(door)
    sock.sendall(b"POST /v1/embeddings HTTP/1.1\r\nhost: x\r\nx-infercache-tenant: a\r\nx-infercache-tenant: b\r\n"
                 b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
    answer = _read_answer(sock)
    assert _status(answer) == 400 and b"more than once" in answer
    sock.close()
    cases = [({**json_type, "x-infercache-tenant": b"\xff\xfe"}, body, "UTF-8"),
             ({**json_type, "x-infercache-max-age": "9" * 5000}, body, "whole number"),
             ({**json_type, "x-infercache-max-age": "-1"}, body, "whole number")]
    for headers, payload, says in cases:
        status, _, answer = _request(door, "POST", "/v1/embeddings", payload, headers)
        assert status == 400 and says in json.loads(answer)["error"]["message"], (headers, answer)
    assert "Traceback" not in door.log_text()
