"""The fields every benchmark row carries: date, commit, hardware and the command that produced it."""

from __future__ import annotations

import datetime
import platform
import shlex
import subprocess
import sys
from pathlib import Path

_REPO = Path(__file__).resolve().parent.parent


def commit() -> str:
    """The checkout's short commit (with ``+dirty`` for uncommitted changes), or ``unknown`` outside git;
    ``DEEPINFER_BENCH_COMMIT`` when set (a copied tree whose git metadata is stale)."""
    from deepinfer_npu import envs

    if envs.BENCH_COMMIT:
        return envs.BENCH_COMMIT
    try:
        sha = subprocess.run(["git", "-C", str(_REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(_REPO), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def hardware(device: str | None = None) -> str:
    """The accelerator's name when ``device`` is a CUDA device, else the host CPU."""
    if device is not None and str(device).startswith("cuda"):
        import torch

        return torch.cuda.get_device_name(torch.device(device))
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import os

    return f"{model}, {os.cpu_count()} cores"


def row_meta(device: str | None = None, argv: list[str] | None = None) -> dict[str, str]:
    """``{"date", "commit", "hardware", "command"}`` for one benchmark row."""
    # sys.orig_argv keeps "-m module" (sys.argv has the module's path instead)
    argv = list(getattr(sys, "orig_argv", sys.argv))[1:] if argv is None else argv
    return {
        "date": datetime.date.today().isoformat(),
        "commit": commit(),
        "hardware": hardware(device),
        "command": "python " + shlex.join(argv),
    }
