"""The greedy pick straight from an LM head: argmax over x @ W^T for a row or two, with an id map applied, in one
launch, the logits never written.

Why: a greedy chain's draft level needs only the argmax of its head's logits. As a GEMM, then an argmax over the
device (`kernels.row_argmax`, two launches, the id map inside), it is three launches and a [rows, N] write and
read for one token id, and on a GPU each launch costs microseconds of a draft step that is launch-bound.
`naive.py` is the reference (the projection rounded to the model's dtype, then torch.argmax's first maximum).
`triton.py` streams the head once: each program's rows end in a partial (max, first index), and the last program
to finish merges the partials."""

from __future__ import annotations

import torch

from longspec.kernels.gemv.rows import MAX_ROWS
from longspec.kernels.head_argmax.naive import head_argmax_naive

__all__ = ["MAX_ROWS", "head_argmax", "head_argmax_naive", "head_argmax_triton"]


def head_argmax(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """`head_argmax_naive`'s result: the Triton kernel on CUDA for at most MAX_ROWS rows of a 16-bit dtype
    (imported on first use), the reference elsewhere."""
    rows = x.numel() // max(x.shape[-1], 1)
    if x.is_cuda and x.dtype in (torch.float16, torch.bfloat16) and rows <= MAX_ROWS:
        from longspec.kernels.head_argmax.triton import head_argmax_triton

        return head_argmax_triton(x, weight, bias, ids)
    return head_argmax_naive(x, weight, bias, ids)


def __getattr__(name):
    # The Triton kernel is imported on first use so that importing this package never imports Triton.
    if name == "head_argmax_triton":
        from longspec.kernels.head_argmax.triton import head_argmax_triton

        return head_argmax_triton
    raise AttributeError(name)
