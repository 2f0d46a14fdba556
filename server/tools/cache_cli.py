"""`infercache cache stats|readers`: operator views of the host's result store (read-only; safe while serving)."""

from __future__ import annotations

import lmdb

from cachestore import integrity, results
from cachestore.env import DB_RESULTS, DB_SEMLOG, Store
from cachestore.errors import StoreError
from server.config import Config, store_settings
from server.shared.printable import printable


def _open(config: Config) -> Store | None:
    try:
        why = integrity.problem(store_settings(config).path)
    except integrity.NotADirectory as exc:
        print(f"infercache: cache.dir {exc}: no store can be there (the server does not start with it)")
        return None
    if why is not None:  # mapping it could kill this process (SIGBUS)
        print(f"infercache: the store is damaged and was not opened: {why}; "
              "the server moves it aside at its next start")
        return None
    try:
        return Store(store_settings(config), readonly=True)
    except StoreError as exc:
        print(f"infercache: {exc}")
        return None


def _count_prefix(txn, db, prefix: bytes) -> int:
    count = 0
    with txn.cursor(db=db) as cursor:
        if cursor.set_range(prefix):
            for key in cursor.iternext(keys=True, values=False):
                if not bytes(key).startswith(prefix):
                    break
                count += 1
    return count


def stats(config: Config) -> int:
    store = _open(config)
    if store is None:
        return 2
    totals = store.stats()
    mb = 1024 * 1024
    by_class = ", ".join(f"{printable(name)} {count}" for name, count in sorted(totals["entries_by_class"].items()))
    print(f"store {store.settings.path}: {totals['entries']} entries{f' (by TTL class: {by_class})' if by_class else ''}, "
          f"{totals['used_bytes'] / mb:.1f} MiB live of a {totals['budget_bytes'] / mb:.0f} MiB budget "
          f"(map {totals['map_size_bytes'] / mb:.0f} MiB)")
    semlog = store.dbs.get(DB_SEMLOG)
    with store.begin() as txn:
        spaces = results.namespaces(store, txn)
        print(f"{'tenant':<24} {'model':<20} {'version':<8} {'entries':>9} {'indexed':>9}")
        for ns_id, ns in spaces:
            entries = _count_prefix(txn, store.dbs[DB_RESULTS], ns_id)
            indexed = _count_prefix(txn, semlog, ns_id) if semlog is not None else 0
            # Names as clients sent them: escaped (server/shared/printable.py), or a tenant could write
            # to the operator's terminal
            print(f"{printable(ns.tenant) or '(empty)':<24} {printable(ns.model):<20} {printable(ns.version):<8} "
                  f"{entries:>9} {indexed:>9}")
    store.close()
    return 0


def readers(config: Config) -> int:
    """LMDB's reader table: a stale reader (a process killed inside a read) pins old pages."""
    store = _open(config)
    if store is None:
        return 2
    print(store.env.readers().rstrip())
    store.close()
    return 0


def run(config: Config, command: str) -> int:
    """A store whose pages are damaged raises lmdb errors mid-read: a message and exit code 2, no traceback."""
    try:
        return stats(config) if command == "stats" else readers(config)
    except lmdb.Error as exc:
        print(f"infercache: the store at {config.cache.dir} is damaged: {exc}; a running server sets it aside "
              "and starts a fresh one once a read or a write meets the damage (so does moving it aside by hand, "
              "with the server stopped)")
        return 2
