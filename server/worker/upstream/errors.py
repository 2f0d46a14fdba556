"""What can go wrong in an upstream call (a Failure of some kind), whether another try may help, and the
domain error (server/shared/errors.py) a caller gets for it."""

from __future__ import annotations

from server.shared.errors import DeadlineExceeded, InferCacheError, InvalidArgument, Overloaded, UpstreamFailed

RETRIED_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
REFUSED_INPUT = frozenset({400, 413, 422})  # the upstream refused the input itself: the caller's to fix


class Failure(Exception):
    """One failed upstream call: `kind` is connect, timeout, status (with `status`), malformed, or cut (a
    streamed answer that broke off after its first piece: never retried)."""

    def __init__(self, kind: str, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.kind = kind
        self.status = status

    @classmethod
    def of_status(cls, status: int, message: str) -> "Failure":
        return cls("status", f"HTTP {status}: {message}", status)

    @property
    def retryable(self) -> bool:
        """Worth another try (on this upstream or the next): the call computes and stores nothing upstream,
        so trying it again is safe."""
        return self.kind in ("connect", "timeout") or self.status in RETRIED_STATUSES

    @property
    def counts_against(self) -> bool:
        """A sign that the upstream itself is failing (its circuit breaker counts it)."""
        return self.kind != "status" or self.status >= 500

    def domain(self, url: str) -> InferCacheError:
        """The error a caller gets, naming the upstream by its URL and the upstream's own reason."""
        where = f"upstream {url}"
        if self.kind == "timeout":
            return DeadlineExceeded(f"{where}: {self}")
        if self.status == 429:
            return Overloaded(f"{where} is saturated ({self}); retry later")
        if self.status in REFUSED_INPUT:
            return InvalidArgument(f"{where} refused the input: {self}")
        if self.status in (401, 403):
            return UpstreamFailed(f"{where} refused this server's credential ({self.status}): check the model's "
                                  "upstream.credential_env or credential_file")
        return UpstreamFailed(f"{where}: {self}")


class Abandoned(Exception):
    """A generation's stream stopped by this side (every caller left, or its deadline passed): no failure
    of the upstream's, never retried or counted against it."""
