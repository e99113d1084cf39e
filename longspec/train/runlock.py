"""One trainer per run directory: `<run_dir>/train.lock`, held by rank 0 for the whole run.

The lock file holds {pid, host, started, start_ticks} (the last tells a reused pid from the holder). It is created atomically WITH its content (written to a temp file, then
`os.link`ed to the lock name, which fails if the name exists), so a trainer killed at any point leaves either no
lock or a complete one. A lock left behind by a dead process is stale:
  - same host, pid no longer alive -> taken over with a warning;
  - same host, pid alive           -> refused (another trainer is writing this run);
  - another host                   -> refused, since its pid cannot be checked from here, unless `force`
                                      (resume.force=true: the user asserts that run is dead).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from typing import Any

__all__ = ["LOCK_NAME", "RunLock", "RunLockedError"]

log = logging.getLogger("longspec.train")
LOCK_NAME = "train.lock"


class RunLockedError(ValueError):
    """Another trainer holds the run directory (a user error: one line, no traceback)."""


def _start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (Linux /proc), to tell a reused pid from the holder."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _holder_alive(holder: dict[str, Any]) -> bool:
    pid = int(holder.get("pid", -1))
    if pid <= 0 or not _pid_alive(pid):
        return False
    # Another start time: the pid was reused (e.g. a restarted container numbers its processes alike).
    ticks = holder.get("start_ticks")
    return ticks is None or _start_ticks(pid) in (None, ticks)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


class RunLock:
    def __init__(
        self,
        run_dir: str,
        *,
        name: str = LOCK_NAME,
        user: str = "trainer",
        dir_option: str = "output_dir",
        force_option: str | None = "resume.force=true",
    ):
        """`name`, `user`, `dir_option`, `force_option`: the lock file and what its messages call the holder, the
        option that picks another directory and the one that forces a takeover (None: none; the message says to
        remove the lock file). The pipeline locks its --out with them (longspec.pipeline.__main__)."""
        self.path = os.path.join(run_dir, name)
        self.user, self.dir_option, self.force_option = user, dir_option, force_option
        self.owner: dict[str, Any] = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": time.time(),
            "start_ticks": _start_ticks(os.getpid()),
        }

    def acquire(self, *, force: bool = False) -> None:
        """Take the lock or raise RunLockedError naming the holder. Takes over stale locks (see module doc)."""
        for _ in range(3):  # a takeover races other takers: the loser sees the winner's fresh lock next round
            if self._create():
                return
            holder = self._read()
            if holder == {}:  # released between our create and read: try again
                continue
            if holder is None:  # unreadable: not one of ours (ours are complete from the first byte)
                raise RunLockedError(
                    f"{self.path} exists but is not a lock this {self.user} wrote; remove it if no {self.user} "
                    "uses this directory"
                )
            where = f"pid {holder.get('pid')} on {holder.get('host')} since {_when(holder.get('started'))}"
            if holder.get("host") == self.owner["host"]:
                if _holder_alive(holder):
                    raise RunLockedError(
                        f"{os.path.dirname(self.path)} is in use by another {self.user} ({where}); wait for it or "
                        f"choose another {self.dir_option}"
                    )
                log.warning("taking over the stale lock %s (%s is gone)", self.path, where)
            elif force:
                log.warning("%s: taking over the lock %s held by %s", self.force_option, self.path, where)
            else:
                how = (
                    f"pass {self.force_option} to take it over"
                    if self.force_option
                    else f"remove {self.path}"
                )
                raise RunLockedError(
                    f"{os.path.dirname(self.path)} is locked by a {self.user} on another host ({where}); if that "
                    f"run is dead, {how}"
                )
            self._remove_if(holder)
        raise RunLockedError(f"could not take the lock {self.path}: other {self.user}s keep taking it")

    def release(self) -> None:
        """Remove the lock if it is still ours (a forced takeover elsewhere leaves the new holder's alone)."""
        self._remove_if(self.owner)

    def _create(self) -> bool:
        tmp = f"{self.path}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(self.owner, f)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(
                tmp, self.path
            )  # atomic, and fails if the lock exists (O_EXCL semantics, content included)
            return True
        except FileExistsError:
            return False
        finally:
            os.unlink(tmp)

    def _read(self) -> dict[str, Any] | None:
        try:
            with open(self.path) as f:
                holder = json.load(f)
        except FileNotFoundError:
            return {}
        except (OSError, ValueError):
            return None
        return holder if isinstance(holder, dict) else None

    def _remove_if(self, holder: dict[str, Any]) -> None:
        """Unlink the lock only while it still holds `holder` (rename first: never remove a newer taker's)."""
        moved = f"{self.path}.stale-{os.getpid()}"
        try:
            os.rename(self.path, moved)
        except FileNotFoundError:
            return
        try:
            with open(moved) as f:
                current = json.load(f)
        except (OSError, ValueError):
            current = None
        if current != holder:  # someone else's lock after all: put it back unless a new one exists
            try:
                os.link(moved, self.path)
            except FileExistsError:
                pass
        os.unlink(moved)


def _when(started: Any) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(started)))
    except (TypeError, ValueError):
        return "?"
