"""Plain-PyTorch float32 reference for `split_kv_attn`: few queries against the filled prefix of a static cache.

Shape legend: B batch, H query heads, Hkv key/value heads (H % Hkv == 0), Tq queries, Tmax cache slots,
D head dim. Every query of batch row b sees exactly the first n_b slots (without `causal`: the cache precedes all
queries; with it, the queries are the last Tq of those slots and each sees the ones up to its own, or with
`branches` > 1 the ones before the tail, the tail's root and its own branch's up to itself),
n_b = cache_len (an int or 0-d tensor: every row) or cache_len[b] (a [B] tensor: a ragged batch),
clamped to [0, Tmax] as the kernel does. An empty cache (n_b = 0) gives out = 0 and lse = -inf for that row.
"""

from __future__ import annotations

import torch


def split_kv_attn_naive(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_len: int | torch.Tensor,
    scale: float,
    causal: bool = False,
    branches: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B,H,Tq,D], k_cache/v_cache [B,Hkv,Tmax,D], cache_len int, 0-d or [B] integer tensor. causal: query t
    sees keys [0, n_b - Tq + t] alone (the queries are the row's last Tq keys). branches (with causal): the tail
    is a forest laid out level by level (root at tail index 0, branch i of level d at 1 + (d-1)*branches + i);
    tail query t sees the keys before the tail, the root, and tail keys t' in 1..t with
    (t' - 1) % branches == (t - 1) % branches. Tq - 1 must be a multiple of branches.
    Returns (out [B,H,Tq,D] float32, lse [B,H,Tq] float32)."""
    B, H, Tq, D = q.shape
    if branches < 1 or (Tq - 1) % branches != 0:
        raise ValueError(f"branches={branches} must be >= 1 and divide Tq - 1 = {Tq - 1}")
    # The tail's own visibility [Tq, Tq], written out from the rule (a chain's is the lower triangle).
    t = torch.arange(Tq, device=q.device)
    tail = (t[None, :] <= t[:, None]) & (
        (t[None, :] == 0) | ((t[None, :] - 1) % branches == (t[:, None] - 1) % branches)
    )
    lengths = torch.as_tensor(cache_len).expand(B).tolist()
    group = H // k_cache.shape[1]
    outs, lses = [], []
    for b, n in enumerate(lengths):
        n = min(max(n, 0), k_cache.shape[2])
        k = k_cache[b, :, :n].float().repeat_interleave(group, dim=0)  # [H, n, D]
        v = v_cache[b, :, :n].float().repeat_interleave(group, dim=0)
        scores = torch.einsum("hqd,hkd->hqk", q[b].float(), k) * scale  # [H, Tq, n]
        if causal:
            # Each key's tail index; the keys before the tail (index < 0) are every query's.
            j = torch.arange(n, device=q.device) - (n - Tq)
            visible = (j[None, :] < 0) | tail[:, j.clamp(min=0)]  # j < Tq: the tail ends at n
            scores = scores.masked_fill(~visible, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)  # -inf when n == 0
        # A query that sees no key (lse -inf) gets zero weights, not NaN; anything else is left as it is.
        probs = torch.exp(scores - lse.clamp(min=torch.finfo(lse.dtype).min)[..., None])
        outs.append(probs @ v)  # zeros when n == 0
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)
