"""Softmax over a vocabulary, row by row: every distribution a round samples from at T > 0 (the target's at the
verify's nodes and an AR step's, the drafter's q), through `infer.accept.target_distribution`. `naive.py` is the
reference (`torch.softmax`, whose CUDA kernel gives a row one thread block, far slower than the row's bytes
need); `triton.py` spreads each row over the device in two launches.

The kernel sums a row in another order than torch, so the two differ in the last bits. Losslessness does not rest
on torch's bits: every method (the AR baseline included) samples from the distribution this same function gives.
"""

from __future__ import annotations

import torch

from longspec.kernels.row_softmax.naive import row_softmax_naive

__all__ = ["row_softmax", "row_softmax_naive", "row_softmax_triton"]


def row_softmax(x: torch.Tensor) -> torch.Tensor:
    """softmax over the last dim of x [..., V] -> [..., V] float32: the Triton kernels on CUDA (imported on first
    use), the reference elsewhere."""
    if x.is_cuda and x.dtype.is_floating_point:
        from longspec.kernels.row_softmax.triton import row_softmax_triton

        return row_softmax_triton(x)
    return row_softmax_naive(x)


def __getattr__(name):
    # The Triton kernel is imported on first use so that importing this package never imports Triton.
    if name == "row_softmax_triton":
        from longspec.kernels.row_softmax.triton import row_softmax_triton

        return row_softmax_triton
    raise AttributeError(name)
