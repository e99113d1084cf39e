"""Reference greedy pick from a head (the semantics `triton.py` follows)."""

from __future__ import annotations

import torch

from longspec.kernels.gemv.naive import gemv_naive
from longspec.kernels.row_argmax.naive import row_argmax_naive

__all__ = ["head_argmax_naive"]


def head_argmax_naive(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """[...] int64: for each row of x [..., K], the first index of the largest of its logits x @ weight [N, K]^T
    (+ bias [N]), summed in float32 and rounded to x's dtype (`gemv_naive`), a NaN the largest (torch.argmax's
    rule); with `ids` [N] (a draft -> target id map), that index's id."""
    return row_argmax_naive(gemv_naive(x, weight, bias), ids)
