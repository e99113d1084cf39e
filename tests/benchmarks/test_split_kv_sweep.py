"""benchmarks/split_kv_sweep.py at tiny shapes on the CPU (Triton's interpreter): every split count it times gives
the default's output, in its tiles and in others, and the JSON holds what it printed."""

import json
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the script imports the kernel

pytest.importorskip("triton")


def test_sweep_times_each_split_count_and_checks_it(load_benchmark, tmp_path, monkeypatch):
    sweep = load_benchmark("split_kv_sweep")
    monkeypatch.setenv("OUT", str(tmp_path))
    rows = sweep.main(
        ["--tiny", "--splits", "1", "2", "4", "--iters", "1", "--tiles", "16x32", "--reduce-blocks", "2"]
    )
    assert [r["case"] for r in rows] == list(sweep.TINY)
    for row in rows:
        # 4 splits of a 384-slot cache in the default's 64-key tiles: under 2 tiles each; in 32-key tiles, 3
        # and the reduce merging 2 splits per load
        assert sorted(row["ms_by_splits"]) == ["1", "1/r2", "1@16x32", "2", "2/r2", "2@16x32", "4@16x32"]
        assert row["max_abs_diff"] < 1e-5 and row["default_ms"] > 0 and row["floor_ms"] > 0
        assert row["best_splits"] in row["ms_by_splits"]
    written = json.loads((tmp_path / "split_kv_sweep.json").read_text())
    assert [r["case"] for r in written["rows"]] == list(sweep.TINY)
