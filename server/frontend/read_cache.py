"""A store a frontend reads but never writes (the result store, the feature store), opened on first
use. The worker creates a fresh store moments after start, so an open that fails is tried again a second
later, logged as info during the first STORE_GRACE_S and as a warning (every 30 s) after.

The store's writer may set a damaged store aside and start a fresh one while the server serves
(cachestore/writer.py): at most once every STORE_CHECK_S, and at once after a read met a damaged page,
the frontend looks whether the data file at the store's path is still the one it maps, and opens the new
one if not."""

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
STORE_CHECK_S = 1.0   # how often the open store's data file is compared with the one at its path


class ReadCache:
    def __init__(self, settings: StoreSettings, what: str) -> None:
        self.settings = settings
        self.what = what  # "result cache", "feature store": for the log
        self.cache: ResultCache | None = None
        self._retry_at = 0.0
        self._warn_at = 0.0
        self._check_at = 0.0
        self._created_at = time.monotonic()

    def get(self) -> ResultCache | None:
        """The open store, or None while it cannot be opened (re-tried at most once a STORE_RETRY_S)."""
        now = time.monotonic()
        if self.cache is not None and now >= self._check_at:
            self._check_at = now + STORE_CHECK_S
            if self.cache.store.replaced():
                log.warning("%s at %s was replaced (its writer set a damaged one aside); reading the new one",
                            self.what, self.settings.path)
                self._open(now)
        elif self.cache is None and now >= self._retry_at:
            self._open(now)
        return self.cache

    def _open(self, now: float) -> None:
        try:
            store = Store(self.settings, readonly=True)
        except StoreError as exc:
            self._retry_at = now + STORE_RETRY_S
            self.cache = None  # (a replaced store is not read any more: misses until the new one opens)
            if now >= self._warn_at:
                self._warn_at = now + WARN_EVERY_S
                level = logging.INFO if now - self._created_at < STORE_GRACE_S else logging.WARNING
                log.log(level, "%s unavailable, serving misses until it opens: %s", self.what, exc)
            return
        if self.cache is None:
            self.cache = ResultCache(store)
            self.cache.on_corrupt = self._damaged
        else:
            self.cache.use(store)  # (the counters go on)
        self._check_at = now + STORE_CHECK_S

    def _damaged(self, key: bytes, exc: Exception) -> None:
        """A read met a damaged page: look at the next read whether the writer replaced the store."""
        self._check_at = 0.0
