"""How the attention kernels read a bool mask: rows padded to 16 bytes, so each row's tile loads as wide vectors.
Triton-free, so that callers can lay a mask out once (e.g. a verify forward, for all its layers) without
importing a kernel.
"""

from __future__ import annotations

import torch

__all__ = ["aligned_rows"]


def aligned_rows(mask: torch.Tensor) -> torch.Tensor:
    """A bool mask [..., Tq, Tk] with the same values and unit key stride, its rows aligned to 16 bytes: the mask
    itself when it is laid out so already, else a view of a padded copy."""
    if mask.stride(-1) == 1 and mask.stride(-2) % 16 == 0 and mask.data_ptr() % 16 == 0:
        return mask
    num_keys = mask.shape[-1]
    padded = mask.new_zeros(*mask.shape[:-1], num_keys + (-num_keys % 16))
    padded[..., :num_keys] = mask
    return padded[..., :num_keys]
