"""A greedy chain round's acceptance and output in one launch: the leading run of drafts that equal the
target's choice at their parent, the bonus token after it, and the round's packed output row (emitted tokens,
path, count) that the engine copies to the host. Every T = 0 round whose tree is one chain takes it: an AR step
and a plain round (no drafts), the drafter's chains, a prompt-lookup chain. `naive.py` is the reference (the
rule in PyTorch: ~15 small launches on CUDA, each ~1.5-2 µs of a launch-bound round); `triton.py` is one program
per row."""

from __future__ import annotations

import torch

from longspec.kernels.chain_accept.naive import emitted_tokens, greedy_chain_packed_naive, greedy_chain_path

__all__ = ["emitted_tokens", "greedy_chain_packed", "greedy_chain_packed_naive", "greedy_chain_path"]


def greedy_chain_packed(
    tokens: torch.Tensor, target_argmax: torch.Tensor, valid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed [B, 2N + 1], bonus [B]) of `naive.greedy_chain_packed_naive`: the Triton kernel on CUDA (imported
    on first use), the reference elsewhere."""
    if tokens.is_cuda:
        from longspec.kernels.chain_accept.triton import greedy_chain_packed_triton

        return greedy_chain_packed_triton(tokens, target_argmax, valid)
    return greedy_chain_packed_naive(tokens, target_argmax, valid)


def __getattr__(name):
    # The Triton kernel is imported on first use so that importing this package never imports Triton.
    if name == "greedy_chain_packed_triton":
        from longspec.kernels.chain_accept.triton import greedy_chain_packed_triton

        return greedy_chain_packed_triton
    raise AttributeError(name)
