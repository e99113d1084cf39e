"""modules.layer_ops' projection route: which calls go to the few-row GEMV (`kernels.gemv`) and which to F.linear.
The rule is checked here with the device test and the kernels stubbed (the kernels themselves are compared with
their references in tests/kernels/test_gemv.py, and run in the target on the GPU tests)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from longspec.kernels import gemv
from longspec.modules import layer_ops


@pytest.fixture
def routes(monkeypatch):
    """Every call on "CUDA" (the device test stubbed), the GEMVs recording their calls and computing F.linear."""
    calls = []
    monkeypatch.setattr(layer_ops, "use_triton", lambda x: True)

    def fake_gemv(x, w, b=None, *, residual=None):
        calls.append(("gemv", x.numel() // x.shape[-1]))
        out = F.linear(x, w, b)
        return out if residual is None else residual + out

    def fake_gemv_silu_mul(x, w, b=None):
        calls.append(("gemv_silu_mul", x.numel() // x.shape[-1]))
        return layer_ops.kernels.silu_mul_naive(F.linear(x, w, b))

    monkeypatch.setattr(gemv, "gemv", fake_gemv, raising=False)
    monkeypatch.setattr(gemv, "gemv_silu_mul", fake_gemv_silu_mul, raising=False)
    monkeypatch.setattr(layer_ops, "silu_mul", layer_ops.kernels.silu_mul_naive)
    return calls


def test_one_row_goes_to_the_gemv_in_16_bit_only(routes):
    w = torch.randn(8, 16, dtype=torch.bfloat16)
    x = torch.randn(1, 1, 16, dtype=torch.bfloat16)
    torch.testing.assert_close(layer_ops.linear(x, w), F.linear(x, w))
    assert routes == [("gemv", 1)]
    layer_ops.linear(x.float(), w.float())  # float32: cuBLAS, every row count
    layer_ops.linear(torch.randn(3, 16, dtype=torch.bfloat16), w)  # three rows: cuBLAS
    assert routes == [("gemv", 1)]


def test_two_rows_only_for_small_weights(routes, monkeypatch):
    w = torch.randn(8, 16, dtype=torch.float16)
    x = torch.randn(2, 16, dtype=torch.float16)
    layer_ops.linear(x, w)
    monkeypatch.setattr(gemv, "TWO_ROW_MAX_BYTES", w.numel() * w.element_size() - 1)
    layer_ops.linear(x, w)  # now "large": cuBLAS
    layer_ops.linear(x[:1], w)  # one row: the GEMV at any size
    assert routes == [("gemv", 2), ("gemv", 1)]


def test_fused_mlp_half_and_plain_linear_modules(routes):
    gate_up = torch.randn(12, 16, dtype=torch.bfloat16)
    x = torch.randn(1, 16, dtype=torch.bfloat16)
    want = layer_ops.kernels.silu_mul_naive(F.linear(x, gate_up))
    torch.testing.assert_close(layer_ops.linear_silu_mul(x, gate_up), want)
    layer_ops.linear_silu_mul(
        torch.randn(4, 16, dtype=torch.bfloat16), gate_up
    )  # four rows: F.linear + silu_mul
    proj = nn.Linear(16, 8, dtype=torch.bfloat16)
    torch.testing.assert_close(layer_ops.project(proj, x), proj(x))

    class Adapted(nn.Linear):  # a subclass (a quantised / adapted linear) runs its own forward
        def forward(self, inp):
            return super().forward(inp) * 2

    adapted = Adapted(16, 8, dtype=torch.bfloat16)
    torch.testing.assert_close(layer_ops.project(adapted, x), adapted(x))
    assert routes == [("gemv_silu_mul", 1), ("gemv", 1)]


def test_a_residual_rides_the_route(routes):
    # project(module, x, residual): residual + module(x), inside the GEMV where it runs, after cuBLAS elsewhere.
    down = torch.nn.Linear(16, 8, bias=False).to(torch.bfloat16)
    residual = torch.randn(1, 8, dtype=torch.bfloat16)
    for x in (torch.randn(1, 16, dtype=torch.bfloat16), torch.randn(3, 16, dtype=torch.bfloat16)):
        res = residual.expand(x.shape[0], 8)
        torch.testing.assert_close(
            layer_ops.project(down, x, res), res + F.linear(x, down.weight), rtol=0, atol=0
        )
    assert routes == [("gemv", 1)]  # three rows went to cuBLAS, its add after


def test_the_greedy_pick_is_one_launch_for_one_or_two_rows_of_a_plain_head(routes, monkeypatch):
    # head_pick: the fused head + argmax (kernels.head_argmax, stubbed here by its reference) for 1-2 rows of a
    # 16-bit nn.Linear; every other call the head's logits, then row_argmax. Both give the same ids.
    from longspec.kernels.head_argmax import head_argmax_naive

    def fake_head_argmax(x, w, b=None, ids=None):
        routes.append(("head_argmax", x.numel() // x.shape[-1]))
        return head_argmax_naive(x, w, b, ids)

    monkeypatch.setattr(layer_ops, "head_argmax", fake_head_argmax)
    gen = torch.Generator().manual_seed(0)
    head = nn.Linear(16, 50, bias=False, dtype=torch.bfloat16)
    ids = torch.randperm(500, generator=gen)[:50]
    for rows in (1, 2, 3):
        x = torch.randn(rows, 1, 16, generator=gen).bfloat16()
        want = ids[layer_ops.head_logits(head, x).argmax(-1)]
        assert torch.equal(layer_ops.head_pick(head, x, ids), want)
    x = torch.randn(1, 16, generator=gen)
    head32 = nn.Linear(16, 50, bias=False)
    assert torch.equal(layer_ops.head_pick(head32, x), head32(x).argmax(-1))  # float32: the logits route
    assert torch.equal(
        layer_ops.head_pick(nn.Sequential(head32), x), head32(x).argmax(-1)
    )  # not a plain head
    assert [r for r in routes if r[0] == "head_argmax"] == [("head_argmax", 1), ("head_argmax", 2)]
