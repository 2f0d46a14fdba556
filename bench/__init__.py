"""`make bench`: latency, throughput and start-up figures against baselines measured in the same run.

Every result file is named for what it measures and the machine it ran on (`bench/results/l2-2core.json`,
`gpu-h200.json`) and records, under `recorded`, the command, the machine, the commit and the date.
"""

import os
import platform
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

from harness.servers import REPO

# The Banking77 train split (bench/data/banking77/: its licence and source beside it). BENCH_BANKING77 names
# another copy (not an INFERCACHE_ variable: the server reads those as settings).
BANKING77 = Path(os.environ.get("BENCH_BANKING77", REPO / "bench" / "data" / "banking77" / "train.csv"))
# Where result files go: BENCH_RESULTS names another folder (bench/device.sh: the device's $OUT).
RESULTS = Path(os.environ.get("BENCH_RESULTS", REPO / "bench" / "results"))
# Where `--quick` and `--dry-run` files go: a folder git ignores (they replace no figure of bench/results/).
TRIAL_RESULTS = Path(os.environ.get("BENCH_RESULTS", REPO / "var" / "bench"))


def banking77_missing() -> str:
    """"" where the Banking77 train split is in place, else one line saying where it was looked for."""
    if BANKING77.is_file():
        return ""
    return f"{BANKING77} is missing (the repository keeps it in bench/data/banking77/; BENCH_BANKING77 names a copy)"


def _gpu_names() -> list[str]:
    """The GPUs' names from nvidia-smi (no CUDA context), [] without one."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else []


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict:
    """What a result file says of the machine; `tag` ends its name: the GPU's model and count (`h200`,
    `h100`, `h200x2`: "NVIDIA H100 80GB HBM3" is an h100), else the cores (`2core`)."""
    cpus, gpus = os.cpu_count() or 1, _gpu_names()
    if gpus:
        words = gpus[0].split()
        chip = next((w for w in words if re.fullmatch(r"[A-Za-z]+\d{2,4}[A-Za-z]?", w)), words[-1])
        tag = chip.lower() + (f"x{len(gpus)}" if len(gpus) > 1 else "")
    else:
        tag = f"{cpus}core"
    return {"tag": tag, "cpus": cpus, "cpu_model": _cpu_model(), "gpus": gpus, "python": platform.python_version()}


def _commit() -> str:
    """BENCH_COMMIT where set (bench/device.sh: the device's copy has no reliable git metadata), else git's."""
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git)"
    if head.returncode != 0:
        return "unknown (no git)"
    return head.stdout.strip() + (" with uncommitted changes" if dirty.stdout.strip() else "")


def recorded(module: str) -> dict:
    """The `recorded` block of a result file: command (BENCH_COMMAND where a wrapper sets it), machine,
    commit, date."""
    command = os.environ.get("BENCH_COMMAND") or shlex.join(["python", "-m", module, *sys.argv[1:]])
    info = machine()
    gpus = f", {len(info['gpus'])} x {info['gpus'][0]}" if info["gpus"] else ""
    return {"command": command,
            "machine": f"{info['tag']}: {info['cpus']} CPUs ({info['cpu_model']}){gpus}, Python {info['python']}",
            "commit": _commit(), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def ratio(a: float, b: float, digits: int = 3) -> float | None:
    """a / b rounded; None where b is 0 (a run too short to measure it: a dry run's CPU seconds, say)."""
    return round(a / b, digits) if b else None


def proportion(agreed: int, n: int) -> dict:
    """A rate with its 95% Wilson interval (None where n is 0)."""
    from server.worker.semantic.calibration import wilson_lower, wilson_upper

    return {"rate": round(agreed / n, 4) if n else None, "n": n, "agreed": agreed,
            "interval95": [round(wilson_lower(agreed, n), 4), round(wilson_upper(agreed, n, 1.96), 4)] if n else None}


def default_out(stem: str) -> Path:
    """bench/results/<stem>-<machine tag>.json."""
    return RESULTS / f"{stem}-{machine()['tag']}.json"
