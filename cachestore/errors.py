"""Exceptions of the store. Callers treat every one of them as a cache miss, never as a client error."""

import lmdb

# What LMDB raises for pages that are not what their tree says (a bad disk, a torn or partial copy, an
# overwrite): the store cannot be trusted any more. Its writer sets it aside and starts a fresh one while
# the server serves (cachestore/writer.py, cachestore/integrity.py set_aside).
CORRUPTION = (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.PanicError, lmdb.InvalidError)


def corrupted(exc: BaseException) -> bool:
    return isinstance(exc, CORRUPTION)


class StoreError(Exception):
    """The store cannot be used right now (missing, corrupt, wrong format, out of space)."""


class StoreFormatError(StoreError):
    """The store on disk was written by an incompatible format version; it is not trusted."""


class CorruptRecord(StoreError):
    """A record failed its checksum or does not parse; it is treated as absent."""


class Unsealable(CorruptRecord):
    """An encrypted payload that no loaded key opens (tampered, moved to another key, or its key was
    retired), or a payload whose sealing does not match the configuration (see cachestore/sealing.py)."""


class StoreDamaged(StoreError):
    """Opening the store met damaged pages (CORRUPTION): its writer sets it aside and starts a fresh one."""
