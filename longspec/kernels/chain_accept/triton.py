"""The chain rules of `naive.py` in one launch each: one program per row holds its N nodes (or depth drafts) as
one block (`greedy_chain_packed_naive`, `chain_packed_naive`, `sample_chain_decide_naive`).

Shape legend: B rows, N chain nodes (root + drafts), BLOCK the next power of two >= N.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["chain_packed_triton", "greedy_chain_packed_triton", "sample_chain_decide_triton"]


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


@triton.jit
def _chain_pack_kernel(
    TOKENS, LENGTH, BONUS, PACKED, N, stride_tb, stride_tn, stride_pb, BLOCK: tl.constexpr
):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)
    node = i < N
    length = tl.load(LENGTH + b)
    bonus = tl.load(BONUS + b)
    draft = tl.load(TOKENS + b * stride_tb + (i + 1) * stride_tn, mask=i + 1 < N, other=0)
    row = PACKED + b * stride_pb
    tl.store(row + i, tl.where(i < length - 1, draft, bonus), mask=node)
    tl.store(row + N + i, i.to(tl.int64), mask=node)
    tl.store(row + 2 * N, length.to(tl.int64))


def chain_packed_triton(tokens: torch.Tensor, length: torch.Tensor, bonus: torch.Tensor) -> torch.Tensor:
    """tokens [B, N] long (any strides), length / bonus [B] long -> packed [B, 2N + 1]: `naive.chain_packed_naive`
    in one launch."""
    B, N = tokens.shape
    assert length.shape == bonus.shape == (B,) and length.is_contiguous() and bonus.is_contiguous()
    packed = torch.empty(B, 2 * N + 1, dtype=torch.long, device=tokens.device)
    if B:
        _chain_pack_kernel[(B,)](
            tokens, length, bonus, packed, N, *tokens.stride(), packed.stride(0),
            BLOCK=triton.next_power_of_2(N),
        )  # fmt: skip
    return packed


@triton.jit
def _sample_chain_kernel(
    TOKENS, VALID, P, Q, DRAWS, THRESHOLD, STOP, REJECTED, TOKEN,
    depth, stride_tb, stride_tn, stride_vb, stride_vn, stride_pb, stride_pn, stride_qb, stride_qn,
    stride_db, stride_hb,
    BLOCK: tl.constexpr, HAS_Q: tl.constexpr,
):  # fmt: skip
    # Draft i + 1 against node i, for i < depth: p_i(x) and (rrs) q_i(x) gathered, one lane per draft.
    b = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)
    lane = i < depth
    draft = tl.load(TOKENS + b * stride_tb + (i + 1) * stride_tn, mask=lane, other=0)
    draft_ok = tl.load(VALID + b * stride_vb + (i + 1) * stride_vn, mask=lane, other=0) != 0
    p_draft = tl.load(P + b * stride_pb + i * stride_pn + draft, mask=lane, other=0.0).to(tl.float64)
    if HAS_Q:
        threshold = tl.load(Q + b * stride_qb + i * stride_qn + draft, mask=lane, other=1.0).to(tl.float64)
    else:
        threshold = tl.load(THRESHOLD + b * stride_hb + i, mask=lane, other=1.0)
    u = tl.load(DRAWS + b * stride_db + i, mask=lane, other=1.0).to(tl.float64)
    accept = draft_ok & (u * threshold < p_draft)
    stop = tl.min(tl.where(lane & ~accept, i, depth), axis=0)  # the first draft not accepted, or the leaf
    child_ok = tl.sum(tl.where(i == stop, draft_ok.to(tl.int32), 0), axis=0) > 0  # the stop's child, if any
    token = tl.sum(tl.where(i == tl.minimum(stop, depth - 1), draft, 0), axis=0)
    tl.store(STOP + b, stop.to(tl.int64))
    tl.store(REJECTED + b, ((stop < depth) & child_ok).to(tl.int8))
    tl.store(TOKEN + b, token)


def sample_chain_decide_triton(
    tokens: torch.Tensor,
    valid: torch.Tensor,
    target_probs: torch.Tensor,
    draws: torch.Tensor,
    threshold: torch.Tensor | None = None,
    draft_probs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`naive.sample_chain_decide_naive` in one launch: one program per row, one lane per draft (p and q read at
    the draft's token only)."""
    B, N = tokens.shape
    depth = N - 1
    assert depth >= 1 and tokens.dtype == torch.long and valid.dtype == torch.bool
    assert target_probs.shape[:2] == (B, N) and target_probs.stride(-1) == 1 and draws.stride(-1) == 1
    has_q = draft_probs is not None
    if has_q:
        assert draft_probs.shape[0] == B and draft_probs.shape[1] >= depth and draft_probs.stride(-1) == 1
    else:
        assert threshold is not None and threshold.dtype == torch.float64 and threshold.stride(-1) == 1
    device = tokens.device
    stop = torch.empty(B, dtype=torch.long, device=device)
    rejected = torch.empty(B, dtype=torch.bool, device=device)
    token = torch.empty(B, dtype=torch.long, device=device)
    q = draft_probs if has_q else target_probs  # a dummy pointer when there is no q
    thr = threshold if not has_q else draws  # likewise
    if B:
        _sample_chain_kernel[(B,)](
            tokens, valid.view(torch.uint8), target_probs, q, draws, thr, stop, rejected.view(torch.int8), token,
            depth, *tokens.stride(), *valid.stride(), target_probs.stride(0), target_probs.stride(1),
            q.stride(0), q.stride(1), draws.stride(0), thr.stride(0),
            BLOCK=triton.next_power_of_2(depth), HAS_Q=has_q,
        )  # fmt: skip
    return stop, rejected, token
