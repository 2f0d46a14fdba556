"""The supervisor's socket folder: the workers' sockets, the children's published figures, the token set in
force, the MPS daemon's pipes.

Private to the server's user (0700) and locked while its supervisor runs: an flock on LOCK_FILE, which
names the supervisor's pid. The kernel drops the lock with the process, kill -9 included, and no child
holds it (they are spawned: the descriptor does not reach them). A temporary folder (server.socket_dir
unset) is removed when the supervisor stops; one left by a supervisor that did not stop is removed by the
next supervisor that starts on the host: a folder of this user's whose lock nobody holds. A configured
folder is reused, and refused to a second supervisor while the first holds it.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import tempfile
from pathlib import Path

from cachestore.env import DIR_MODE

log = logging.getLogger("infercache.supervisor")

PREFIX = "infercache-"
LOCK_FILE = "supervisor.lock"


class SocketDirBusy(RuntimeError):
    pass


def _locked(path: Path) -> int | None:
    """A descriptor holding LOCK_FILE's lock in `path`, or None when another process holds it."""
    fd = os.open(path / LOCK_FILE, os.O_RDWR | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def _holder(path: Path) -> str:
    try:
        return (path / LOCK_FILE).read_text().strip() or "?"
    except OSError:
        return "?"


def _lock(path: Path) -> int:
    """Takes the folder's lock. The file is made and locked under another name, then linked into place
    (which fails if one is there): a lock file that exists is held, or was held by a process now gone."""
    handle, temporary = tempfile.mkstemp(dir=path, prefix=f".{LOCK_FILE}.")  # (mode 0600)
    fcntl.flock(handle, fcntl.LOCK_EX)
    try:
        os.link(temporary, path / LOCK_FILE)
        fd = handle
    except FileExistsError:
        os.close(handle)
        fd = _locked(path)
        if fd is None:
            raise SocketDirBusy(f"server.socket_dir {path} is in use by another infercache supervisor "
                                f"(pid {_holder(path)}); give each server a folder of its own") from None
    finally:
        os.unlink(temporary)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def remove_abandoned(parent: Path) -> list[Path]:
    """Removes the temporary socket folders under `parent` that supervisors killed without stopping left:
    this user's, with a lock file nobody holds (the folders of live supervisors, of other users and of
    releases without the lock file are left alone). Returns what it removed."""
    removed = []
    for path in parent.glob(f"{PREFIX}*"):
        try:
            if path.is_symlink() or not path.is_dir() or path.stat().st_uid != os.getuid():
                continue
            fd = _locked(path)
        except OSError:  # no lock file (or it went meanwhile): not one to judge
            continue
        if fd is None:
            continue
        try:
            holder = _holder(path)
            shutil.rmtree(path, ignore_errors=True)
        finally:
            os.close(fd)
        log.warning("removed %s, left by a supervisor that did not stop (pid %s)", path, holder)
        removed.append(path)
    return removed


class SocketDir:
    """The folder (`path`), made and locked; `release()` at the supervisor's end."""

    def __init__(self, configured: str) -> None:
        if configured:
            self.path, self.temporary = Path(configured), False
            self.path.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        else:
            remove_abandoned(Path(tempfile.gettempdir()))
            self.path, self.temporary = Path(tempfile.mkdtemp(prefix=PREFIX)), True  # mkdtemp: 0700
        self._fd: int | None = _lock(self.path)

    def release(self) -> None:
        """Removes a temporary folder and lets go of the lock (a configured folder stays)."""
        if self._fd is None:
            return
        if self.temporary:
            shutil.rmtree(self.path, ignore_errors=True)
        os.close(self._fd)
        self._fd = None
