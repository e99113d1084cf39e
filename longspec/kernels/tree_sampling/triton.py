"""The sampling walk (`naive.sample_walk_naive` states the semantics) as one launch: one program per tree walks
it root to stop, the children of a node tried in order, each rejection updating p (and q) in a float64 workspace
row. The reference runs depth x children steps of about 30 small tensor ops each (enough to make a T=1 round
of a large tree cost about twice a T=0 one, even with CUDA graphs); here each step is a few passes over V inside
one program.

Shape legend: B trees, N nodes, K the most children of a node, V vocabulary, L depth.

Sums run in BLOCK-wide chunks, not in torch's order: p and q can differ from the reference in the last bit,
which changes an accept / reject decision only when a uniform falls within that bit of its threshold.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["sample_walk"]


@triton.jit
def _copy_row(SRC, DST, V, BLOCK: tl.constexpr):
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        ok = cols < V
        tl.store(DST + cols, tl.load(SRC + cols, mask=ok, other=0.0).to(tl.float64), mask=ok)


@triton.jit
def _row_sum(X, V, BLOCK: tl.constexpr):
    total = tl.zeros([BLOCK], dtype=tl.float64)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        total += tl.load(X + cols, mask=cols < V, other=0.0)
    return tl.sum(total, axis=0)


@triton.jit
def _walk_kernel(
    TOKENS, CHILDREN, P_IN, Q_IN, DRAWS, PATH, LENGTH, RESIDUAL, QW,
    V,
    stride_tok, stride_ch_b, stride_ch_n, stride_p_b, stride_p_n, stride_q_b, stride_q_n, stride_draw,
    stride_path, stride_res, stride_qw,
    DEPTH: tl.constexpr, K: tl.constexpr, HAS_Q: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    P = RESIDUAL + b * stride_res  # p lives in the residual row: where the walk stops, p is the residual
    Q = QW + b * stride_qw
    node = tl.zeros([], dtype=tl.int64)
    alive = tl.full([], 1, dtype=tl.int1)
    length = tl.full([], 1, dtype=tl.int64)
    for d in range(0, DEPTH + 1):
        tl.store(PATH + b * stride_path + d, 0)
    for level in range(0, DEPTH):
        chosen = tl.full([], -1, dtype=tl.int64)
        if alive:
            _copy_row(P_IN + b * stride_p_b + node * stride_p_n, P, V, BLOCK)
            if HAS_Q:
                _copy_row(Q_IN + b * stride_q_b + node * stride_q_n, Q, V, BLOCK)
            for k in range(0, K):
                child = tl.load(CHILDREN + b * stride_ch_b + node * stride_ch_n + k)
                if (child >= 0) & (chosen < 0):
                    x = tl.load(TOKENS + b * stride_tok + child)
                    px = tl.load(P + x)
                    u = tl.load(DRAWS + b * stride_draw + level * K + k)
                    if HAS_Q:
                        accept = u * tl.load(Q + x) < px  # u < min(1, p/q), q(x) > 0
                    else:
                        accept = u * _row_sum(P, V, BLOCK) < px
                    if accept:
                        chosen = child
                    else:
                        if HAS_Q:
                            # p <- norm(max(p - q, 0)) (kept when that mass is 0: acceptance was certain then)
                            mass = tl.zeros([BLOCK], dtype=tl.float64)
                            for start in range(0, V, BLOCK):
                                cols = start + tl.arange(0, BLOCK)
                                ok = cols < V
                                pv = tl.load(P + cols, mask=ok, other=0.0)
                                qv = tl.load(Q + cols, mask=ok, other=0.0)
                                mass += tl.maximum(pv - qv, 0.0)
                            total = tl.sum(mass, axis=0)
                            if total > 0:
                                for start in range(0, V, BLOCK):
                                    cols = start + tl.arange(0, BLOCK)
                                    ok = cols < V
                                    pv = tl.load(P + cols, mask=ok, other=0.0)
                                    qv = tl.load(Q + cols, mask=ok, other=0.0)
                                    tl.store(P + cols, tl.maximum(pv - qv, 0.0) / total, mask=ok)
                            # q <- q without x, renormalised
                            tl.store(Q + x, tl.zeros([], dtype=tl.float64))
                            q_total = tl.maximum(_row_sum(Q, V, BLOCK), tl.full([], 1e-300, dtype=tl.float64))
                            for start in range(0, V, BLOCK):
                                cols = start + tl.arange(0, BLOCK)
                                ok = cols < V
                                tl.store(Q + cols, tl.load(Q + cols, mask=ok, other=0.0) / q_total, mask=ok)
                        else:
                            tl.store(P + x, tl.zeros([], dtype=tl.float64))
        stepped = alive & (chosen >= 0)
        if stepped:
            tl.store(PATH + b * stride_path + level + 1, chosen)
            length += 1
            node = chosen
        alive = stepped
    if alive:  # walked to a leaf: the bonus comes from p there
        _copy_row(P_IN + b * stride_p_b + node * stride_p_n, P, V, BLOCK)
    if _row_sum(P, V, BLOCK) <= 0:  # every child rejected only through rounding: p itself
        _copy_row(P_IN + b * stride_p_b + node * stride_p_n, P, V, BLOCK)
    tl.store(LENGTH + b, length)


def sample_walk(
    tokens: torch.Tensor,
    children: torch.Tensor,
    target_probs: torch.Tensor,
    draws: torch.Tensor,
    depth: int,
    draft_probs: torch.Tensor | None = None,
    *,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`naive.sample_walk_naive` in one launch: (path [B, L + 1], length [B], residual [B, V] float64). out:
    optional (path, length, residual) buffers to write into."""
    batch, _, max_children = children.shape
    V = target_probs.shape[-1]
    if out is None:
        out = (
            torch.empty(batch, depth + 1, dtype=torch.long, device=tokens.device),
            torch.empty(batch, dtype=torch.long, device=tokens.device),
            torch.empty(batch, V, dtype=torch.float64, device=tokens.device),
        )
    path, length, residual = out
    has_q = draft_probs is not None
    q = draft_probs if has_q else target_probs  # not read without HAS_Q
    workspace = torch.empty(batch if has_q else 1, V, dtype=torch.float64, device=tokens.device)
    children = children.contiguous()
    target_probs, q = target_probs.contiguous(), q.contiguous()
    _walk_kernel[(batch,)](
        tokens, children, target_probs, q, draws, path, length, residual, workspace,
        V,
        tokens.stride(0), children.stride(0), children.stride(1), target_probs.stride(0), target_probs.stride(1),
        q.stride(0), q.stride(1), draws.stride(0), path.stride(0), residual.stride(0),
        workspace.stride(0) if has_q else 0,
        DEPTH=depth, K=max_children, HAS_Q=has_q, BLOCK=min(1024, triton.next_power_of_2(V)),
    )  # fmt: skip
    return path, length, residual
