"""Reference greedy chain acceptance (the semantics `triton.py` follows; `longspec.infer.accept` uses its
pieces for every greedy tree).

Shape legend: B sequences (any leading dims where noted), N chain nodes (root + depth drafts).
"""

from __future__ import annotations

import torch

__all__ = [
    "chain_packed_naive",
    "emitted_tokens",
    "greedy_chain_packed_naive",
    "greedy_chain_path",
    "sample_chain_decide_naive",
]


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
    _, length, bonus = greedy_chain_path(tokens, target_argmax, valid, tokens.shape[-1] - 1)
    return chain_packed_naive(tokens, length, bonus), bonus


def chain_packed_naive(tokens: torch.Tensor, length: torch.Tensor, bonus: torch.Tensor) -> torch.Tensor:
    """A chain round's packed output row from its outcome: tokens [B, N] (root first), length [B] (the accepted
    path's nodes, the root included), bonus [B] -> [B, 2N + 1] = emitted tokens (`emitted_tokens`), path
    (0, 1, ..., N - 1), count."""
    N = tokens.shape[1]
    path = torch.arange(N, device=tokens.device).expand(tokens.shape[0], N)
    return torch.cat([emitted_tokens(tokens, path, length, bonus), path, length[:, None]], dim=1)


def sample_chain_decide_naive(
    tokens: torch.Tensor,
    valid: torch.Tensor,
    target_probs: torch.Tensor,
    draws: torch.Tensor,
    threshold: torch.Tensor | None = None,
    draft_probs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A sampled chain's decisions (`infer.accept.sample_chain_path`, depth = N - 1 >= 1): draft i + 1 (if valid)
    is accepted iff u_i t_i < p_i(x), float64, with t_i = q_i(x) (draft_probs [B, >= depth, V]: recursive
    rejection sampling) or the given `threshold` [B, depth] float64 (the deterministic rule's sum of p_i); the
    chain stops at the first draft not accepted. tokens / valid [B, N], target_probs [B, N, V], draws [B, >= depth]
    -> (stop [B]: the node it stops at, rejected [B] bool: its child was tried and rejected, token [B]: that
    child's token, clamped to the last draft where there is none)."""
    depth = tokens.shape[1] - 1
    drafts = tokens[:, 1:, None]  # [B, depth, 1]
    p_draft = target_probs[:, :depth].gather(-1, drafts)[..., 0].double()  # p_i(x_(i+1))
    if draft_probs is not None:
        threshold = draft_probs[:, :depth].gather(-1, drafts)[..., 0].double()
    accept = (draws[:, :depth] * threshold < p_draft) & valid[:, 1:]
    stop = accept.long().cumprod(-1).sum(-1)  # [B]: the leading run of accepted drafts, the node it stops at
    # Its child, if any, was rejected (a leaf has none; an invalid child was never tried).
    rejected = (stop < depth) & valid.gather(1, (stop + 1).clamp(max=depth)[:, None])[:, 0]
    token = tokens.gather(1, stop.clamp(max=depth - 1)[:, None] + 1)[:, 0]
    return stop, rejected, token
