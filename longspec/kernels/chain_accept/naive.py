"""Reference greedy chain acceptance (the semantics `triton.py` follows; `longspec.infer.accept` uses its
pieces for every greedy tree).

Shape legend: B sequences (any leading dims where noted), N chain nodes (root + depth drafts).
"""

from __future__ import annotations

import torch

__all__ = ["emitted_tokens", "greedy_chain_packed_naive", "greedy_chain_path"]


def greedy_chain_path(
    tokens: torch.Tensor, target_argmax: torch.Tensor, valid: torch.Tensor, depth: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`accept.greedy_path` for a chain (node i's parent is node i - 1: the drafter's chains, a lookup chain, a
    plain step's one node), without the tree walk: the accepted drafts are the leading run of drafts that equal
    the target's choice at their parent. tokens / target_argmax / valid [..., N = depth + 1] -> path [..., N]
    (0, 1, ..., depth: only the first `length` count), length [...] long, bonus [...] long."""
    match = (tokens[..., 1:] == target_argmax[..., :-1]) & valid[..., 1:]  # [..., depth]
    drafts = match.long().cumprod(-1).sum(-1)  # the leading run of matches
    path = torch.arange(depth + 1, device=tokens.device).expand(*tokens.shape[:-1], depth + 1)
    return path, drafts + 1, target_argmax.gather(-1, drafts[..., None])[..., 0]


def emitted_tokens(tokens: torch.Tensor, path: torch.Tensor, length: torch.Tensor, bonus: torch.Tensor):
    """The round's output on fixed shapes, over any leading batch dims: [..., depth + 1] = tokens of
    path[1:length] then the bonus, padded with the bonus (only the first `length` entries count)."""
    # path[1:], then path[0] in the last slot (never read: its index is >= length - 1)
    after_root = torch.roll(path, -1, dims=-1)
    index = torch.arange(path.shape[-1], device=path.device)
    return torch.where(index < length[..., None] - 1, tokens.gather(-1, after_root), bonus[..., None])


def greedy_chain_packed_naive(
    tokens: torch.Tensor, target_argmax: torch.Tensor, valid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """A greedy chain round's outcome per row: tokens (root first) / target_argmax / valid [B, N] ->
    (packed [B, 2N + 1] long = emitted tokens [N] (`emitted_tokens`), path [N], count; bonus [B])."""
    path, length, bonus = greedy_chain_path(tokens, target_argmax, valid, tokens.shape[-1] - 1)
    emitted = emitted_tokens(tokens, path, length, bonus)
    return torch.cat([emitted, path, length[:, None]], dim=1), bonus
