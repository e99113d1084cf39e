"""benchmarks/mask_attn_sweep.py at tiny shapes on the CPU (Triton's interpreter): every launch configuration it
times gives the default's output, and the JSON holds what it printed."""

import json
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the script imports the kernel

pytest.importorskip("triton")


def test_sweep_times_each_configuration_and_checks_it(load_benchmark, tmp_path, monkeypatch):
    sweep = load_benchmark("mask_attn_sweep")
    monkeypatch.setenv("OUT", str(tmp_path))
    rows = sweep.main(["--tiny", "--block-n", "16", "32", "--num-warps", "4", "--iters", "1", "--calls", "2"])
    assert [r["case"] for r in rows] == list(sweep.TINY)
    for row in rows:
        assert sorted(row["ms_by_config"]) == ["16x4", "32x4"]
        assert row["max_abs_diff"] < 1e-5 and row["default_ms"] > 0
        assert row["best"] in row["ms_by_config"]
    written = json.loads((tmp_path / "mask_attn_sweep.json").read_text())
    assert [r["case"] for r in written["rows"]] == list(sweep.TINY)
