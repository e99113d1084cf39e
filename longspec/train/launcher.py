"""Workers die with their launcher. Imports nothing heavy: `python -m longspec.train` arms this first thing.

torch elastic starts workers in their own session, so `kill -9` of the launcher's process group misses them: they
would keep training (and writing the run directory) next to a relaunch. On Linux a worker asks the kernel for
SIGKILL when its parent dies (prctl PR_SET_PDEATHSIG). That only covers deaths after the call, so the parent is
checked right after arming: the one recorded when this module was imported (before torch and the rest load), and
pid 1, which adopts orphans when no subreaper does.
"""

from __future__ import annotations

import os
import signal
import sys

__all__ = ["die_with_launcher"]

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_PARENT_AT_IMPORT = os.getppid()


def die_with_launcher() -> bool:
    """Arm SIGKILL-on-parent-death for this process; kill it now if the launcher is already gone. Returns whether
    it is armed (False off Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        return False
    parent = os.getppid()
    if parent == 1 or parent != _PARENT_AT_IMPORT:  # re-parented: the launcher died before we armed
        os.kill(os.getpid(), signal.SIGKILL)
    return True
