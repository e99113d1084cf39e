"""Flash-noisy cross-attention (docs/ALGORITHM.md §3.3): the drafter attends to the target's KV with a lag.

Shape legend: B batch, H query heads, Hkv key/value heads, T tokens, D head dim.

At inference the target KV cache is only updated after verification, so a drafter token at position t sees
target KV at positions <= t - j for some lag j >= 1. Training reproduces that with one lag per forward:

    out[:, :, j:] = attention(q[:, :, j:], k[:, :, :T-j], v[:, :, :T-j], causal)    out[:, :, :j] = 0

The shifted causal attention (bottom-right aligned, square) gives query t exactly the keys <= t - j, with no
explicit mask, so the fast causal kernels (FlashAttention) still apply.
"""

from __future__ import annotations

import torch

from longspec.modules.attention import attention

__all__ = ["flash_noisy_attention", "sample_lag"]


def flash_noisy_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lag: int,
    *,
    scale: float | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """q [B,H,T,D], k/v [B,Hkv,T,D] (the same T positions) -> out [B,H,T,D]; query t sees keys <= t - lag,
    the first `lag` outputs are zero."""
    T = q.shape[2]
    if k.shape[2] != T or v.shape[2] != T:
        raise ValueError(
            f"flash-noisy attention needs target KV for the same {T} positions, got {k.shape[2]}"
        )
    if lag < 0:
        raise ValueError(f"lag must be >= 0, got {lag}")
    if lag == 0:
        return attention(q, k, v, causal=True, scale=scale, backend=backend)[0]
    if lag >= T:
        return torch.zeros_like(q)
    out, _ = attention(
        q[:, :, lag:], k[:, :, : T - lag], v[:, :, : T - lag], causal=True, scale=scale, backend=backend
    )
    # Rows < lag have no visible key; they are constants, so autograd flows only through `out`.
    return torch.cat([q.new_zeros(*q.shape[:2], lag, out.shape[-1]), out], dim=2)


def sample_lag(num_draft_levels: int = 5, *, generator: torch.Generator | None = None) -> int:
    """Draw the training lag j ~ U{1, ..., γ-1} for γ = `num_draft_levels` (ALGORITHM §3.3: γ=5 → j in 1..4).

    A host-side int (it sets slice bounds); draw it from a CPU generator so no device sync happens."""
    if num_draft_levels < 2:
        raise ValueError(f"num_draft_levels must be >= 2 to draw a lag in 1..γ-1, got {num_draft_levels}")
    return int(torch.randint(1, num_draft_levels, (), generator=generator).item())
