"""benchmarks/cpu_projection.py on the code target's shapes: both routes compute the same product, each is timed,
the kept route follows the module's margin rule, and the JSON holds what it printed."""

import json

import torch

from longspec.modules import cpu_projection


def test_routes_agree_are_timed_and_kept_by_the_margin(load_benchmark, tmp_path, monkeypatch):
    bench = load_benchmark("cpu_projection")
    monkeypatch.setenv("OUT", str(tmp_path))
    rows = bench.main(["--shapes", "code_target", "--rows", "1", "3", "--reps", "1"])
    projections = ["qkv", "o", "gate_up", "down", "lm_head"]
    assert [(r["projection"], r["rows"]) for r in rows] == [(p, n) for p in projections for n in (1, 3)]
    for row in rows:
        assert row["max_abs_diff"] < 1e-3
        assert row["linear_us"] > 0 and row["weight_left_us"] > 0
        wins = row["linear_us"] >= cpu_projection.MARGIN * row["weight_left_us"]
        assert row["kept"] == ("weight_left" if wins else "linear")
    assert torch.is_grad_enabled()  # no global switch left behind
    written = json.loads((tmp_path / "cpu_projection.json").read_text())
    assert written["rows"] == json.loads(json.dumps(rows)) and written["threads"] >= 1
