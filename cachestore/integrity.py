"""Checks an LMDB data file against its own meta pages before anything maps it.

LMDB maps the file and trusts it: a data file shorter than the pages its newest meta page claims (a
truncated copy, a disk that filled during a restore) makes the first read past its end a SIGBUS, which
kills the process and which no Python `except` can catch. So the supervisor (and the CLI) read the two
meta pages with plain file I/O first, and a damaged store is moved aside, kept for inspection, and
replaced by a fresh one before any process maps it. Damage inside the file (pages that are not what
their tree says) shows only when a read or a write meets it, as CORRUPTION; its writer then sets the
store aside the same way while the server serves.

Meta page layout (lmdb.h / mdb.c, 64-bit builds): a 16-byte page header, then MDB_meta: magic (u32),
version (u32), address (8), mapsize (8), two MDB_db records of 48 bytes (the first one's leading u32 is
the page size), last used page number (u64), transaction id (u64). Meta page 0 is at offset 0, meta page
1 at offset page size; the valid one with the larger transaction id is current.
"""

from __future__ import annotations

import logging
import struct
import time
from pathlib import Path

from cachestore.env import DATA_FILE, DIR_MODE, LOCK_FILE
from cachestore.errors import StoreError

log = logging.getLogger("infercache.store")

MAGIC = 0xBEEFC0DE
_HEAD = struct.Struct("<II")       # magic, version at offset 16
_PSIZE = struct.Struct("<I")       # free DB's md_pad = page size, at offset 40
_TAIL = struct.Struct("<QQ")       # last page, txn id at offset 136
META_BYTES = 152
_MIN_PAGE, _MAX_PAGE = 512, 65536


def _meta(raw: bytes) -> tuple[int, int, int] | None:
    """(page size, last page, txn id) of one meta page, or None when it is not one."""
    if len(raw) < META_BYTES:
        return None
    magic, _ = _HEAD.unpack_from(raw, 16)
    (psize,) = _PSIZE.unpack_from(raw, 40)
    last_page, txn_id = _TAIL.unpack_from(raw, 136)
    if magic != MAGIC or not _MIN_PAGE <= psize <= _MAX_PAGE or psize & (psize - 1):
        return None
    return psize, last_page, txn_id


class NotADirectory(StoreError):
    """The store's folder is a file (or a file stands where one of its parents should be): nothing to
    move aside or replace, and no store can be opened there; the operator must say what it should be."""


def not_a_directory(store_dir: Path) -> str | None:
    """Why `store_dir` cannot be a store's folder (a file there, or in place of a parent); None if it can."""
    for path in (store_dir, *store_dir.parents):
        if path.exists():
            return None if path.is_dir() else f"{path} is a file, not a directory"
    return None


def problem(store_dir: Path) -> str | None:
    """Why the store's data file cannot be mapped safely; None when it can (or does not exist yet).
    NotADirectory when the store's folder is a file."""
    if (why := not_a_directory(store_dir)) is not None:
        raise NotADirectory(why)
    data = store_dir / DATA_FILE
    try:
        with open(data, "rb") as f:
            size = f.seek(0, 2)
            if size == 0:
                return None  # LMDB initializes an empty file as a new environment
            f.seek(0)
            first = _meta(f.read(META_BYTES))
            if first is None:
                return f"{data} does not start with an LMDB meta page ({size} bytes)"
            f.seek(first[0])
            second = _meta(f.read(META_BYTES))
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"{data} is unreadable: {exc}"
    psize, last_page, _ = max((m for m in (first, second) if m is not None), key=lambda m: m[2])
    needed = (last_page + 1) * psize
    if size < needed:
        return f"{data} is {size} bytes but its meta page claims {needed} ({last_page + 1} pages of {psize}): truncated"
    return None


def set_aside(store_dir: Path, why: str, what: str = "store") -> Path:
    """Moves a damaged store's files into a sibling folder of their own, `<name>.damaged-<time>` (returned),
    kept for inspection; the next open of `store_dir` starts a fresh store. Its data file first: a reader
    that opens the store meanwhile finds no data file (and tries again) rather than the old lock file
    beside a new data file (cachestore/env.py checks that too)."""
    stamp = time.strftime("%Y%m%dT%H%M%S")
    aside = store_dir.with_name(f"{store_dir.name}.damaged-{stamp}")
    n = 1
    while aside.exists():  # (a second replacement within the second)
        n += 1
        aside = store_dir.with_name(f"{store_dir.name}.damaged-{stamp}-{n}")
    aside.mkdir(mode=DIR_MODE, parents=True)  # a damaged store still holds users' answers
    moved = []
    for name in (DATA_FILE, LOCK_FILE):
        if (store_dir / name).exists():
            (store_dir / name).rename(aside / name)
            moved.append(name)
    log.error("%s damaged (%s); moved %s to %s and starting a fresh one", what, why, " and ".join(moved) or "nothing",
              aside)
    return aside


def quarantine_if_damaged(store_dir: Path, what: str = "store") -> Path | None:
    """Sets a damaged store aside (set_aside) so a fresh store starts; None when the store is sound. Only
    the process that owns the store calls this, before anyone maps it. NotADirectory: see problem."""
    why = problem(store_dir)
    return None if why is None else set_aside(store_dir, why, what)
