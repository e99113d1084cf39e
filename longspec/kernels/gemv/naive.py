"""Reference few-row projections: the semantics `triton.py` follows."""

from __future__ import annotations

import torch

from longspec.kernels.layer_ops.naive import silu_mul_naive

__all__ = ["gemv_naive", "gemv_silu_mul_naive"]


def gemv_naive(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T (+ bias [N]), summed in float32 and rounded once to x's dtype; with `residual`
    [..., N], residual + that rounded projection (an add in x's dtype)."""
    out = x.float() @ weight.float().T
    if bias is not None:
        out = out + bias.float()
    out = out.to(x.dtype)
    return out if residual is None else residual + out


def gemv_silu_mul_naive(
    x: torch.Tensor, gate_up: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """SiLU(x @ gate^T) * (x @ up^T) for gate_up [2F, K] (gate rows, then up rows) and bias [2F]: the packed
    projection rounded to x's dtype, then `silu_mul_naive` (F.silu rounded, the product rounded), as HF's MLP."""
    return silu_mul_naive(gemv_naive(x, gate_up, bias))
