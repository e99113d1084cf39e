"""Which code produced a result: the commit stamped into every report and benchmark JSON.

A copy of the tree without a current .git (the GPU device gets the working tree, not the history) names its commit
in LONGSPEC_COMMIT; launch/gpu_e2e.sh and benchmarks/gpu_suite.sh set it from a `.git_rev` file written next to
the tree (`git rev-parse HEAD > .git_rev`) when there is one.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys

__all__ = ["git_commit", "run_info"]

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def git_commit(*, short: bool = True, dirty: bool = True) -> str:
    """LONGSPEC_COMMIT if set, else `git rev-parse HEAD` of this checkout (+"+dirty" when tracked files are
    modified and `dirty`); "unknown" without git."""
    stamped = os.environ.get("LONGSPEC_COMMIT", "").strip()
    if stamped:
        return stamped[:7] if short and len(stamped) == 40 else stamped
    try:
        args = ["rev-parse", "--short", "HEAD"] if short else ["rev-parse", "HEAD"]
        commit = _git(*args)
        if commit and dirty and _git("status", "--porcelain", "--untracked-files=no"):
            commit += "+dirty"
        return commit or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _git(*args: str) -> str:
    result = subprocess.run(["git", "-C", _ROOT, *args], capture_output=True, text=True, timeout=10)
    return result.stdout.strip() if result.returncode == 0 else ""


def run_info(*, device=None, argv: list[str] | None = None) -> dict:
    """What every benchmark JSON starts with: UTC date, the command, the commit, torch and the device.

    argv: the script's arguments when main() was called with its own list (default sys.argv[1:])."""
    import torch

    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python", sys.argv[0], *(sys.argv[1:] if argv is None else argv)]),
        "commit": git_commit(),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
    }
