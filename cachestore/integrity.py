"""Checks an LMDB data file against its own meta pages before anything maps it.

LMDB maps the file and trusts it: a data file shorter than the pages its newest meta page claims (a
truncated copy, a disk that filled during a restore) makes the first read past its end a SIGBUS, which
kills the process and which no Python `except` can catch. So the supervisor (and the CLI) read the two
meta pages with plain file I/O first, and a damaged store is moved aside, kept for inspection, and
replaced by a fresh one before any process maps it.

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

from cachestore.env import DIR_MODE

log = logging.getLogger("infercache.store")

DATA_FILE = "data.mdb"
LOCK_FILE = "lock.mdb"
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


def problem(store_dir: Path) -> str | None:
    """Why the store's data file cannot be mapped safely; None when it can (or does not exist yet)."""
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


def quarantine_if_damaged(store_dir: Path) -> Path | None:
    """Moves a damaged store's files into a sibling folder (returned) so a fresh store starts; None
    when the store is sound. Only the process that owns the store calls this, before anyone maps it."""
    why = problem(store_dir)
    if why is None:
        return None
    aside = store_dir.with_name(f"{store_dir.name}.damaged-{time.strftime('%Y%m%dT%H%M%S')}")
    aside.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)  # a damaged store still holds users' answers
    for name in (DATA_FILE, LOCK_FILE):
        if (store_dir / name).exists():
            (store_dir / name).rename(aside / name)
    log.error("result store damaged (%s); moved it to %s and starting a fresh one", why, aside)
    return aside
