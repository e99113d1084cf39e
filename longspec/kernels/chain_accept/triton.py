"""`naive.greedy_chain_packed_naive` in one launch: one program per row holds its N nodes as one block.

Shape legend: B rows, N chain nodes (root + drafts), BLOCK the next power of two >= N.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["greedy_chain_packed_triton"]


@triton.jit
def _greedy_chain_kernel(
    TOKENS, ARGMAX, VALID, PACKED, BONUS,
    N, stride_tb, stride_tn, stride_ab, stride_an, stride_vb, stride_vn, stride_pb,
    BLOCK: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)
    node = i < N
    has_next = i + 1 < N
    target = tl.load(ARGMAX + b * stride_ab + i * stride_an, mask=node, other=0)
    # draft i + 1 against the target's choice at its parent i
    draft = tl.load(TOKENS + b * stride_tb + (i + 1) * stride_tn, mask=has_next, other=0)
    draft_ok = tl.load(VALID + b * stride_vb + (i + 1) * stride_vn, mask=has_next, other=0) != 0
    miss = has_next & ~(draft_ok & (draft == target))
    # the leading run of matches: the first miss (N - 1 when every draft matches)
    drafts = tl.min(tl.where(miss, i, N - 1), axis=0)
    bonus = tl.sum(tl.where(i == drafts, target, 0), axis=0)
    row = PACKED + b * stride_pb
    tl.store(row + i, tl.where(i < drafts, draft, bonus), mask=node)  # emitted
    tl.store(row + N + i, i.to(tl.int64), mask=node)  # path: the chain's first nodes
    tl.store(row + 2 * N, (drafts + 1).to(tl.int64))  # count
    tl.store(BONUS + b, bonus)


def greedy_chain_packed_triton(
    tokens: torch.Tensor, target_argmax: torch.Tensor, valid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens / target_argmax [B, N] long, valid [B, N] bool (any strides) -> (packed [B, 2N + 1], bonus [B])."""
    B, N = tokens.shape
    assert target_argmax.shape == valid.shape == (B, N) and valid.dtype == torch.bool
    assert tokens.dtype == target_argmax.dtype == torch.long
    packed = torch.empty(B, 2 * N + 1, dtype=torch.long, device=tokens.device)
    bonus = torch.empty(B, dtype=torch.long, device=tokens.device)
    if B:
        _greedy_chain_kernel[(B,)](
            tokens, target_argmax, valid.view(torch.uint8), packed, bonus,
            N, *tokens.stride(), *target_argmax.stride(), *valid.stride(), packed.stride(0),
            BLOCK=triton.next_power_of_2(N),
        )  # fmt: skip
    return packed, bonus
