"""The peers the bench runs as servers: their virtualenvs, each pinned and apart from infercache's (their
pins clash with ours: PyTriton needs numpy < 2), made on first use under build/peers/ and again when the
pins change (where one cannot be made the bench says why and skips that peer); and their processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import psutil

from harness.servers import REPO

ROOT = REPO / "build" / "peers"

# PyTriton ships tritonserver, its Python backend and the local response cache; ONNX Runtime and the
# tokenizer at infercache's versions run the same MiniLM graph.
TRITON = ("nvidia-pytriton==0.7.0", "numpy==1.26.4", "onnxruntime==1.32.0", "tokenizers==0.23.3")
# infinity's torch engine and OpenAI-compatible server, at the versions its pins allow (numpy < 2,
# transformers <= 5.0, sentence-transformers < 4); torch is the interpreter's own where it has one (the
# GPU machine's CUDA build), else pip's.
INFINITY = ("infinity-emb[server,torch]==0.0.78", "sentence-transformers==3.4.1", "transformers==4.57.1",
            "numpy==1.26.4")
# LiteLLM's proxy (its `proxy` extra: FastAPI, uvicorn) and redis-py, which its Redis cache uses. The last
# release whose proxy extra is on PyPI as a whole (later ones need a litellm-proxy package it does not hold).
LITELLM = ("litellm[proxy]==1.81.16", "redis==8.2.0")


@dataclass(frozen=True)
class PeerEnv:
    python: Path          # the interpreter that runs the peer
    env: dict[str, str]   # its environment


class PeerServer:
    """A peer's server process, in a process group of its own (its children stop with it), its output in
    `log_path`."""

    def __init__(self, args: list[str], env: dict[str, str], workdir: Path, stop_signal: int = signal.SIGTERM) -> None:
        workdir.mkdir(parents=True)
        self.log_path = workdir / "server.log"
        self._log = self.log_path.open("wb")
        self.stop_signal = stop_signal
        self.proc = subprocess.Popen(args, env=env, cwd=workdir, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def wait_until(self, ready: Callable[[], bool], what: str, timeout_s: float = 300) -> None:
        """Polls ready() until it holds; stops the server and raises with its log's end when it exits or
        `timeout_s` passes first."""
        deadline = time.monotonic() + timeout_s
        while not ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{what} did not start: {self.log_path.read_text()[-2000:]}")
            time.sleep(0.2)

    def pids(self) -> list[int]:
        """The server's process and its descendants."""
        root = psutil.Process(self.proc.pid)
        return [root.pid, *(p.pid for p in root.children(recursive=True))]

    def stop(self) -> None:
        """The whole group, also where its leader is gone already (its children may not be)."""
        try:
            self._signal(self.stop_signal)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
            time.sleep(0.5)  # the children's own exit, after the leader's
            self._signal(signal.SIGKILL)
            self.proc.wait(10)
        finally:
            self._log.close()

    def _signal(self, number: int) -> None:
        try:
            os.killpg(self.proc.pid, number)
        except ProcessLookupError:  # no process of the group is left
            pass


def triton_env() -> PeerEnv | str:
    """PyTriton's virtualenv, or why there is none. Triton's Python backend runs the model in a stub
    process that loads this interpreter's shared libpython: the interpreter must be built with it, and the
    stub must find this one's before any other of the same minor version (a Debian libpython3.11 beside
    pyenv's 3.11 fails on a stdlib mismatch)."""
    if not sysconfig.get_config_var("Py_ENABLE_SHARED"):
        return f"Triton's Python backend loads libpython, and {sys.executable} is built without a shared one"
    libdir = sysconfig.get_config_var("LIBDIR")
    made = _made("triton", TRITON)
    if isinstance(made, str):
        return made
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = ":".join(p for p in (libdir, env.get("LD_LIBRARY_PATH", "")) if p)
    return PeerEnv(made, env)


def infinity_env() -> PeerEnv | str:
    """infinity over this interpreter's packages (torch), or why it cannot run: its virtualenv, or offline
    (the GPU machine: bench/device.sh sets PEER_WHEELS to the folder bench/device_carry.sh fills) the
    folder's wheels installed as they are, without resolving: the image's numpy 2 serves infinity, whose
    numpy < 2 pin is older than its code's needs."""
    wheels = os.environ.get("PEER_WHEELS")
    if wheels:
        return _unpacked("infinity", sorted(str(w) for w in Path(wheels).glob("*.whl")))
    made = _made("infinity", INFINITY, inherit=True)
    return made if isinstance(made, str) else PeerEnv(made, dict(os.environ))


def litellm_env() -> PeerEnv | str:
    """LiteLLM's proxy in its virtualenv (the python beside its `litellm` command), or why there is none.
    It reads its model price map from the package, not the network."""
    made = _made("litellm", LITELLM)
    if isinstance(made, str):
        return made
    return PeerEnv(made, {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_TELEMETRY": "False"})


def _unpacked(name: str, wheels: list[str]) -> PeerEnv | str:
    """`wheels` installed as they are (offline, no dependencies looked for) into a folder that goes first
    on this interpreter's path: no virtualenv to make (the GPU machine's Python may have no ensurepip)."""
    target = ROOT / f"{name}-site"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                           "--no-deps", "--no-index", "--upgrade", "--target", str(target), *wheels],
                          capture_output=True, text=True)
    if done.returncode != 0:
        return f"pip install of the {name} peer's wheels failed: {(done.stderr or done.stdout).strip()[-500:]}"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(target), env.get("PYTHONPATH", "")) if p)
    return PeerEnv(Path(sys.executable), env)


def _made(name: str, pins: tuple[str, ...], inherit: bool = False) -> Path | str:
    """The virtualenv `name` holding `pins` (its python), made or remade as needed; or why it failed.
    `inherit`: it sees this interpreter's packages too, after its own (a .pth file: --system-site-packages
    would show the base interpreter's, where this one is a virtualenv)."""
    home = ROOT / name
    python, stamp = home / "bin" / "python", home / "pins.txt"
    wanted = "\n".join((*pins, f"inherit={inherit}")) + "\n"
    if python.exists() and stamp.exists() and stamp.read_text() == wanted:
        return python
    print(f"  making the {name} peer's virtualenv ({', '.join(pins)}) ...", flush=True)
    base = getattr(sys, "_base_executable", sys.executable)
    done = subprocess.run([base, "-m", "venv", "--clear", str(home)], capture_output=True, text=True)
    if done.returncode != 0:
        return f"{base} -m venv failed: {(done.stderr or done.stdout).strip()[-500:]}"
    if inherit:
        paths = dict.fromkeys((sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]))
        site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              capture_output=True, text=True, check=True).stdout.strip()
        (Path(site) / "_inherited.pth").write_text("".join(f"{p}\n" for p in paths))
    done = subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *pins],
                          capture_output=True, text=True)
    if done.returncode != 0:
        return f"pip install of the {name} peer failed: {(done.stderr or done.stdout).strip()[-500:]}"
    stamp.write_text(wanted)
    return python
