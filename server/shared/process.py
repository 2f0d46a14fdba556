"""What every child process does the same way: logging, the event loop, and graceful stop on SIGTERM."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Awaitable, Callable

from server.shared.printable import PrintableFormatter


def setup_logging(level: str, role: str) -> None:
    """One line per record, with what a client chose escaped (server/shared/printable.py)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(PrintableFormatter(f"%(asctime)s %(levelname)s [{role}] %(name)s: %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


# Allocations between the collector's young passes (CPython's default: 700). A worker keeps each computed
# item's flight until its write is committed (milliseconds: the writer fsyncs), so at 700 most of what a
# flight holds lived through two passes and was promoted, and passes over the promoted followed. The
# worker core with its real writer process (a 2-core host, 32 items per frame, fsync on): 25-27 us of
# CPU per item at 700, 22-24 at 10,000, 19-21 at 100,000, 19.5-20 with the collector off. A young pass
# over 100,000 objects takes 1-5 ms; only cyclic garbage waits for it (the rest is freed at once).
GC_YOUNG = 100_000


def settle_gc() -> None:
    """Once a process is up: what start-up loaded (modules, engines, models) leaves the collector's view
    (gc.freeze: never scanned again), and young passes come every GC_YOUNG allocations."""
    gc.freeze()
    gc.set_threshold(GC_YOUNG, 10, 10)


def lower_thread(by: int) -> None:
    """The calling thread `by` steps nicer than it is. Niceness is a thread's on Linux: the threads and
    processes this one starts inherit it, the others keep theirs. An executor's initializer: a CPU
    worker's engine work runs in such threads while its event loop keeps the frontends' priority."""
    try:
        os.setpriority(os.PRIO_PROCESS, 0, min(19, os.getpriority(os.PRIO_PROCESS, 0) + by))
    except OSError as exc:  # (a sandbox that refuses it): the thread runs on at its priority
        logging.getLogger("infercache.process").warning("could not lower a thread's priority: %s", exc)


def nicer_executor(by: int, max_workers: int | None = None, name: str = "") -> ThreadPoolExecutor:
    """A thread pool whose threads run `by` steps nicer than the thread that starts them (0: the same)."""
    if not by:
        return ThreadPoolExecutor(max_workers, thread_name_prefix=name)
    return ThreadPoolExecutor(max_workers, thread_name_prefix=name, initializer=lower_thread, initargs=(by,))


def run(main: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    """Runs main(stop) on uvloop (when installed); SIGTERM/SIGINT set `stop` so main can drain."""
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:  # pragma: no cover - uvloop is a pinned dependency
        runner = asyncio.run

    # Own process group: a terminal's Ctrl-C reaches only the supervisor, which stops the children in
    # order (frontends first, then the worker they depend on).
    os.setpgrp()
    parent = os.getppid()

    async def orphan_watch(stop: asyncio.Event) -> None:
        while not stop.is_set():  # the supervisor died without stopping us (kill -9): stop too
            if os.getppid() != parent:
                stop.set()
            await asyncio.sleep(1.0)

    async def wrapped() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        watch = loop.create_task(orphan_watch(stop))
        await main(stop)
        watch.cancel()

    runner(wrapped())
