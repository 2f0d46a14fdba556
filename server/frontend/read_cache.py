"""A store a frontend reads but never writes (the result store, the feature store), opened on first
use. The worker creates a fresh store moments after start, so an open that fails is tried again a second
later, logged as info during the first STORE_GRACE_S and as a warning (every 30 s) after."""

from __future__ import annotations

import logging
import time

from cachestore.env import Store, StoreSettings
from cachestore.errors import StoreError
from cachestore.results import ResultCache

log = logging.getLogger("infercache.frontend")

STORE_RETRY_S = 1.0   # a fresh store appears once the worker has created it
STORE_GRACE_S = 30.0  # till then an unopenable store is logged as info, after as a warning
WARN_EVERY_S = 30.0


class ReadCache:
    def __init__(self, settings: StoreSettings, what: str) -> None:
        self.settings = settings
        self.what = what  # "result cache", "feature store": for the log
        self.cache: ResultCache | None = None
        self._retry_at = 0.0
        self._warn_at = 0.0
        self._created_at = time.monotonic()

    def get(self) -> ResultCache | None:
        """The open store, or None while it cannot be opened (re-tried at most once a STORE_RETRY_S)."""
        if self.cache is None and time.monotonic() >= self._retry_at:
            try:
                self.cache = ResultCache(Store(self.settings, readonly=True))
            except StoreError as exc:
                now = time.monotonic()
                self._retry_at = now + STORE_RETRY_S
                if now >= self._warn_at:
                    self._warn_at = now + WARN_EVERY_S
                    level = logging.INFO if now - self._created_at < STORE_GRACE_S else logging.WARNING
                    log.log(level, "%s unavailable, serving misses until it opens: %s", self.what, exc)
        return self.cache
