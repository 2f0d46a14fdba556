"""The room a store may take (the write-behind's, cachestore/writer.py): its effective byte budget (the
configured one, or less on a disk too small for it), how many operations one commit may take, blocks held
ahead of the data file, and evicting down to the budget."""

from __future__ import annotations

import logging
import os
import shutil
from collections import Counter

import lmdb

from cachestore import diskspace, results
from cachestore.env import Store

log = logging.getLogger("infercache.writer")

LOW_WATER = 0.9  # eviction brings usage down to this fraction of the budget (EVICT_PER_OP at a time)
# A commit evicts at most EVICT_PER_OP times the operations a commit may take: more than it can put, so
# a full store still comes down to a lower budget, over several commits when the budget falls a lot.
EVICT_PER_OP = 2
EVICT_STEP = 32  # entries evicted between two looks at the live size (big records: a few fill the budget)
# On a disk smaller than the budget the data file, not the budget, is the limit: it must stay below
# DISK_SHARE of the disk it can use (its own size plus the free space), the rest being headroom (readers
# that keep old pages alive, the lock file, other files). The file holds the live pages plus the pages of
# the last few commits: copy-on-write gives every page a commit touches a new copy, and the old one is
# reusable only two commits later. Under random keys a put or a delete touches about one leaf page of its
# own (more when a page splits), whatever the record's size, so the live budget is the share less
# CHURN_COMMITS commits of the most operations and evictions one may take, at PAGES_PER_OP pages each
# (1.0-1.4 pages per operation measured with 1.5 KB records). Re-checked after every commit, so it
# shrinks before the disk fills and grows back, up to the configured budget, when space returns.
DISK_SHARE = 0.7
CHURN_COMMITS = 3
PAGES_PER_OP = 2
# Where that room is short (the configured budget does not fit beside the churn of full-size commits, or
# less than a runway is free), commits take at most SMALL_COMMIT_OPS operations: less churn, more budget.
SMALL_COMMIT_OPS = 32
# Blocks held ahead of the data file's end (cachestore/diskspace.py), within the disk share: room for the
# copy-on-write pages of the next commits that another process filling the disk cannot take.
RUNWAY = 16 * 1024 * 1024


class StoreSpace:
    """The write-behind's view of its room; called from its one writing thread, given the store it writes
    (which a damaged one's replacement changes)."""

    def __init__(self, store: Store, batch_max: int, counters: Counter[str]) -> None:
        self.batch_max = batch_max
        self.counters = counters       # the write-behind's (budget_bytes, held_bytes, hold_errors)
        self.budget = store.settings.budget  # the effective budget: the configured one, or less on a small disk
        self.holding = True            # the file system can hold blocks ahead of the file
        self.commit_ops = batch_max    # operations one commit may take: batch_max, or SMALL_COMMIT_OPS
        self.check(store)

    @property
    def evict_chunk(self) -> int:
        """Entries one eviction or sweep commit takes at most."""
        return EVICT_PER_OP * self.commit_ops

    def check(self, store: Store) -> None:
        """Sets the effective budget and the commit size from the disk (see DISK_SHARE) and holds blocks
        ahead of the data file (RUNWAY); logs when the budget changes by more than a tenth or crosses the
        configured one."""
        configured = store.settings.budget
        data_path = store.settings.path / "data.mdb"
        try:
            free = shutil.disk_usage(store.settings.path).free
            stat = os.stat(data_path)
        except OSError:
            return
        held = diskspace.allocated_bytes(stat)
        usable = free + held  # what this store may count on: its own blocks and the free ones
        self._hold(store, data_path, stat.st_size, held, free, usable)
        share = int(usable * DISK_SHARE)
        ops = self.batch_max
        if free < RUNWAY or configured > share - self._churn(store, ops):
            ops = min(ops, SMALL_COMMIT_OPS)
        self.commit_ops = ops
        budget = min(configured, max(0, share - self._churn(store, ops)))
        if abs(budget - self.budget) > self.budget / 10 or (budget == configured) != (self.budget == configured):
            mb = 1024 * 1024
            if budget < configured:
                log.warning("store budget limited by the disk: %.0f MiB (configured %.0f MiB; %.0f MiB free)",
                            budget / mb, configured / mb, free / mb)
            else:
                log.info("store budget back to the configured %.0f MiB", configured / mb)
        self.budget = budget
        self.counters["budget_bytes"] = budget

    def _hold(self, store: Store, data_path, size: int, held: int, free: int, usable: int) -> None:
        """Keeps up to RUNWAY of blocks allocated past the file's end, within the disk share (one
        fallocate per quarter runway of growth)."""
        target = min(store.settings.map_size, size + RUNWAY, int(usable * DISK_SHARE), held + free)
        if not self.holding or target - held < RUNWAY // 4:
            return
        try:
            self.holding = diskspace.hold(data_path, target)
        except OSError as exc:
            self.counters["hold_errors"] += 1
            log.warning("could not hold disk blocks for the store: %s", exc)
            return
        if self.holding:
            self.counters["held_bytes"] = target
        else:
            log.info("this file system cannot hold blocks ahead of the store's data file; a disk filled by "
                     "another process stops the store's writes until space returns")

    def enforce(self, store: Store, txn: lmdb.Transaction, removed: list) -> tuple[int, bool]:
        """Once over the budget, evicts down to LOW_WATER of it, at most EVICT_PER_OP times the commit
        size per commit: the entries evicted, and whether that cap left the store still over the budget."""
        budget = self.budget
        if store.used_bytes(txn) <= budget:
            return 0, False
        evicted, most = 0, self.evict_chunk
        while evicted < most and store.used_bytes(txn) > budget * LOW_WATER:
            n = results.evict_oldest(store, txn, min(EVICT_STEP, most - evicted), removed)
            evicted += n
            if n == 0:
                break
        log.debug("evicted %d least-recently-stored entries to stay under %d bytes", evicted, budget)
        return evicted, evicted >= most and store.used_bytes(txn) > budget

    def _churn(self, store: Store, ops: int) -> int:
        """Bytes of pages the data file holds beyond the live ones with commits of `ops` operations."""
        return CHURN_COMMITS * (1 + EVICT_PER_OP) * ops * PAGES_PER_OP * store.page_size
