"""What every child process does the same way: logging, the event loop, and graceful stop on SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from typing import Awaitable, Callable


def setup_logging(level: str, role: str) -> None:
    logging.basicConfig(
        level=level.upper(), stream=sys.stderr, force=True,
        format=f"%(asctime)s %(levelname)s [{role}] %(name)s: %(message)s",
    )


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
