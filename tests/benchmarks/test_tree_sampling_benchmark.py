import importlib.util
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_tiny_mode_checks_the_kernel_and_writes_a_table(tmp_path):
    """CPU (interpreter): both rules at batch 1 and 2; the script itself refuses a kernel that differs from the
    reference, so a written row means path, length and residual matched. Its own process: Triton chooses the
    interpreter when a kernel module is first imported, and this process may have imported it already."""
    env = {**os.environ, "OUT": str(tmp_path), "TRITON_INTERPRET": "1", "PYTHONPATH": ROOT}
    script = os.path.join(ROOT, "benchmarks", "tree_sampling.py")
    done = subprocess.run([sys.executable, script, "--tiny"], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "tree_sampling.json").read_text())
    rows = [(r["batch"], r["rule"]) for r in result["rows"]]
    assert rows == [(1, "rrs"), (1, "deterministic"), (2, "rrs"), (2, "deterministic")]
    assert all(r["equal"] and r["reference_ms"] > 0 and r["kernel_ms"] > 0 for r in result["rows"])
    assert any(r["mean_length"] > 1 for r in result["rows"])  # some walks accept a child
    assert "| vocab | batch | rule | mean walk length |" in done.stdout
