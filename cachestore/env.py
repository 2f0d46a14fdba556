"""The host's LMDB environment: the only place that calls lmdb.open.

Every process opens its own handle after it starts (children are spawned, never forked with an open
environment). Frontends open read-only; the worker opens read-write and is the single writer.
Settings that every process must agree on (the store format) are persisted in the `meta` database
and checked on open; a mismatch is a StoreFormatError and the caller serves without the cache.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import lmdb

from cachestore.errors import CORRUPTION, StoreDamaged, StoreError, StoreFormatError
from cachestore.sealing import KeyRing

log = logging.getLogger("infercache.store")

STORE_FORMAT = 1
DB_RESULTS = b"results"        # key(24) -> record
DB_STORED = b"stored"          # created_us(8, big-endian) + key -> TTL class   (eviction order)
DB_EXPIRY = b"expiry"          # expires_us(8, big-endian) + key -> b""   (sweep order)
DB_NAMESPACES = b"namespaces"  # ns_id(8) -> JSON [tenant, model, version]
DB_META = b"meta"              # persisted settings
DB_SEMLOG = b"semlog"          # semantic index entries (cachestore.semantic_log)
DB_SEMKEYS = b"semkeys"
DB_SEMNEXT = b"semnext"
DB_CLASSES = b"classes"        # TTL class -> entries stored for it (8, big-endian)
ALL_DBS = (DB_RESULTS, DB_STORED, DB_EXPIRY, DB_NAMESPACES, DB_META, DB_SEMLOG, DB_SEMKEYS, DB_SEMNEXT, DB_CLASSES)
READER_DBS = (DB_RESULTS, DB_META)  # what read-only (frontend) handles open
DIR_MODE, FILE_MODE = 0o700, 0o600  # the store holds users' answers: the server's own user only
DATA_FILE, LOCK_FILE = "data.mdb", "lock.mdb"

_forks = [0]  # forks this process descends from: a Store remembers the count it was opened under
os.register_at_fork(after_in_child=lambda: _forks.__setitem__(0, _forks[0] + 1))


@dataclass(frozen=True)
class StoreSettings:
    path: Path
    map_size: int
    budget: int  # eviction starts above this many bytes of live pages
    sync: bool = True
    keys: tuple[bytes, ...] = field(default=(), repr=False)  # encryption at rest: sealing key first; () = off
    # With sync: 0 = every commit is flushed to disk before it counts as done; > 0 = commits are not
    # flushed, the writer flushes the file this many seconds after the first commit that is not, beside
    # the commits that follow (see cachestore/writer.py). Either way a commit is in the kernel's page cache
    # once it returns, so the death of any process loses nothing committed; power loss may lose the
    # unflushed window and the flush in progress, or leave the store damaged where the file system
    # reorders writes (LMDB's MDB_NOSYNC; a damaged store is set aside when met).
    sync_interval_s: float = 0.0


def restrict(path: Path) -> None:
    """Makes a store directory and the files in it private to this user (0700 / 0600), also one created
    by an earlier release or by hand; logs what it tightened."""
    loose = [p for p in (path, *path.iterdir()) if p.stat().st_mode & 0o077]
    for p in loose:
        p.chmod(DIR_MODE if p.is_dir() else FILE_MODE)
    if loose:
        log.warning("made %d path(s) under %s private to this user (they were readable by others)", len(loose), path)


def file_identity(path: Path) -> tuple[int, int] | None:
    """(device, inode) of a file, None when it is not there: a store set aside and replaced has a new one."""
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return stat.st_dev, stat.st_ino


class Store:
    """One process's handle on the environment and its named databases."""

    def __init__(self, settings: StoreSettings, *, readonly: bool) -> None:
        self.settings = settings
        self.readonly = readonly
        self._forks = _forks[0]
        self._remap = threading.Lock()  # a flush (another thread's) never meets the map being remapped
        self.ring = KeyRing(settings.keys) if settings.keys else None  # seals and opens payloads
        self.env = self._open()
        if readonly:
            self._check_pair()
        self.identity = self._files()
        try:
            self.page_size = self.env.stat()["psize"]
            self.dbs = {name: db for name in ALL_DBS if (db := self._open_db(name)) is not None}
            self._check_format()
        except CORRUPTION as exc:
            self.env.close()
            raise StoreDamaged(f"store at {settings.path} is damaged: {exc}") from exc
        if not readonly:
            self.clear_stale_readers()

    def _open(self) -> lmdb.Environment:
        path = self.settings.path
        self._opened_files = self._files()  # (before the open: see _check_pair)
        try:
            if not self.readonly:
                path.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
                restrict(path)
            return lmdb.open(
                str(path), map_size=self.settings.map_size, max_dbs=len(ALL_DBS), readonly=self.readonly,
                sync=self.settings.sync and not self.settings.sync_interval_s, readahead=False, max_readers=512, subdir=True, create=not self.readonly,
                mode=FILE_MODE,
            )
        except (lmdb.Error, OSError) as exc:
            raise StoreError(f"cannot open store at {path}: {exc}") from exc

    def _files(self) -> tuple:
        """(device, inode) of the data file and of the lock file (None for one that is not there)."""
        return tuple(file_identity(self.settings.path / name) for name in (DATA_FILE, LOCK_FILE))

    def _check_pair(self) -> None:
        """A reader opens the lock file, then the data file: a writer that set the store aside between the
        two (cachestore/integrity.py set_aside) would leave it the old lock file beside the new data file,
        a reader table the writer never sees. Opened again until no replacement fell in between."""
        for _ in range(3):
            if self._files() == self._opened_files:  # nothing was replaced while it opened
                return
            self.env.close()
            self.env = self._open()
        raise StoreError(f"store at {self.settings.path} is being replaced; try again")

    def replaced(self) -> bool:
        """Whether the data file at the store's path is no longer the one this handle maps (its writer set
        a damaged store aside and started a fresh one): a reader opens it anew."""
        return self._files()[0] != self.identity[0]

    def _open_db(self, name: bytes):
        try:
            return self.env.open_db(name, create=not self.readonly)
        except CORRUPTION:
            raise
        except lmdb.Error as exc:
            if self.readonly and name not in READER_DBS:
                return None  # a store from before that database existed: readers do not need it
            raise StoreError(f"store at {self.settings.path} has no database {name.decode()}: {exc}") from exc

    def _check_format(self) -> None:
        """Checks the persisted settings; a new store gets them, with a random id that snapshots
        kept outside LMDB (semantic indexes) use to tell whether they belong to this store."""
        meta = self.dbs[DB_META]
        with self.env.begin(write=not self.readonly) as txn:
            raw = txn.get(b"settings", db=meta)
            if raw is None:
                if self.readonly:
                    raise StoreFormatError("store has no settings record yet")
                settings = {"format": STORE_FORMAT, "store_id": uuid.uuid4().hex}
                txn.put(b"settings", json.dumps(settings).encode(), db=meta)
            else:
                try:
                    settings = json.loads(bytes(raw))
                except ValueError:
                    settings = {}
        if settings.get("format") != STORE_FORMAT:
            raise StoreFormatError(f"store format {settings.get('format')}, this build reads {STORE_FORMAT}")
        self.store_id = str(settings.get("store_id", ""))

    def clear_stale_readers(self) -> None:
        """Frees reader slots left by processes that died (kill -9) while holding a read transaction:
        until then LMDB keeps every page such a reader saw from reuse, and the data file grows."""
        stale = self.env.reader_check()
        if stale:
            log.warning("cleared %d stale reader slot(s)", stale)

    def begin(self, *, write: bool = False, buffers: bool = False) -> lmdb.Transaction:
        if self._forks != _forks[0]:  # (not os.getpid(): a system call on every hit)
            raise StoreError("a Store handle must not cross a fork; open one per process")
        try:
            return self.env.begin(None, None, write, buffers)  # (positional: keywords cost 0.2 us a read)
        except lmdb.MapResizedError:
            # Another process grew the map: adopt its size and retry once.
            with self._remap:
                self.env.set_mapsize(0)
            return self.env.begin(None, None, write, buffers)

    def used_bytes(self, txn: lmdb.Transaction) -> int:
        """Bytes of live pages (what eviction keeps under the budget); shrinks when entries are deleted."""
        total = 0
        for stat in [txn.stat(db) for db in self.dbs.values()] + [txn.stat()]:
            total += (stat["branch_pages"] + stat["leaf_pages"] + stat["overflow_pages"]) * stat["psize"]
        return total

    def stats(self) -> dict:
        with self.begin() as txn:
            return {
                "entries": txn.stat(self.dbs[DB_RESULTS])["entries"],
                "used_bytes": self.used_bytes(txn),
                "budget_bytes": self.settings.budget,
                "map_size_bytes": self.env.info()["map_size"],
                "entries_by_class": self.class_counts(txn),
            }

    def class_counts(self, txn: lmdb.Transaction) -> dict[str, int]:
        """Entries by the TTL class they were stored for (a store made before classes counts none)."""
        db = self.dbs.get(DB_CLASSES)
        if db is None:
            return {}
        with txn.cursor(db=db) as cursor:
            return {bytes(k).decode(): int.from_bytes(v, "big") for k, v in cursor if int.from_bytes(v, "big")}

    def flush_to_disk(self) -> None:
        """What the commits so far wrote, flushed from the page cache to the disk (fsync). May run on a
        thread beside the one that commits (cachestore/writer.py)."""
        with self._remap:
            self.env.sync(True)

    def close(self) -> None:
        self.env.close()
