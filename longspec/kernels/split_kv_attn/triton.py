"""Split-KV ("flash-decoding") attention of few queries against a long static KV cache, returning LSE.

Shape legend: B batch, H query heads, Hkv key/value heads, G = H / Hkv (GQA group), Tq queries (<= ~128),
Tmax cache slots, D head dim, R = G * Tq rows per kv head, S splits of the cache axis.

Why: with ~70 tree tokens against a 32K-128K cache, parallelising over (heads x query blocks) alone gives a few
dozen programs for 132 SMs. Here the GQA group is folded into the query rows (row r -> head kvh*G + r // Tq,
query r % Tq), so all query heads of one kv head share each K/V tile, and the cache axis is cut into S splits
that run as separate programs. Each writes a partial (o_s, lse_s) normalised over its own keys; the reduce
merges them exactly (ALGORITHM §4.2, generalised to S parts):

    lse = log sum_s e^{lse_s},   out = sum_s e^{lse_s - lse} o_s.

The reduce also folds in one more part (`merge_with`): hybrid verify attention (ALGORITHM §4.2) passes the
tree tokens' fused_mask_attn result there, so the whole verify attention is three kernels with no separate
merge. (Not as an extra split of the same launch: the masked branch's register and shared-memory needs would
slow every split; the separate kernel is faster at long context, see the benchmarks.)
With `causal`, the queries are each row's last Tq cached keys (a chain of new tokens whose K/V are already
written: an AR step, a chain-shaped draft): query t sees keys [0, n_b - Tq + t]. Every split runs its share of the
keys all queries see unmasked, and the one that holds the last Tq - 1 keys masks them from indices (no mask in
memory), so a chain's verify attention is the same two launches as an AR step's, not the hybrid three.
With `branches` > 1 the tail is a forest of that many chains from one root, laid out level by level (a lookup
forest: several prompt-lookup chains verified in one forward); each query's tail keys are then every
`branches`-th key back from its own, still from indices, so the forest keeps the two-launch causal path too.
The inner loop is `longspec.kernels.online_softmax.attend_range` (base-2 online softmax, float32 accumulation).
`cache_len` may live on the device (0-d or [B], int32 or int64): each batch row reads its own length in the
kernel, so a ragged batch (per-sequence cache lengths) is one launch. The split count is planned for the
cache's capacity Tmax, never for the lengths, and each row cuts its own [0, n_b) into the S splits in whole
tiles; the splits past a short row's end run an empty range and write the neutral part (o = 0, lse = -inf).
So the grid and every host-side value are independent of the lengths: no host sync, and the launch can be
captured in a CUDA graph and replayed after the lengths change in place. A row with n_b = 0 returns
out = 0, lse = -inf (or exactly the `merge_with` part). A device length cannot be checked on the host; the
kernel clamps it to [0, Tmax] so that a bad value never reads outside the cache.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from longspec.kernels.online_softmax import attend_range, dot_precision, heads_last_like

_LOG2E = 1.4426950408889634


# Sizes that change between calls are not specialised on (divisibility by 16), so one compiled kernel serves
# every cache length / tree size instead of recompiling when, say, num_splits happens to be 16.
@triton.jit(do_not_specialize=["cache_len", "max_len", "num_queries", "num_rows", "num_splits", "branches"])
def _split_kv_partial_kernel(
    Q, K, V, LENS, O_PART, L_PART, cache_len, max_len,
    stride_qb, stride_qh, stride_qt,
    stride_kb, stride_kh, stride_kt,
    stride_vb, stride_vh, stride_vt,
    stride_lens,
    num_kv_heads, num_queries, group, num_rows, num_splits, branches,
    qk_scale,
    LEN_ON_DEVICE: tl.constexpr, CAUSAL: tl.constexpr, FOREST: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    # Row blocks vary fastest so the programs sharing one split's K/V tiles run together (L2 reuse).
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_bh = tl.program_id(2).to(tl.int64)
    b = pid_bh // num_kv_heads
    kvh = pid_bh % num_kv_heads

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] folded (head, query) rows
    heads = (kvh * group + rows // num_queries).to(tl.int64)
    tq = (rows % num_queries).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    row_ok = rows < num_rows
    d_ok = d < HEAD_DIM
    q = tl.load(
        Q + b * stride_qb + heads[:, None] * stride_qh + tq[:, None] * stride_qt + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )  # [BLOCK_M, BLOCK_D]

    # This program's slice of the filled cache, in whole BLOCK_N tiles (the last split may be short or empty).
    if LEN_ON_DEVICE:  # this row's own length (a ragged batch), clamped to the cache's slots
        n = tl.minimum(tl.maximum(tl.load(LENS + b * stride_lens).to(tl.int32), 0), max_len)
    else:
        n = cache_len
    split_len = tl.cdiv(tl.cdiv(n, num_splits), BLOCK_N) * BLOCK_N
    start = pid_s * split_len
    stop = tl.minimum(start + split_len, n)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running max, log2 units
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running sum of 2^(s - m_i)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    k_head = K + b * stride_kb + kvh * stride_kh
    v_head = V + b * stride_vb + kvh * stride_vh
    # CAUSAL: the queries are the row's last num_queries keys; keys [0, shared) are every query's, the few after
    # them query tq's up to its own (a diagonal from indices: one ragged tile, no mask in memory). FOREST: of
    # those, only its own branch's, every `branches`-th key back from its own (the root is in [0, shared)).
    shared = tl.maximum(n - num_queries + 1, 0) if CAUSAL else n
    acc, m_i, l_i = attend_range(
        acc, m_i, l_i, q, k_head, v_head, stride_kt, stride_vt,
        K,  # no mask
        start, tl.minimum(stop, shared), qk_scale, d, tq,
        HAS_MASK=False, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N, DOT_PRECISION=DOT_PRECISION,
        HAS_LIMIT=False,
    )  # fmt: skip
    if CAUSAL:
        acc, m_i, l_i = attend_range(
            acc, m_i, l_i, q, k_head, v_head, stride_kt, stride_vt,
            K,  # no mask
            tl.maximum(start, shared), stop, qk_scale, d, shared + tq,
            HAS_MASK=False, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N, DOT_PRECISION=DOT_PRECISION,
            HAS_LIMIT=True, period=branches, HAS_PERIOD=FOREST,
        )  # fmt: skip

    # An empty split leaves m_i = -inf, l_i = 0: it writes o = 0, lse = -inf and gets zero weight in the reduce.
    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    lse2 = m_i + tl.log2(l_i)
    part = (pid_bh * num_splits + pid_s) * num_rows  # O_PART [B*Hkv, S, R, D], L_PART [B*Hkv, S, R]
    rows64 = rows.to(tl.int64)
    tl.store(
        O_PART + (part + rows64)[:, None] * HEAD_DIM + d[None, :], o, mask=row_ok[:, None] & d_ok[None, :]
    )
    tl.store(L_PART + part + rows64, lse2, mask=row_ok)


@triton.jit(do_not_specialize=["num_queries", "num_rows", "num_splits"])
def _split_kv_reduce_kernel(
    O_PART, L_PART, EXTRA_O, EXTRA_L, OUT, LSE,
    stride_eb, stride_eh, stride_et,
    stride_elb, stride_elh, stride_elt,
    stride_ob, stride_oh, stride_ot,
    stride_lb, stride_lh, stride_lt,
    num_kv_heads, num_queries, group, num_rows, num_splits,
    HAS_EXTRA: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    # One folded row per program, BLOCK_S splits per load, merged online (one pass). A loop over the splits one
    # at a time, in two passes, is latency-bound: with few rows per kv head (an AR step) and many splits it would
    # cost more than the partial kernel itself.
    row = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // num_kv_heads
    head = (pid_bh % num_kv_heads * group + row // num_queries).to(tl.int64)
    tq = (row % num_queries).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    s_off = tl.arange(0, BLOCK_S)

    # Running max m (log2 units; -inf until a non-empty part), sum of weights and weighted sum of outputs,
    # all relative to m. Empty parts (lse -inf) get weight exactly 0.
    m = tl.full([1], float("-inf"), dtype=tl.float32)
    denom = tl.zeros([1], dtype=tl.float32)
    o = tl.zeros([BLOCK_D], dtype=tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        s = s0 + s_off
        s_ok = s < num_splits
        part = (pid_bh * num_splits + s) * num_rows + row  # [BLOCK_S]
        lse_s = tl.load(L_PART + part, mask=s_ok, other=float("-inf"))
        o_s = tl.load(
            O_PART + part[:, None] * HEAD_DIM + d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0
        )
        m_new = tl.maximum(m, tl.max(lse_s, axis=0))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_ref)  # 0 while m is -inf
        w = tl.exp2(lse_s - m_ref)  # [BLOCK_S]
        o = o * alpha + tl.sum(w[:, None] * o_s, axis=0)
        denom = denom * alpha + tl.sum(w, axis=0)
        m = m_new
    if HAS_EXTRA:
        lse_e = tl.load(
            EXTRA_L + b * stride_elb + head * stride_elh + tq * stride_elt + tl.zeros([1], tl.int64)
        )
        lse_e = lse_e * 1.4426950408889634
        o_e = tl.load(
            EXTRA_O + b * stride_eb + head * stride_eh + tq * stride_et + d, mask=d_ok, other=0.0
        ).to(tl.float32)
        m_new = tl.maximum(m, lse_e)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_ref)
        w_e = tl.exp2(lse_e - m_ref)
        o = o * alpha + w_e * o_e
        denom = denom * alpha + w_e
        m = m_new
    m = tl.where(m == float("-inf"), 0.0, m)
    o = o / tl.where(denom == 0.0, 1.0, denom)
    lse = tl.where(denom == 0.0, float("-inf"), (m + tl.log2(denom)) * 0.6931471805599453)
    tl.store(
        OUT + b * stride_ob + head * stride_oh + tq * stride_ot + d, o.to(OUT.dtype.element_ty), mask=d_ok
    )
    tl.store(LSE + b * stride_lb + head * stride_lh + tq * stride_lt + tl.zeros([1], tl.int64), lse)


# Splits the reduce merges per load (fixed, so the kernel compiles once whatever the split count): 64 covers one
# wave of splits at two kv heads (Qwen2.5-0.5B to 3B).
REDUCE_BLOCK_S = 64


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few splits, enough to exercise the reduce
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_config(
    num_rows: int, num_kv_programs: int, cache_len_hint: int, head_dim: int, device: torch.device
) -> dict[str, int]:
    """Launch parameters: BLOCK_M 64 wastes little on R = G*Tq rows (296 for 74 queries x 4 heads); the split
    count, at least 2 K/V tiles per split, gives:
    - a tree's rows (R >= 2 * BLOCK_M): ~4 waves of programs over the SMs (13 splits for 8 kv heads on 132 SMs),
      the fastest of the (BLOCK_M, BLOCK_N, warps, stages) x splits grid of
      `benchmarks/verify_attention.py --sweep` at both 32K and 128K.
    - fewer rows (an AR step, a chain): one wave where a split has few programs (one sequence's kv heads, one
      row block each), two where it has 16 or more (a batch, or a chain long enough for two row blocks). Their
      programs only stream K/V, so longer splits cost nothing in balance and save each split's fixed work and
      the reduce's input (splits x rows partials). `benchmarks/split_kv_sweep.py` finds one wave fastest for the
      8B shape's AR step, two for a chain of two row blocks and for a batch, at 8K and 32K alike.
    - never more than REDUCE_BLOCK_S splits, the reduce's parts per load: past it the reduce makes a second pass
      of dependent loads, which costs more than the extra splits gain. The sweep finds the AR step at two kv
      heads (the Qwen2.5-Coder-0.5B shape) fastest at 64 splits, one wave, and SmolLM2's (3 kv heads, one wave
      44 splits) no slower there than at 32.
    """
    block_m, block_n, num_warps, num_stages = 64, 64, 4, 3
    if head_dim > 128:
        block_n, num_stages = 32, 2  # shared memory
    programs_per_split = num_kv_programs * triton.cdiv(num_rows, block_m)
    waves = 4 if num_rows >= 2 * block_m else (1 if programs_per_split < 16 else 2)
    num_splits = max(1, round(waves * _num_sms(device) / programs_per_split))
    num_splits = min(num_splits, REDUCE_BLOCK_S, max(1, cache_len_hint // (2 * block_n)))
    return dict(
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps, num_stages=num_stages, num_splits=num_splits
    )


def split_kv_attn(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_len: int | torch.Tensor,
    scale: float | None = None,
    *,
    causal: bool = False,
    branches: int = 1,
    merge_with: tuple[torch.Tensor, torch.Tensor] | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [B,H,Tq,D] over slots [0, cache_len) of k_cache/v_cache [B,Hkv,Tmax,D] (no mask).

    cache_len: int (the same length for every row; the split count is planned for it), or a 0-d / [B]
      integer tensor read on the device: row b attends to its own first cache_len[b] slots (a ragged
      batch), the split count is planned for Tmax, and nothing is read back to the host.
    causal: the queries are each row's last Tq keys, in order (their K/V already written, a chain of new tokens):
      query t sees keys [0, cache_len - Tq + t] alone. With Tq = 1 it changes nothing (not specialised on).
    branches: with causal, the Tq = 1 + branches * L tail queries are a forest of `branches` chains of L nodes
      from one root, laid out level by level: root at tail index 0, branch i of level d (1..L) at
      1 + (d - 1) * branches + i. Tail query t sees the keys before the tail, the root, and the tail keys
      t' <= t of its own branch ((t' - 1) % branches == (t - 1) % branches); the root sees the keys up to
      itself. branches=1 is the plain chain (the same compiled kernel as without it).
    merge_with: optional (out [B,H,Tq,D], lse [B,H,Tq]) of attention over other keys, merged in the reduce.
    out/lse: optional output buffers. config: overrides of `default_config` (BLOCK_M, BLOCK_N, num_warps,
      num_stages, num_splits) and of the splits the reduce merges per load (REDUCE_BLOCK_S).
    Returns (out [B,H,Tq,D] in q.dtype, by default laid out [B,Tq,H,D] (`heads_last_like`), lse [B,H,Tq]
    float32) over the union of all key sets."""
    B, H, Tq, D = q.shape
    Hkv, Tmax = k_cache.shape[1], k_cache.shape[2]
    assert k_cache.shape == v_cache.shape and k_cache.shape[0] == B and k_cache.shape[3] == D and H % Hkv == 0
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, (
        "head dim must be contiguous"
    )
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    if branches < 1 or (Tq - 1) % branches != 0:
        raise ValueError(f"branches={branches} must be >= 1 and divide Tq - 1 = {Tq - 1}")
    group = H // Hkv
    num_rows = group * Tq

    len_on_device = isinstance(cache_len, torch.Tensor)
    if len_on_device:
        assert not cache_len.dtype.is_floating_point
        lens = cache_len.reshape(-1).to(q.device)  # any integer dtype: the kernel casts what it loads
        assert lens.numel() in (1, B)
        # The element stride, not 1: a [B] view such as lengths[:, 0] is read in place.
        stride_lens, hint, cache_len = (0 if lens.numel() == 1 else lens.stride(0)), Tmax, 0  # plan for Tmax
    else:
        lens, stride_lens, hint, cache_len = q, 0, int(cache_len), int(cache_len)  # LENS unused: any pointer

    cfg = default_config(num_rows, B * Hkv, hint, D, q.device)
    cfg.update(config or {})
    num_splits = cfg.pop("num_splits")
    block_m, block_n = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_N")
    reduce_block_s = cfg.pop("REDUCE_BLOCK_S", REDUCE_BLOCK_S)
    block_d = max(16, triton.next_power_of_2(D))

    o_part = torch.empty((B * Hkv, num_splits, num_rows, D), dtype=torch.float32, device=q.device)
    l_part = torch.empty((B * Hkv, num_splits, num_rows), dtype=torch.float32, device=q.device)
    grid = (triton.cdiv(num_rows, block_m), num_splits, B * Hkv)
    _split_kv_partial_kernel[grid](
        q, k_cache, v_cache, lens, o_part, l_part, cache_len, Tmax,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        stride_lens,
        Hkv, Tq, group, num_rows, num_splits, branches,
        scale * _LOG2E,
        LEN_ON_DEVICE=len_on_device, CAUSAL=causal and Tq > 1, FOREST=causal and Tq > 1 and branches > 1,
        DOT_PRECISION=dot_precision(q.dtype),
        HEAD_DIM=D, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n, **cfg,
    )  # fmt: skip

    out = heads_last_like(q) if out is None else out
    lse = torch.empty((B, H, Tq), dtype=torch.float32, device=q.device) if lse is None else lse
    assert out.shape == q.shape and out.stride(-1) == 1 and lse.shape == (B, H, Tq)
    if merge_with is not None:
        extra_o, extra_l = merge_with
        assert extra_o.shape == q.shape and extra_l.shape == (B, H, Tq) and extra_o.stride(-1) == 1
    else:
        extra_o, extra_l = out, lse  # unused (HAS_EXTRA=False); any valid pointers
    # REDUCE_BLOCK_S: fixed, so the kernel compiles once whatever the split count (a multiple of it is one more
    # loop; default_config plans at most one).
    _split_kv_reduce_kernel[(num_rows, B * Hkv)](
        o_part, l_part, extra_o, extra_l, out, lse,
        extra_o.stride(0), extra_o.stride(1), extra_o.stride(2),
        extra_l.stride(0), extra_l.stride(1), extra_l.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        lse.stride(0), lse.stride(1), lse.stride(2),
        Hkv, Tq, group, num_rows, num_splits,
        HAS_EXTRA=merge_with is not None, HEAD_DIM=D, BLOCK_D=block_d, BLOCK_S=reduce_block_s, num_warps=2,
    )  # fmt: skip
    return out, lse
