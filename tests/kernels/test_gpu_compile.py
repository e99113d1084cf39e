"""Every Triton kernel compiles for the GPU (sm_90), checked on a machine without one: the kernel tests run again in
a process where Triton compiles instead of interpreting, each launch compiling its kernel for the launch's
arguments and running nothing (`_gpu_compile`). Every kernel of `longspec/kernels` must be launched there, and
none may fail to compile. Another target by hand, e.g. the A100's:

    TRITON_INTERPRET=0 LONGSPEC_GPU_COMPILE_ARCH=80 LONGSPEC_GPU_COMPILE_REPORT=r.json PYTHONPATH=tests/kernels \
        python -m pytest -q -n0 -p _gpu_compile -o addopts= --deselect tests/kernels/test_gpu_compile.py tests/kernels
"""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


def kernels() -> set[str]:
    """The launched kernels defined in longspec/kernels: `@triton.jit` functions named `*_kernel` (the others are
    device functions, compiled inside the kernels that call them)."""
    names = set()
    for path in (ROOT / "longspec" / "kernels").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel"):
                if any("jit" in ast.unparse(d) for d in node.decorator_list):
                    names.add(node.name)
    return names


@pytest.mark.slow
@pytest.mark.skipif(
    torch.cuda.is_available(), reason="on a GPU the kernel tests compile every kernel themselves"
)
def test_every_kernel_compiles_for_the_gpu(tmp_path):
    report = tmp_path / "compile.json"
    env = {
        **os.environ,
        "TRITON_INTERPRET": "0",
        "LONGSPEC_GPU_COMPILE_REPORT": str(report),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])),
    }
    command = [sys.executable, "-m", "pytest", "-q", "-n0", "-p", "_gpu_compile", "-o", "addopts=",
               "-p", "no:cacheprovider", "--deselect", str(Path(__file__).relative_to(ROOT)), str(HERE)]  # fmt: skip
    run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    # The tests' value checks fail there (nothing ran); 0 or 1 means the session itself ran to its end.
    assert run.returncode in (0, 1) and report.exists(), run.stdout[-3000:] + run.stderr[-3000:]
    record = json.loads(report.read_text())["kernels"]
    errors = {name: entry["errors"] for name, entry in record.items() if entry["errors"]}
    assert not errors, "kernels that do not compile for the GPU:\n" + json.dumps(errors, indent=1)[:4000]
    missing = kernels() - {name for name, entry in record.items() if entry["launches"]}
    assert not missing, f"kernels no test launches, so never compiled for the GPU: {sorted(missing)}"
