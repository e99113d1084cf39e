"""modules.cpu_projection: the few-row CPU route (the weight as the GEMM's left operand) against F.linear, and the
choice between the two, with the timer stubbed (which route is faster is the machine's business; that the
choice follows the timings, once per shape, is the module's)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from longspec.modules import cpu_projection, layer_ops


@pytest.fixture
def fresh(monkeypatch):
    """An empty route table, so each test chooses anew, and every weight big enough to be measured."""
    monkeypatch.setattr(cpu_projection, "_chosen", {})
    monkeypatch.setattr(cpu_projection, "MIN_WEIGHT_BYTES", 0)


@pytest.mark.parametrize("rows", [1, 2, 3, 16])
@pytest.mark.parametrize("bias", [False, True])
def test_weight_left_is_f_linear(rows, bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(40, 24, generator=g)
    b = torch.randn(40, generator=g) if bias else None
    x = torch.randn(rows, 24, generator=g)
    got = cpu_projection.weight_left(x, w, b)
    assert got.shape == (rows, 40) and got.is_contiguous()
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def _timer(slower: str, factor: float, calls: list):
    def timer(route, fn):
        calls.append(route)
        fn()  # the candidate really runs
        return factor if route == slower else 1.0

    return timer


@pytest.mark.parametrize(
    ("slower", "factor", "want"),
    [("linear", 1.3, "weight_left"), ("linear", 1.1, "linear"), ("weight_left", 2.0, "linear")],
)
def test_weight_left_only_where_it_wins_by_the_margin(fresh, slower, factor, want):
    w, x = torch.randn(32, 8), torch.randn(1, 3, 8)
    calls = []
    with torch.no_grad():
        out = cpu_projection.few_rows_linear(x, w, timer=_timer(slower, factor, calls))
    torch.testing.assert_close(out, F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert out.shape == (1, 3, 32)
    assert sorted(calls) == ["linear", "weight_left"]
    assert cpu_projection.chosen_routes() == {
        ((32, 8), 3, torch.float32, torch.get_num_threads(), False): want
    }


def test_one_measurement_per_shape_and_row_count(fresh):
    w = torch.randn(32, 8)
    calls = []
    timer = _timer("linear", 2.0, calls)
    with torch.no_grad():
        for rows in (2, 2, 5, 2, 5):
            cpu_projection.few_rows_linear(torch.randn(rows, 8), w, timer=timer)
        cpu_projection.few_rows_linear(
            torch.randn(2, 8), w, torch.zeros(32), timer=timer
        )  # a bias: its own key
    assert len(calls) == 6  # 3 keys x 2 routes
    assert set(cpu_projection.chosen_routes().values()) == {"weight_left"}


def test_no_route_outside_its_domain(fresh, monkeypatch):
    w = torch.randn(32, 8)

    def never(route, fn):
        raise AssertionError("nothing is measured here")

    with torch.no_grad():
        assert cpu_projection.few_rows_linear(torch.randn(17, 8), w, timer=never) is None  # > MAX_ROWS
        assert cpu_projection.few_rows_linear(torch.randn(2, 8, dtype=torch.float64), w, timer=never) is None
    assert cpu_projection.few_rows_linear(torch.randn(2, 8), w, timer=never) is None  # autograd on: training
    monkeypatch.setattr(cpu_projection, "MIN_WEIGHT_BYTES", w.numel() * 4 + 1)
    with torch.no_grad():
        assert cpu_projection.few_rows_linear(torch.randn(2, 8), w, timer=never) is None  # a small weight


def test_layer_ops_and_the_lm_head_take_the_route(fresh, monkeypatch):
    """linear, linear_silu_mul and head_logits go through the chosen route (here: always weight_left, recorded);
    a head that is not a plain nn.Linear runs itself."""
    taken = []

    def recording(x, w, b=None):
        taken.append(tuple(w.shape))
        return F.linear(x, w, b)

    monkeypatch.setattr(cpu_projection, "weight_left", recording)
    monkeypatch.setattr(
        cpu_projection, "_median_seconds", lambda route, fn: 2.0 if route == "linear" else 1.0
    )
    head = nn.Linear(8, 50, bias=False)
    x = torch.randn(1, 2, 8)
    with torch.no_grad():
        torch.testing.assert_close(layer_ops.head_logits(head, x), head(x))
        layer_ops.linear(x, torch.randn(12, 8))
        layer_ops.linear_silu_mul(x, torch.randn(12, 8))
        assert layer_ops.head_logits(nn.Sequential(head), x).shape == (1, 2, 50)  # runs itself: no route
    # the head, the projection and gate/up (the projection's key: measured once) each ran weight_left
    assert taken == [(50, 8), (12, 8), (12, 8)]
