"""Admission arithmetic the frontends and the workers share: which sequence-length bucket a text waits in
(and the finer length groups a batcher cuts batches by), how long a request may wait, and whether an
expected wait admits it. The frontends refuse at once what their worker's told queue wait would not answer
in time (server/frontend/workers.py); the worker's batcher checks the same on arrival
(server/worker/batcher.py)."""

from __future__ import annotations

import bisect

ADMIT_HEADROOM = 1.5        # a request is admitted where its expected wait is within 2/3 of what it may
                            # wait: the slack absorbs batches slower than the estimate (a burst's frontends
                            # take CPU from a CPU engine), which would otherwise shed admitted requests
                            # later, a late refusal (bench/overload.py, 2 cores: 0-23 shed against 71 at
                            # 1.25 and 97 at 1.0)


def bucket_of(buckets: tuple[int, ...], length: int) -> int:
    """The sequence-length bucket (engine profile) of a sequence of `length` tokens: the smallest that
    holds it, else the largest (the tokenizer truncates to it)."""
    return buckets[min(bisect.bisect_left(buckets, length), len(buckets) - 1)]


def length_groups(buckets: tuple[int, ...], shortest: int = 8) -> tuple[int, ...]:
    """The buckets and finer lengths between them, from `shortest` up to the longest bucket: steps of
    2 tokens up to 16, 4 up to 32, 8 up to 64 and so on, so that a row pads by under a quarter of its
    length (plus up to `shortest`)."""
    out, length = set(buckets), shortest
    while length < buckets[-1]:
        out.add(length)
        length += max(2, (1 << (length.bit_length() - 1)) // 4)
    return tuple(sorted(b for b in out if b <= buckets[-1]))


def wait_bound(max_wait_s: float, remaining: float | None) -> float | None:
    """The longest a request may wait for its answer: its deadline's remaining seconds, at most
    max_wait_s when that is set (0: unset); None when neither bounds it."""
    if remaining is None:
        return max_wait_s or None
    return min(max_wait_s, remaining) if max_wait_s else remaining


def admits(expected: float, bound: float | None) -> bool:
    """Whether a request expected to be answered in `expected` seconds may wait for it (wait_bound),
    with ADMIT_HEADROOM to spare. The frontends' admission and the worker's on arrival both use it."""
    return bound is None or expected * ADMIT_HEADROOM <= bound


def over(bound: float) -> str:
    """What a refused request's expected wait exceeded, for its error message."""
    return f"the {max(bound, 0) / ADMIT_HEADROOM:.2f} s admitted (the {max(bound, 0):.2f} s allowed, less headroom)"


def discounted(seconds: float, told_at: float, now: float) -> float:
    """A queue wait estimated at `told_at`, as it stands at `now` (the queue drains meanwhile): how the
    frontends read the waits their worker sends, and how the worker reckons what they hold."""
    return max(0.0, seconds - (now - told_at))
