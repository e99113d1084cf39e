"""A round's commit bookkeeping in one launch: the committed lengths advance by each row's count, the accepted
path's tokens enter the token history, and the drafter ring's slots for them are claimed (its positions and
append count updated); returns the path's positions and ring slots, for the RoPE step that writes the path's
K/V into the ring. `naive.py` is the reference (~16 small PyTorch launches on CUDA in a drafting round, 4 in a
plain one, each a launch in a launch-bound round); `triton.py` is one program per row."""

from __future__ import annotations

import torch

from longspec.kernels.path_commit.naive import commit_path_naive

__all__ = ["commit_path", "commit_path_naive"]


def commit_path(
    path_tokens: torch.Tensor,
    counts: torch.Tensor,
    lengths: torch.Tensor,
    *,
    history: torch.Tensor | None = None,
    ring_positions: torch.Tensor | None = None,
    ring_appended: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`naive.commit_path_naive`: the Triton kernel on CUDA (imported on first use), the reference elsewhere."""
    fn = commit_path_naive
    if path_tokens.is_cuda:
        from longspec.kernels.path_commit.triton import commit_path_triton as fn
    return fn(
        path_tokens,
        counts,
        lengths,
        history=history,
        ring_positions=ring_positions,
        ring_appended=ring_appended,
    )


def __getattr__(name):
    # The Triton kernel is imported on first use so that importing this package never imports Triton.
    if name == "commit_path_triton":
        from longspec.kernels.path_commit.triton import commit_path_triton

        return commit_path_triton
    raise AttributeError(name)
