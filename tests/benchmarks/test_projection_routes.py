"""benchmarks/projection_routes.py at a tiny shape on the CPU: both weight layouts compute the same product, every
row is timed, the JSON holds what it printed. (Its GEMV routes run on CUDA only; the kernels are tested in
tests/kernels/test_gemv.py.)"""

import json


def test_routes_agree_and_are_timed(load_benchmark, tmp_path, monkeypatch):
    routes = load_benchmark("projection_routes")
    monkeypatch.setenv("OUT", str(tmp_path))
    rows = routes.main(["--tiny", "--rows", "1", "3", "--iters", "1"])
    assert [(r["projection"], r["rows"]) for r in rows] == [("qkv", 1), ("qkv", 3), ("down", 1), ("down", 3)]
    for row in rows:
        assert row["max_abs_diff"] < 1e-4
        assert row["linear_us"] > 0 and row["transposed_us"] > 0 and row["floor_us"] > 0
    written = json.loads((tmp_path / "projection_routes.json").read_text())
    assert written["rows"] == json.loads(json.dumps(rows))
