"""Log lines that can repeat fast (each failed read of a damaged store, each failed commit, each malformed
request) written at most once per interval, each saying how often it happened since the last one."""

from __future__ import annotations

import logging
import time


class RateLimitedLog:
    def __init__(self, logger: logging.Logger, every_s: float = 10.0) -> None:
        self.logger = logger
        self.every_s = every_s
        self._count = 0
        self._next_at = 0.0

    def __call__(self, level: int, message: str, *args, exc_info: bool = False) -> bool:
        """Counts one more; writes the line (with the count) if none was written for `every_s`. Whether
        it wrote (a traceback, with exc_info, comes once per interval too)."""
        self._count += 1
        now = time.monotonic()
        if now < self._next_at:
            return False
        count, self._count, self._next_at = self._count, 0, now + self.every_s
        self.logger.log(level, f"{message} ({count} since the last such line; at most one every %.0f s)", *args,
                        self.every_s, exc_info=exc_info)
        return True
