"""Small index tensors that the decode steps use every round, made once per (size, device).

On the GPU every op of a round is a kernel launch, inside or outside its CUDA graph; a round that should cost
about one AR step cannot spend them rebuilding the same `arange`. The tensors are shared: read only."""

from __future__ import annotations

import functools

import torch

__all__ = ["arange_once", "zeros_once"]


@functools.lru_cache(maxsize=256)
def arange_once(n: int, device: torch.device | str) -> torch.Tensor:
    """arange(n) (int64) on `device`, made on first use and shared after."""
    return torch.arange(n, device=device)


@functools.lru_cache(maxsize=256)
def zeros_once(n: int, device: torch.device | str) -> torch.Tensor:
    """zeros(n) (int64) on `device`, made on first use and shared after."""
    return torch.zeros(n, dtype=torch.long, device=device)
