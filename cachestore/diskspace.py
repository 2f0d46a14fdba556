"""Disk blocks held for the store's data file before LMDB needs them.

LMDB grows its data file page by page as commits write new pages (copy-on-write: even a delete writes
new pages). When another process fills the disk, every later commit fails, deletes and Invalidate
included, until someone frees space. So the single writer keeps blocks allocated ahead of the file's end
with fallocate(2) and FALLOC_FL_KEEP_SIZE: the blocks belong to the file, nobody else can take them, and
the file's size (which LMDB and cachestore/integrity.py read) does not change. Linux only; elsewhere, or
on a file system without fallocate, nothing is held and the store works as before.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import sys

FALLOC_FL_KEEP_SIZE = 0x01

_fallocate = None
if sys.platform.startswith("linux"):
    _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    _fallocate = getattr(_libc, "fallocate", None)
    if _fallocate is not None:
        _fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
        _fallocate.restype = ctypes.c_int


def allocated_bytes(stat: os.stat_result) -> int:
    """Bytes the file holds on disk, blocks held beyond its end included."""
    return max(stat.st_size, stat.st_blocks * 512)


def hold(path: os.PathLike, nbytes: int) -> bool:
    """Allocates the file's blocks up to `nbytes` without changing its size (blocks it already has are
    kept). False when this platform or file system cannot; OSError for anything else (ENOSPC)."""
    if _fallocate is None:
        return False
    fd = os.open(path, os.O_RDWR)
    try:
        if _fallocate(fd, FALLOC_FL_KEEP_SIZE, 0, nbytes) == 0:
            return True
        code = ctypes.get_errno()
        if code in (errno.EOPNOTSUPP, errno.ENOSYS):
            return False
        raise OSError(code, os.strerror(code), str(path))
    finally:
        os.close(fd)
