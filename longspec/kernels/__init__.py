"""Triton kernels, each beside its plain-PyTorch float32 reference (`<name>/naive.py`).

Importing this package is cheap: Triton itself is imported only when a kernel module is first used, so
`TRITON_INTERPRET=1` (Triton's CPU interpreter, used by the CPU tests) may be set any time before that.
"""

from __future__ import annotations

import importlib.util
import os

import torch

__all__ = ["HAS_TRITON", "triton_interpreting", "triton_runs_on"]

HAS_TRITON = importlib.util.find_spec("triton") is not None


def triton_interpreting() -> bool:
    """True when Triton's CPU interpreter is requested (read by `triton.jit` when a kernel is defined)."""
    return os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "yes", "on", "y")


def triton_runs_on(device: torch.device) -> bool:
    """Whether our Triton kernels can run on tensors of this device: CUDA, or CPU under the interpreter."""
    return HAS_TRITON and (device.type == "cuda" or (device.type == "cpu" and triton_interpreting()))
