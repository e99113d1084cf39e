"""The index of each row's largest value over a vocabulary: every greedy pick of a round (the target's choice
at T = 0 in the AR step and the verify, the drafter's chain levels) and a sampled chain's draw per level (the
exponential race's winner, argmax of q / E). `naive.py` is the reference (`torch.argmax`, whose CUDA reduction
gives a row one thread block, far slower than the row's bytes need); `triton.py` spreads each row over the
device in two launches."""

from __future__ import annotations

import torch

from longspec.kernels.row_argmax.naive import row_argmax_naive

__all__ = ["row_argmax", "row_argmax_naive", "row_argmax_triton"]


def row_argmax(x: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
    """argmax over the last dim with torch.argmax's result (first index of the maximum; a NaN counts as the
    maximum), or with `ids` [V] that index's id (a drafter's draft -> target id map, applied in the same launch):
    the Triton kernels on CUDA (imported on first use), the reference elsewhere."""
    if x.is_cuda and x.dtype.is_floating_point:
        from longspec.kernels.row_argmax.triton import row_argmax_triton

        return row_argmax_triton(x, ids)
    return row_argmax_naive(x, ids)


def __getattr__(name):
    # The Triton kernel is imported on first use so that importing this package never imports Triton.
    if name == "row_argmax_triton":
        from longspec.kernels.row_argmax.triton import row_argmax_triton

        return row_argmax_triton
    raise AttributeError(name)
