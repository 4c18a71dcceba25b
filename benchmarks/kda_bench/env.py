"""Where the run happens: the device, the commit and the versions the reports record."""
from __future__ import annotations

import datetime as _dt
import os
import platform
import re
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

import torch

from kda_bench.baselines import dist_version

REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


@dataclass(frozen=True)
class Device:
    """The device the suite runs on: an SM90 GPU, or the CPU (with why not the GPU)."""

    device: torch.device
    name: str
    sm90: bool
    why_not_sm90: str = ""


def detect_device(requested: str) -> Device:
    """``requested`` (e.g. "cuda:0") when it is an SM90 GPU, else the CPU with the reason."""
    if not torch.cuda.is_available():
        name = f"CPU ({platform.processor() or platform.machine()})"
        return Device(torch.device("cpu"), name, False, "torch.cuda.is_available() is False")
    dev = torch.device(requested)
    name = torch.cuda.get_device_name(dev)
    cap = torch.cuda.get_device_capability(dev)
    if cap == (9, 0):
        return Device(dev, name, True)
    return Device(torch.device("cpu"), name, False,
                  f"{name} has compute capability {cap[0]}.{cap[1]}, not 9.0")


def git_commit() -> str:
    """Env COMMIT, else `git rev-parse HEAD` (+dirty when tracked files changed), else unknown."""
    env = os.environ.get("COMMIT")
    if env:
        return env
    try:
        r = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                           text=True, timeout=10)
        sha = r.stdout.strip()
        if r.returncode != 0 or not re.fullmatch(r"[0-9a-f]{40}", sha):
            return "unknown (no git history here; set COMMIT=<sha>)"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=REPO_ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except Exception:
        return "unknown (git failed; set COMMIT=<sha>)"


def base_meta(device_name: str, baselines: list[dict[str, Any]]) -> dict[str, Any]:
    """Report header: device, date, commit, versions, the kernels (name, label, version, ...)."""
    versions = {b["name"]: b.get("version") for b in baselines}
    return {
        "device": device_name,
        "date": os.environ.get("BENCH_DATE") or _dt.date.today().isoformat(),
        "datetime_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "torch": torch.__version__,
        "triton": dist_version("triton"),
        "fla": versions.get("fla"),
        "flash_kda": versions.get("flashkda"),
        "cula": versions.get("cula"),
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "host": platform.node(),
        "argv": sys.argv[1:],
        "baselines": baselines,
    }
