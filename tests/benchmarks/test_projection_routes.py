"""benchmarks/projection_routes.py at a tiny shape on the CPU: both weight layouts compute the same product, every
row is timed, the JSON holds what it printed; the candidate split-K GEMV (Triton's interpreter) sums to the
product."""

import json
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the route's kernel is defined


def test_routes_agree_and_are_timed(load_benchmark, tmp_path, monkeypatch):
    routes = load_benchmark("projection_routes")
    monkeypatch.setenv("OUT", str(tmp_path))
    rows = routes.main(["--tiny", "--rows", "1", "3", "--iters", "1"])
    assert [(r["projection"], r["rows"]) for r in rows] == [("qkv", 1), ("qkv", 3), ("down", 1), ("down", 3)]
    for row in rows:
        assert row["max_abs_diff"] < 1e-4
        assert row["linear_us"] > 0 and row["transposed_us"] > 0 and row["floor_us"] > 0
        assert "partials_us" not in row  # the Triton route is timed on CUDA only
    written = json.loads((tmp_path / "projection_routes.json").read_text())
    assert written["rows"] == json.loads(json.dumps(rows))


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("splits", [1, 3, 8])  # K = 300 in tiles of 128: with 8 splits five are empty
def test_partials_sum_to_the_product(load_benchmark, rows, splits):
    pytest.importorskip("triton")
    routes = load_benchmark("projection_routes")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    wide = torch.full((70, 336), float("nan"))  # weight rows read through their stride, never past K
    wide[:, :300] = torch.randn(70, 300)
    weight = wide.to(device)[:, :300]
    x = torch.randn(rows, 300, device=device)
    got = routes._partials_route()(x, weight, {"BLOCK_N": 32, "BLOCK_K": 128, "splits": splits})
    assert got.shape == (splits, rows, 70) and torch.isfinite(got).all()
    torch.testing.assert_close(got.sum(0), x @ weight.T, rtol=1e-5, atol=1e-4)
    if splits == 8:
        assert (got[3:] == 0).all()
