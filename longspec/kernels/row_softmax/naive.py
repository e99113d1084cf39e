"""Reference row softmax (the distribution `triton.py` computes)."""

from __future__ import annotations

import torch

__all__ = ["row_softmax_naive"]


def row_softmax_naive(x: torch.Tensor) -> torch.Tensor:
    """[..., V] float32: softmax over the last dim of x [..., V] (any float dtype), computed in float32. A -inf
    entry gives exactly 0; a row holding a NaN or a +inf, or with every entry -inf, is NaN throughout."""
    return torch.softmax(x.float(), dim=-1)
