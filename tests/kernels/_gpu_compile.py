"""A pytest plugin: every kernel launch of the kernel tests compiles the kernel for an NVIDIA GPU (sm_90) instead.

Why: on a machine without a GPU the kernel tests run Triton's interpreter, which executes a kernel's Python body
and never sees what the GPU compiler checks: a name that a loop carries with two types, a module global read in
a kernel that is not a `tl.constexpr`. Both have reached a GPU run as a compile error of every launch. Triton's
compiler itself (front end, LLVM, ptxas) needs no GPU, only a target: with this plugin (`-p _gpu_compile`, in a
process where Triton does not interpret) the active driver is `CompileOnly`, which names one and has no device,
and a launch compiles its kernel for the launch's arguments and runs nothing. The tests' value checks then see
unwritten outputs and mostly fail: what counts is the record written at the end (LONGSPEC_GPU_COMPILE_REPORT, a
JSON path): per kernel, its launches and the errors of those that did not compile (`test_gpu_compile.py` runs
it and reads the record).
"""

from __future__ import annotations

import json
import os

from triton.backends.compiler import GPUTarget
from triton.runtime import driver
from triton.runtime.jit import JITFunction

# Hopper (H100 / H200) unless LONGSPEC_GPU_COMPILE_ARCH names another compute capability (80: A100).
TARGET = GPUTarget("cuda", int(os.environ.get("LONGSPEC_GPU_COMPILE_ARCH", "90")), 32)
_RECORD: dict[str, dict] = {}


class CompileOnly:
    """A driver with a target and no device: kernels compile, nothing launches."""

    def __init__(self, target: GPUTarget):
        self.target = target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return self.target

    def is_active(self) -> bool:
        return True


def pytest_configure(config):
    driver.set_active(CompileOnly(TARGET))
    compile_ = JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        entry = _RECORD.setdefault(self.fn.__name__, {"launches": 0, "errors": []})
        try:
            kernel = compile_(self, *args, grid=grid, warmup=True, **kwargs)
        except Exception as error:  # recorded, and the test goes on as if the launch had run
            message = f"{type(error).__name__}: {error}"
            if message not in entry["errors"]:
                entry["errors"].append(message)
            return None
        entry["launches"] += 1
        return kernel

    JITFunction.run = run


def pytest_unconfigure(config):
    path = os.environ.get("LONGSPEC_GPU_COMPILE_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump({"target": str(TARGET), "kernels": _RECORD}, f, indent=1)
