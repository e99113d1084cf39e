"""Linux /proc helpers for the tests that kill a launcher and check its workers (imported by name: tests/ is on
sys.path under pytest)."""

import os

__all__ = ["child_pids", "pid_running"]


def child_pids(pid: int) -> list[int]:
    """Pids whose parent is `pid` (Linux /proc): the workers of a launcher, for tests that kill it."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(entry))
            except (OSError, ValueError, IndexError):
                pass  # gone while we looked
    return found


def pid_running(pid: int) -> bool:
    """The process exists and is not a zombie (an orphan nobody reaped yet has stopped running)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
