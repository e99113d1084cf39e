"""A chain round's acceptance and output, each in one launch: the leading run of drafts that pass (at T = 0: equal
the target's choice at their parent, with the bonus after it; at T > 0: the sampled decisions, whose bonus
`kernels.bonus_sampling` draws) and the round's packed output row (emitted tokens, path, count) that the engine
copies to the host. Every round whose tree is one chain takes it: an AR step and a plain round (no drafts), the
drafter's chains, a prompt-lookup chain. `naive.py` is the reference (the rules in PyTorch: ~15 small launches
on CUDA at T = 0, ~25 at T > 0, each a launch in a launch-bound round); `triton.py` is one program per row."""

from __future__ import annotations

import torch

from longspec.kernels.chain_accept.naive import (
    chain_packed_naive,
    emitted_tokens,
    greedy_chain_packed_naive,
    greedy_chain_path,
    sample_chain_decide_naive,
)

__all__ = [
    "chain_packed",
    "chain_packed_naive",
    "emitted_tokens",
    "greedy_chain_packed",
    "greedy_chain_packed_naive",
    "greedy_chain_path",
    "sample_chain_decide",
    "sample_chain_decide_naive",
]


def greedy_chain_packed(
    tokens: torch.Tensor, target_argmax: torch.Tensor, valid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed [B, 2N + 1], bonus [B]) of `naive.greedy_chain_packed_naive`: the Triton kernel on CUDA (imported
    on first use), the reference elsewhere."""
    if tokens.is_cuda:
        from longspec.kernels.chain_accept.triton import greedy_chain_packed_triton

        return greedy_chain_packed_triton(tokens, target_argmax, valid)
    return greedy_chain_packed_naive(tokens, target_argmax, valid)


def chain_packed(tokens: torch.Tensor, length: torch.Tensor, bonus: torch.Tensor) -> torch.Tensor:
    """packed [B, 2N + 1] of `naive.chain_packed_naive`: the Triton kernel on CUDA, the reference elsewhere."""
    if tokens.is_cuda:
        from longspec.kernels.chain_accept.triton import chain_packed_triton

        return chain_packed_triton(tokens, length, bonus)
    return chain_packed_naive(tokens, length, bonus)


def sample_chain_decide(
    tokens: torch.Tensor,
    valid: torch.Tensor,
    target_probs: torch.Tensor,
    draws: torch.Tensor,
    threshold: torch.Tensor | None = None,
    draft_probs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(stop, rejected, token) [B] of `naive.sample_chain_decide_naive`: the Triton kernel on CUDA, the reference
    elsewhere."""
    fn = sample_chain_decide_naive
    if tokens.is_cuda:
        from longspec.kernels.chain_accept.triton import sample_chain_decide_triton as fn
    return fn(tokens, valid, target_probs, draws, threshold, draft_probs)


def __getattr__(name):
    # The Triton kernels are imported on first use so that importing this package never imports Triton.
    if name in ("chain_packed_triton", "greedy_chain_packed_triton", "sample_chain_decide_triton"):
        from longspec.kernels.chain_accept import triton as kernels

        return getattr(kernels, name)
    raise AttributeError(name)
