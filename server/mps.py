"""A private CUDA MPS daemon for worker processes that share a GPU.

Without MPS, the CUDA contexts of several processes on one GPU are time-sliced: one process's
kernels run at a time, and each switch costs. With MPS (NVIDIA's Multi-Process Service), every client
process submits through one server context, so their kernels run side by side: on an H200, four
workers through MPS carried as many MiniLM texts/s as time-sliced ones or more, with the GPU less busy.

The supervisor starts the control daemon in the foreground as its own child (`nvidia-cuda-mps-control
-f`) with a pipe and log directory inside the server's private socket directory, before any worker, and
sets CUDA_MPS_PIPE_DIRECTORY in its own environment so that every child it spawns reaches that daemon
(frontends and writers never create a CUDA context; the variable costs them nothing). The daemon is
private: other processes on the host, which do not name its pipe directory, keep plain contexts. It
changes no device setting (compute mode stays as it is). It runs in a session of its own (a Ctrl-C
meant for the server must not stop it under workers that are still finishing), is told to end with the
supervisor where `setpriv` can arrange it (a supervisor killed with -9), and is stopped with the control
command `quit` after the workers have stopped; a daemon that dies meanwhile is started again before
the next worker start.

The MPS server numbers the GPUs it sees from 0 (the supervisor's CUDA_VISIBLE_DEVICES, in that order):
a worker then names its GPU by that position (WorkerPlacement.ordinal), not by its id.

Where CUDA_MPS_PIPE_DIRECTORY is already set, an operator runs MPS: that daemon is used, none started
(its visible GPUs must be the supervisor's).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import time
from pathlib import Path

from cachestore.env import DIR_MODE

log = logging.getLogger("infercache.mps")

CONTROL = "nvidia-cuda-mps-control"
PIPE_ENV, LOG_ENV = "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"
START_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 5.0  # the workers have stopped by then: nothing keeps it


class MpsUnavailable(RuntimeError):
    pass


def wanted(mode: str, gpus_shared: bool) -> bool:
    """Whether to start a daemon: workers share a GPU, nobody runs MPS for us yet, and the mode allows
    it (`mps` also when the control program is missing: the start then fails loudly)."""
    if mode == "timeslice" or not gpus_shared or os.environ.get(PIPE_ENV):
        return False
    return mode == "mps" or shutil.which(CONTROL) is not None


def _ended_with_parent() -> list[str]:
    """A prefix that has the command sent SIGTERM when its parent dies (-9 included): util-linux's
    setpriv where it is installed and knows --pdeathsig (2.33 and later), else none."""
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        return []
    prefix = [setpriv, "--pdeathsig", "TERM", "--"]
    try:
        if subprocess.run([*prefix, "true"], capture_output=True, timeout=5).returncode == 0:
            return prefix
    except (OSError, subprocess.SubprocessError):
        pass
    return []


class MpsDaemon:
    """One control daemon, a child of the supervisor (see the module docstring)."""

    def __init__(self, directory: Path) -> None:
        self.pipe_dir = directory / "mps-pipe"
        self.log_dir = directory / "mps-log"
        self.process: subprocess.Popen | None = None

    def _env(self) -> dict[str, str]:
        return {**os.environ, PIPE_ENV: str(self.pipe_dir), LOG_ENV: str(self.log_dir)}

    def start(self) -> None:
        """Starts the daemon and waits until its control pipe exists; MpsUnavailable when it cannot."""
        binary = shutil.which(CONTROL)
        if binary is None:
            raise MpsUnavailable(f"{CONTROL} is not installed (server.gpu_sharing: mps needs the NVIDIA driver's "
                                 "utilities in the image)")
        shutil.rmtree(self.pipe_dir, ignore_errors=True)  # a dead daemon's pipes would pass for ours
        for path in (self.pipe_dir, self.log_dir):
            path.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        output = self.log_dir / "control-output.txt"  # what it prints in the foreground (a file: never a full pipe)
        command = [*_ended_with_parent(), binary, "-f"]
        try:
            with output.open("ab") as sink:
                self.process = subprocess.Popen(command, env=self._env(), stdin=subprocess.DEVNULL, stdout=sink,
                                                stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as exc:
            raise MpsUnavailable(f"cannot start {CONTROL}: {exc}") from None
        give_up = time.monotonic() + START_TIMEOUT_S
        while not (self.pipe_dir / "control").exists():
            if self.process.poll() is not None:
                said = output.read_text(errors="replace").strip()[-500:]
                code, self.process = self.process.returncode, None
                raise MpsUnavailable(f"{CONTROL} exited with code {code}: {said or 'no message'}")
            if time.monotonic() > give_up:
                self.stop()
                raise MpsUnavailable(f"{CONTROL} made no control pipe in {START_TIMEOUT_S:.0f} s")
            time.sleep(0.02)
        os.environ[PIPE_ENV], os.environ[LOG_ENV] = str(self.pipe_dir), str(self.log_dir)  # for the children
        log.info("CUDA MPS daemon started (pid %d, pipe %s): the workers sharing a GPU run side by side",
                 self.process.pid, self.pipe_dir)

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self) -> None:
        """`quit` through the control pipe (the daemon stops its servers), then waits; kills it if it lingers
        (STOP_TIMEOUT_S in all)."""
        if self.process is None:
            return
        if self.process.poll() is None:
            give_up = time.monotonic() + STOP_TIMEOUT_S
            try:
                subprocess.run([shutil.which(CONTROL) or CONTROL], input=b"quit\n", env=self._env(),
                               capture_output=True, timeout=STOP_TIMEOUT_S)
                self.process.wait(max(0.1, give_up - time.monotonic()))
            except (OSError, subprocess.SubprocessError):
                self.process.kill()
                self.process.wait()
        self.process = None
