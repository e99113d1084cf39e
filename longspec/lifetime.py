"""One lifetime: one writer per output directory, and no process outliving the one that started it.

Locks (`RunLock`). Whoever writes a directory holds a lock file in it while it does: the trainer
`<run_dir>/train.lock`, the pipeline `<out>/pipeline.lock`, a data prep `<out>/prep.lock` (`<file>.lock` beside a
file it appends to). The lock holds {pid, host, started, start_ticks} (the last tells a reused pid from the holder)
and is created atomically WITH its content (a temp file `os.link`ed to the lock name, which fails if the name
exists: O_EXCL semantics), so a writer killed at any point leaves either no lock or a complete one. A lock found is
  - held: same host, its pid alive with the same start time -> refused: the directory is neither reused nor
    deleted (`refuse_if_held` guards a removal);
  - stale: same host, its pid gone (or reused) -> taken over, with one line saying so;
  - foreign: another host, whose pids cannot be checked from here -> refused unless forced (the trainer's
    resume.force=true: the user asserts that run is dead).

Processes. Every child dies with the process that started it, SIGKILL of that one included:
  - a launcher of ours starts each child with `preexec_fn=child_preexec()`: between fork and exec the child asks the
    kernel for SIGKILL when its parent dies (Linux prctl PR_SET_PDEATHSIG), then checks that its parent is still the
    one that forked it (one that died before the call would otherwise go unnoticed);
  - torchrun / deepspeed start their workers themselves (in sessions of their own, so a kill of the launcher's
    process group misses them): a worker arms the same first thing (`die_with_launcher`), its parent checked
    against the one seen when this module was imported;
  - the fallback, where the signal cannot be asked for (not Linux) or never came: `child_env` names every launcher
    of ours above a child in LONGSPEC_LAUNCHERS, and the trainer calls `exit_if_orphaned` before each step.
Imports nothing heavy: `python -m longspec.train` imports this first thing, before torch.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

__all__ = [
    "LOCK_NAME",
    "RunLock",
    "RunLockedError",
    "refuse_if_held",
    "child_preexec",
    "child_env",
    "die_with_launcher",
    "orphaned",
    "exit_if_orphaned",
]

log = logging.getLogger("longspec.lifetime")
LOCK_NAME = "train.lock"  # the trainer's, in its run directory
LAUNCHERS_ENV = "LONGSPEC_LAUNCHERS"  # "pid:start_ticks,..." of the launchers of ours above this process
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_PARENT_AT_IMPORT = os.getppid()
_launcher: int | None = None  # the parent a worker armed against (die_with_launcher)


class RunLockedError(ValueError):
    """Another process holds the directory (a user error: one line, no traceback)."""


# ---- processes: alive, and which ---------------------------------------------------------------------------------
def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (Linux), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (Linux /proc), to tell a reused pid from the holder."""
    fields = _stat(pid)
    try:
        return int(fields[19]) if fields else None
    except (ValueError, IndexError):
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    fields = _stat(pid)
    return fields is None or fields[0] != "Z"  # a zombie (killed, not yet reaped) runs no more


def _alive(pid: int, ticks: int | None) -> bool:
    """`pid` runs and is the process that started at `ticks` (None: not known, the pid alone decides)."""
    if pid <= 0 or not _pid_alive(pid):
        return False
    # Another start time: the pid was reused (e.g. a restarted container numbers its processes alike).
    return ticks is None or start_ticks(pid) in (None, ticks)


# ---- locks -------------------------------------------------------------------------------------------------------
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
        remove the lock file)."""
        self.path = os.path.join(run_dir, name)
        self.user, self.dir_option, self.force_option = user, dir_option, force_option
        self.owner: dict[str, Any] = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": time.time(),
            "start_ticks": start_ticks(os.getpid()),
        }
        self.held = False

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def acquire(self, *, force: bool = False) -> None:
        """Take the lock or raise RunLockedError naming the holder. Takes over stale locks (see module doc)."""
        for _ in range(3):  # a takeover races other takers: the loser sees the winner's fresh lock next round
            if self._create():
                self.held = True
                return
            holder = self._read()
            if holder == {}:  # released between our create and read: try again
                continue
            if holder is None:  # unreadable: not one of ours (ours are complete from the first byte)
                raise RunLockedError(
                    f"{self.path} exists but is not a lock this {self.user} wrote; remove it if no {self.user} "
                    "uses this directory"
                )
            where = _where(holder)
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
        if self.held:
            self.held = False
            self._remove_if(self.owner)

    def _create(self) -> bool:
        # Not "*.tmp-*": a data prep sweeps those from its --out while it holds this lock
        tmp = f"{self.path}.new-{os.getpid()}"
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
        return _read_lock(self.path)

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


def refuse_if_held(path: str, what: str) -> None:
    """Before the directory of the lock file `path` (or the file it guards) is removed or rewritten by someone not
    holding the lock: RunLockedError while a live process, or one on another host, holds it; a stale lock is said
    in one line (it goes with what it guarded). `what` names the holder in the message ("trainer")."""
    holder = _read_lock(path)
    if holder == {}:
        return
    directory = os.path.dirname(path)
    if holder is None:
        raise RunLockedError(
            f"{path} exists but is not a lock this project wrote; remove it if nothing uses {directory}"
        )
    where = _where(holder)
    if holder.get("host") != socket.gethostname():
        raise RunLockedError(
            f"{directory} is locked by a {what} on another host ({where}); if that run is dead, remove {path}"
        )
    if _holder_alive(holder):
        raise RunLockedError(f"{directory} is in use by a {what} ({where}); wait for it or stop it first")
    log.warning("taking over the stale lock %s (%s is gone)", path, where)


def _read_lock(path: str) -> dict[str, Any] | None:
    """The lock's content; {} when there is none, None when it is not a lock (unreadable, not a JSON object)."""
    try:
        with open(path) as f:
            holder = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError):
        return None
    return holder if isinstance(holder, dict) else None


def _holder_alive(holder: dict[str, Any]) -> bool:
    try:
        pid = int(holder.get("pid", -1))
    except (TypeError, ValueError):
        return False
    return _alive(pid, holder.get("start_ticks"))


def _where(holder: dict[str, Any]) -> str:
    return f"pid {holder.get('pid')} on {holder.get('host')} since {_when(holder.get('started'))}"


def _when(started: Any) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(started)))
    except (TypeError, ValueError):
        return "?"


# ---- processes: die with the parent ------------------------------------------------------------------------------
def _prctl() -> Callable[..., int] | None:
    """libc's prctl (Linux), or None."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    return ctypes.CDLL(None, use_errno=True).prctl


def _arm(prctl: Callable[..., int], parent: int) -> bool:
    """SIGKILL this process when its parent dies; kill it now if `parent` is no longer its parent (re-parented:
    the parent died before the call). Async-signal-safe enough for a preexec_fn: one syscall, then os calls."""
    if prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        return False
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)
    return True


def child_preexec() -> Callable[[], None] | None:
    """A `preexec_fn` for subprocess.Popen: the child dies with this process (None off Linux: see module doc)."""
    prctl = _prctl()  # resolved here, before the fork: the child only calls it
    if prctl is None:
        return None
    parent = os.getpid()

    def arm() -> None:
        _arm(prctl, parent)

    return arm


def child_env(env: dict[str, str]) -> dict[str, str]:
    """`env` for a child of this process: this process added to LONGSPEC_LAUNCHERS (the per-step fallback)."""
    me = f"{os.getpid()}:{start_ticks(os.getpid()) or ''}"
    above = env.get(LAUNCHERS_ENV, "")
    return {**env, LAUNCHERS_ENV: f"{above},{me}" if above else me}


def die_with_launcher() -> bool:
    """A torchrun / deepspeed worker: arm SIGKILL-on-parent-death, killed now if the launcher is already gone (its
    parent changed since this module was imported). Returns whether it is armed (False off Linux; `orphaned` still
    compares the parent). Pid 1 is not taken for a dead launcher: in a container the launcher may be pid 1."""
    global _launcher
    _launcher = _PARENT_AT_IMPORT
    prctl = _prctl()
    return prctl is not None and _arm(prctl, _launcher)


def orphaned() -> str | None:
    """Why this process has outlived a launcher of ours (None while every one runs): the parent a worker armed
    against is gone, or a process of LONGSPEC_LAUNCHERS is."""
    if _launcher is not None and os.getppid() != _launcher:
        return f"its launcher (pid {_launcher}) is gone"
    for entry in filter(None, os.environ.get(LAUNCHERS_ENV, "").split(",")):
        pid, _, ticks = entry.partition(":")
        try:
            alive = _alive(int(pid), int(ticks) if ticks else None)
        except ValueError:
            continue  # not ours to judge
        if not alive:
            return f"the process that started it (pid {pid}) is gone"
    return None


def exit_if_orphaned() -> None:
    """Stop this process, one line on stderr, when a launcher of ours is gone (the fallback of the signal)."""
    reason = orphaned()
    if reason is not None:
        raise SystemExit(f"error: stopping: {reason}")
