"""Reference row argmax (the semantics `triton.py` follows)."""

from __future__ import annotations

import torch

__all__ = ["row_argmax_naive"]


def row_argmax_naive(x: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
    """[...] int64: the first index of each row's maximum over the last dim of x [..., V]; a row holding a NaN
    gives its first NaN's index (torch.argmax's rule). With `ids` [V] (an id map, e.g. draft -> target ids), the
    index's id instead."""
    index = torch.argmax(x, dim=-1)
    return index if ids is None else ids[index]
