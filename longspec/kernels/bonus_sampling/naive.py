"""Reference draw of a sampled chain round's bonus token (the semantics `triton.py` follows).

Shape legend: B rows, N chain nodes (root first), M nodes with a draft distribution q, V vocabulary.
"""

from __future__ import annotations

import torch

__all__ = ["inverse_cdf", "sample_bonus_naive"]


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Indices [...] drawn from unnormalised `weights` [..., V] with uniforms u [...]: the first index whose
    cumulative weight exceeds u x the total (a zero weight is never drawn). Device only, no host read."""
    cdf = torch.cumsum(weights.double(), dim=-1)
    index = torch.searchsorted(cdf, (u * cdf[..., -1]).unsqueeze(-1), right=True)
    return index.squeeze(-1).clamp(max=weights.shape[-1] - 1)


def sample_bonus_naive(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    stop: torch.Tensor,
    rejected: torch.Tensor,
    token: torch.Tensor,
    u: torch.Tensor,
) -> torch.Tensor:
    """bonus [B]: one draw per row, with uniform u [B], from node stop[b]'s residual.

    target_probs [B, N, V] (p per node); draft_probs [B, M, V] (q per node, recursive rejection sampling) or None
    (the deterministic-candidates rule); stop [B] the node the walk stopped at; rejected [B] whether it stopped on
    a rejected draft (else: a leaf, or an invalid child: the bonus comes from p); token [B] that draft (read by the
    deterministic rule only). The residual after a rejection is max(p - q, 0) (rrs; p itself when that has no mass:
    acceptance was certain, the branch is never taken) or p without the draft (deterministic; p itself when nothing
    is left, a draft that held all the mass rejected only through rounding)."""
    batch, _, vocab = target_probs.shape
    p = target_probs.gather(1, stop[:, None, None].expand(batch, 1, vocab))[:, 0].double()
    if draft_probs is None:
        after = p.scatter(-1, token[:, None], 0.0)
    else:
        row = stop.clamp(max=draft_probs.shape[1] - 1)  # a row that rejected has a q (stop < depth)
        q = draft_probs.gather(1, row[:, None, None].expand(batch, 1, vocab))[:, 0].double()
        after = (p - q).clamp(min=0)
    use = rejected[:, None] & (after.sum(-1, keepdim=True) > 0)
    return inverse_cdf(torch.where(use, after, p), u)
