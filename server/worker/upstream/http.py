"""HTTP/1.1 JSON calls to one upstream server, from the batcher's threads: a kept-alive connection per
thread (http.client), opened again when the server closed it. Blocking by design: it runs off the event
loop, in the threads that run an engine's batches for a local model."""

from __future__ import annotations

import http.client
import json
import ssl
import threading
from urllib.parse import urlsplit

from server.worker.upstream.errors import Failure

MAX_ANSWER_BYTES = 64 << 20  # an answer's body, at most (as the gRPC kinds' message limit)
MAX_EVENT_BYTES = 1 << 20  # one line of a streamed answer, at most


class JsonEndpoint:
    """POSTs JSON to paths under one base URL (its path included: "http://host:8000/v1")."""

    def __init__(self, base_url: str, headers: dict[str, str], timeout_s: float) -> None:
        parts = urlsplit(base_url)
        self.url = base_url
        self.secure = parts.scheme == "https"
        self.host, self.port = parts.hostname, parts.port or (443 if self.secure else 80)
        self.prefix = parts.path.rstrip("/")
        self.headers = {"content-type": "application/json", **headers}
        self.timeout_s = timeout_s
        self._local = threading.local()
        self._tls = ssl.create_default_context() if self.secure else None

    def _connection(self) -> http.client.HTTPConnection:
        connection = getattr(self._local, "connection", None)
        if connection is None:
            if self.secure:
                connection = http.client.HTTPSConnection(self.host, self.port, timeout=self.timeout_s,
                                                         context=self._tls)
            else:
                connection = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
            self._local.connection = connection
        return connection

    def _drop(self) -> None:
        connection = getattr(self._local, "connection", None)
        if connection is not None:
            connection.close()
            self._local.connection = None

    def post(self, path: str, body: dict, timeout_s: float) -> dict:
        """The JSON object the upstream answered; Failure (with its kind) otherwise."""
        response = self._send(path, body, timeout_s)
        try:
            data = response.read(MAX_ANSWER_BYTES + 1)
        except (OSError, http.client.HTTPException) as exc:
            self._drop()
            raise _lost(exc, timeout_s) from None
        if len(data) > MAX_ANSWER_BYTES:
            self._drop()
            raise Failure("malformed", f"answered over {MAX_ANSWER_BYTES} bytes")
        if response.will_close:
            self._drop()
        return _decoded(response.status, data)

    def events(self, path: str, body: dict, timeout_s: float):
        """The JSON objects of a server-sent event stream (OpenAI's `stream: true`), as they come, up to its
        `data: [DONE]`; each awaited for at most timeout_s. Failure otherwise: one raised after the first
        event has kind "cut" (never retried: the caller has those events)."""
        response = self._send(path, body, timeout_s, accept="text/event-stream")
        started = False

        def broken(message: str) -> Failure:  # (after the first event the caller has some of the answer)
            return Failure("cut" if started else "malformed", message)

        try:
            if response.status >= 400:
                raise Failure.of_status(response.status, _message(response.read(MAX_ANSWER_BYTES)))
            while True:
                line = response.readline(MAX_EVENT_BYTES + 1)
                if not line:
                    raise (Failure("cut", "the stream ended before its [DONE]") if started else
                           Failure("malformed", "answered no event (data:) before the end of its answer"))
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
        except (OSError, http.client.HTTPException) as exc:
            failure = _lost(exc, timeout_s)
            raise (Failure("cut", f"the stream broke off: {failure}") if started else failure) from None
        finally:  # (read to its [DONE] or not, failed or left early: the next call opens a fresh connection)
            self._drop()

    def _send(self, path: str, body: dict, timeout_s: float, accept: str = "application/json"):
        """The upstream's response to a POST of `body` (its head read); Failure otherwise."""
        payload = json.dumps(body).encode()
        headers = {**self.headers, "accept": accept}
        for attempt in (0, 1):  # a kept-alive connection the server closed meanwhile: once more, on a new one
            connection = self._connection()
            reused = connection.sock is not None
            connection.timeout = timeout_s
            if reused:
                connection.sock.settimeout(timeout_s)
            try:
                connection.request("POST", self.prefix + path, payload, headers)
                return connection.getresponse()
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError) as exc:
                self._drop()
                if attempt == 0 and reused:
                    continue
                raise _lost(exc, timeout_s) from None
            except (OSError, http.client.HTTPException, ValueError) as exc:  # (ValueError: its text may quote a header)
                self._drop()
                raise _lost(exc, timeout_s) from None
        raise Failure("connect", "connection lost")  # (not reached: the loop returns or raises)


def _lost(exc: Exception, timeout_s: float) -> Failure:
    """A call's transport failure as a Failure of kind timeout or connect (never quoting a header)."""
    if isinstance(exc, TimeoutError):
        return Failure("timeout", f"no answer within {timeout_s:.1f} s")
    if isinstance(exc, (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError)):
        return Failure("connect", f"connection lost: {type(exc).__name__}")
    if isinstance(exc, OSError) and exc.strerror:
        return Failure("connect", f"cannot reach it: {exc.strerror}")
    return Failure("connect", f"cannot reach it: {type(exc).__name__}")


def _decoded(status: int, data: bytes) -> dict:
    if status >= 400:
        raise Failure.of_status(status, _message(data))
    try:
        found = json.loads(data)
    except ValueError:
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
