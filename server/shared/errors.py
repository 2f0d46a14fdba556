"""Domain errors and the tables that map them to status codes: gRPC's (STATUS_CODES) and, for the
OpenAI-compatible HTTP door, HTTP's with OpenAI's error types (HTTP_STATUS).

Core code raises these; only the servicers and the doors translate, through `status_of` and
`http_status_of`.
"""

from __future__ import annotations

import asyncio
import functools
import logging

import grpc
from google.protobuf import wrappers_pb2
from google.protobuf.message import DecodeError

from cachestore.log_limit import RateLimitedLog

log = logging.getLogger("infercache.errors")


class InferCacheError(Exception):
    """Base of every error a client may see; the message says what to fix."""


class InvalidArgument(InferCacheError):
    pass


class ModelNotFound(InferCacheError):
    pass


class NotCached(InferCacheError):
    """ONLY_IF_CACHED and no fresh entry."""


class Disabled(InferCacheError):
    """The call needs a feature this server's configuration turns off."""


class Overloaded(InferCacheError):
    """The batch queue is full; retry later or elsewhere."""


class WorkerUnavailable(InferCacheError):
    pass


class DeadlineExceeded(InferCacheError):
    pass


class UpstreamFailed(InferCacheError):
    """The server that computes an upstream model's misses failed, answered malformed or cannot be reached
    (server/worker/upstream/); its reason is in the message, never its credential."""


class Unauthenticated(InferCacheError):
    """No token, or one the server does not know (server/shared/auth.py)."""


class PermissionDenied(InferCacheError):
    """A known token whose role or tenant does not allow the call."""


STATUS_CODES: dict[type[InferCacheError], grpc.StatusCode] = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    ModelNotFound: grpc.StatusCode.NOT_FOUND,
    NotCached: grpc.StatusCode.FAILED_PRECONDITION,
    Disabled: grpc.StatusCode.FAILED_PRECONDITION,
    Overloaded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    WorkerUnavailable: grpc.StatusCode.UNAVAILABLE,
    DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    UpstreamFailed: grpc.StatusCode.UNAVAILABLE,
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
}

# The HTTP door (server/frontend/openai_api.py): (HTTP status, OpenAI error type) of each error. NotCached
# is 412, not the 504 of HTTP caching's only-if-cached: clients retry 5xx answers, and this one would
# answer the same again.
HTTP_STATUS: dict[type[InferCacheError], tuple[int, str]] = {
    InvalidArgument: (400, "invalid_request_error"),
    ModelNotFound: (404, "not_found_error"),
    NotCached: (412, "not_cached"),
    Disabled: (412, "disabled"),
    Overloaded: (429, "rate_limit_error"),
    WorkerUnavailable: (503, "service_unavailable"),
    DeadlineExceeded: (504, "timeout"),
    Unauthenticated: (401, "authentication_error"),
    PermissionDenied: (403, "permission_error"),
}
RETRY_AFTER_S = {Overloaded: 1, WorkerUnavailable: 1}  # HTTP answers that say when to try again

# Codes the worker may return that the frontend passes to its client unchanged.
# (UpstreamFailed arrives as UNAVAILABLE, its reason in the message: a frontend answers it as WorkerUnavailable.)
_FROM_CODE = {code: cls for cls, code in STATUS_CODES.items() if cls is not UpstreamFailed}


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    for cls in type(exc).__mro__:
        if cls in STATUS_CODES:
            return STATUS_CODES[cls], str(exc)
    return grpc.StatusCode.INTERNAL, "internal error (logged on the server)"


_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


def to_wire(exc: BaseException) -> tuple[int, str]:
    """(status code number, message) of an error, for results carried inside a frame."""
    code, message = status_of(exc)
    return code.value[0], message


def from_wire(number: int, details: str) -> InferCacheError:
    """The domain error for a failed item answered in a frame (inverse of to_wire)."""
    return from_worker_error(_BY_NUMBER.get(number, grpc.StatusCode.UNKNOWN), details)


def from_worker_error(code: grpc.StatusCode, details: str) -> InferCacheError:
    """The domain error for a failed internal call, so the client sees the worker's code."""
    cls = _FROM_CODE.get(code)
    if cls is not None:
        return cls(details)
    if code == grpc.StatusCode.CANCELLED:
        return WorkerUnavailable("inference worker cancelled the call (restarting?)")
    return WorkerUnavailable(f"inference worker failed: {code.name}: {details}")


QUOTE_CHARS = 64  # an error message quotes at most this much of a client's input


def quoted(value: str) -> str:
    """repr of a client's string for an error message, cut to QUOTE_CHARS (with its full length)."""
    return repr(value) if len(value) <= QUOTE_CHARS else f"{value[:QUOTE_CHARS]!r}... ({len(value)} characters)"


class Malformed:
    """What the lenient deserializer returns for bytes that do not parse, or that are over the request size
    limit: the handler answers INVALID_ARGUMENT (`complaint`) instead of gRPC's UNKNOWN with a traceback in
    the log per request."""

    __slots__ = ("message", "error", "complaint")

    def __init__(self, message: str, error: str, complaint: str = "") -> None:
        self.message = message
        self.error = error
        self.complaint = complaint or f"request is not a valid {message} message"


def too_large(size: int, limit: int) -> str:
    """The complaint about a request of `size` bytes over server.max_request_bytes (not worth a retry)."""
    return (f"request is {size} bytes; this server accepts at most {limit} (server.max_request_bytes): "
            "split it (InferBatch: fewer texts per call)")


# How a message without fields (GetStatsRequest, ListModelsRequest) is checked: upb parses such a message
# without looking at its bytes' tags, so field number 0, which every other message refuses, passed. A
# message whose one field is bytes accepts all that a message without fields should (well-formed fields
# of any number and wire type) and refuses what it should not.
_WIRE_CHECK = wrappers_pb2.BytesValue


def lenient(message_class, max_bytes: int | None = None):
    """A request deserializer that never raises (see Malformed); bytes over `max_bytes` are not parsed."""
    checked_first = _WIRE_CHECK if not message_class.DESCRIPTOR.fields else None
    name = message_class.__name__

    def parse(raw: bytes):
        if max_bytes is not None and len(raw) > max_bytes:
            return Malformed(name, f"{len(raw)} bytes", too_large(len(raw), max_bytes))
        try:
            if checked_first is not None:
                checked_first.FromString(raw)
            return message_class.FromString(raw)
        except DecodeError as exc:
            return Malformed(name, str(exc))
    return parse


# One warning per interval with the count, not one per request (a flood must not flood the log).
_malformed = RateLimitedLog(log, 10.0)


def parsed(request):
    """The request, or INVALID_ARGUMENT when the lenient deserializer could not parse it. Called by the
    handler, after authentication: an unauthenticated caller learns nothing about its request."""
    if isinstance(request, Malformed):
        _malformed(logging.WARNING, "malformed request(s) answered INVALID_ARGUMENT (latest: %s: %s)", request.message,
                   request.error)
        raise InvalidArgument(request.complaint)
    return request


def _failed(exc: Exception, handler: str) -> tuple[grpc.StatusCode, str]:
    """A handler's error as its status: a domain error's own, anything else INTERNAL (logged, with its
    traceback: call it in the except clause)."""
    if isinstance(exc, InferCacheError):
        return status_of(exc)
    log.exception("unhandled error in %s", handler)
    return status_of(RuntimeError())


def http_status_of(exc: Exception, handler: str) -> tuple[int, str, str, int | None]:
    """(HTTP status, OpenAI error type, message, Retry-After seconds or None) of a door's error: a domain
    error's own, anything else 500 (logged, with its traceback: call it in the except clause)."""
    for cls in type(exc).__mro__:
        if cls in HTTP_STATUS:
            status, kind = HTTP_STATUS[cls]
            return status, kind, str(exc), RETRY_AFTER_S.get(cls)
    _failed(exc, handler)
    return 500, "server_error", status_of(RuntimeError())[1], None


def grpc_errors(handler):
    """Decorates an async servicer method: domain errors become their status code, anything else INTERNAL."""
    @functools.wraps(handler)
    async def wrapper(self, request, context):
        try:
            return await handler(self, request, context)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            code, message = _failed(exc, handler.__name__)
        await context.abort(code, message)

    return wrapper


def grpc_stream_errors(handler):
    """grpc_errors for a server-streaming servicer method (an async generator): the messages it yields
    go out; a domain error ends the stream with its status code, anything else with INTERNAL."""
    @functools.wraps(handler)
    async def wrapper(self, request, context):
        try:
            async for message in handler(self, request, context):
                yield message
            return
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            code, message = _failed(exc, handler.__name__)
        await context.abort(code, message)

    return wrapper
