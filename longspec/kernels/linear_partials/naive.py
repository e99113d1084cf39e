"""Reference split-K projection (the semantics `triton.py` follows) and the value both return."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["SplitK", "linear_partials_naive"]


@dataclass(frozen=True)
class SplitK:
    """A projection's output [..., N] held as float32 partial sums over S slices of K: partials [S, M, N] (M the
    leading dims flattened); `dtype` the output's, `shape` its [..., N]. Its value is `sum()`: the partials added
    in float32 and rounded once."""

    partials: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype

    @property
    def device(self) -> torch.device:
        return self.partials.device

    @property
    def is_cuda(self) -> bool:
        return self.partials.is_cuda

    def sum(self) -> torch.Tensor:
        return self.partials.sum(0).to(self.dtype).view(self.shape)


def linear_partials_naive(x: torch.Tensor, weight: torch.Tensor) -> SplitK:
    """x [..., K] @ weight [N, K]^T in float32, as one partial (S = 1): the value every split of K sums to."""
    rows = x.reshape(-1, x.shape[-1]).float()
    product = rows @ weight.float().T
    return SplitK(product[None], torch.Size((*x.shape[:-1], weight.shape[0])), x.dtype)
