"""`naive.draft_nodes_naive` in one launch: one program per node (row b, node i) computes its position and writes
its mask row (the ring's W slots, and with the ancestors the N node slots after them), its near row [N] and, with
the rotary frequencies, its cos / sin rows [2R] (`rope_angles.triton.rope_cos_sin`).

Shape legend: B rows, N draft nodes, W ring slots, R rotary half; BLOCK_W / BLOCK_N / BLOCK_R tiles over them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from longspec.kernels.rope_angles.triton import rope_cos_sin

__all__ = ["draft_nodes_triton"]

# Ring slots per tile at most: a window of up to 512 slots is one tile, a larger ring loops.
BLOCK_W = 512


@triton.jit(do_not_specialize=["root_value", "N", "W", "window", "scaling"])
def _draft_nodes_kernel(
    OFFSETS, ROOT, RING_POS, ANCESTORS, POSITIONS, MASK, NEAR, INV_FREQ, COS, SIN,
    root_value, N, W, window, scaling,
    stride_ob, stride_on, stride_rb, stride_ab, stride_ai, stride_aj, stride_mb, stride_mn, stride_mw,
    ROOT_MODE: tl.constexpr, HAS_ANCESTORS: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_ANGLES: tl.constexpr, SCALED: tl.constexpr, HALF: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)
    b = pid // N
    i = pid % N
    # ROOT_MODE 0: no root (the offsets are the positions); 1: an int for every row; 2: one per row.
    if ROOT_MODE == 2:
        root = tl.load(ROOT + b)
    elif ROOT_MODE == 1:
        root = root_value.to(tl.int64)
    else:
        root = tl.zeros([], dtype=tl.int64)
    p = root + tl.load(OFFSETS + b * stride_ob + i * stride_on)
    tl.store(POSITIONS + b * N + i, p)
    if HAS_ANGLES:  # this node's cos / sin row: [R] angles, written to both halves
        # (Names of their own: the ring loop below carries `ok`, whose type a name shared here would fix.)
        r = tl.arange(0, BLOCK_R)
        r_ok = (r < HALF)[None, :]
        inv_freq = tl.load(INV_FREQ + r, mask=r < HALF, other=0.0)
        cos, sin = rope_cos_sin(tl.full([1], 0, tl.int64) + p, inv_freq, scaling, SCALED)  # [1, BLOCK_R]
        angle_row = (b * N + i) * (2 * HALF) + r[None, :]
        cos = cos.to(COS.dtype.element_ty)
        sin = sin.to(SIN.dtype.element_ty)
        tl.store(COS + angle_row, cos, mask=r_ok)
        tl.store(COS + angle_row + HALF, cos, mask=r_ok)
        tl.store(SIN + angle_row, sin, mask=r_ok)
        tl.store(SIN + angle_row + HALF, sin, mask=r_ok)
    start = p - window
    low = tl.maximum(start, 0)
    row = MASK + b * stride_mb + i * stride_mn
    # The ring row, as the reference's clamp(q, low, p) == q (the same result for any p, not only p >= 0).
    for w0 in range(0, W, BLOCK_W):
        w = w0 + tl.arange(0, BLOCK_W)
        ok = w < W
        q = tl.load(RING_POS + b * stride_rb + w, mask=ok, other=0)
        seen = tl.minimum(tl.maximum(q, low), p) == q
        tl.store(row + w * stride_mw, seen.to(tl.int8), mask=ok)
    j = tl.arange(0, BLOCK_N)
    j_ok = j < N
    near = (root + tl.load(OFFSETS + b * stride_ob + j * stride_on, mask=j_ok, other=0)) >= start
    tl.store(NEAR + (b * N + i) * N + j, near.to(tl.int8), mask=j_ok)
    if HAS_ANCESTORS:
        ancestor = tl.load(ANCESTORS + b * stride_ab + i * stride_ai + j * stride_aj, mask=j_ok, other=0)
        tl.store(row + (W + j) * stride_mw, ((ancestor != 0) & near).to(tl.int8), mask=j_ok)


def draft_nodes_triton(
    offsets: torch.Tensor,
    root: int | torch.Tensor | None,
    ring_positions: torch.Tensor,
    window: int,
    mask: torch.Tensor,
    ancestors: torch.Tensor | None = None,
    *,
    rope: tuple[torch.Tensor, float, torch.dtype] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """offsets [N] or [B, N] long (any strides), root None / an int / [B] long (contiguous), ring_positions
    [B, W] long (each row's slots contiguous), mask [B, N, W] bool ([B, N, W + N] with ancestors [B, N, N] or
    [N, N] bool; any strides; written), rope None or (inv_freq [R] float32 contiguous, attention_scaling, dtype)
    -> (positions [B, N] long, near [B, N, N] bool, None or (cos, sin) [B, N, 2R] in dtype), all contiguous (cos
    and sin views of one buffer)."""
    B, W = ring_positions.shape
    N = offsets.shape[-1]
    offsets = offsets.expand(B, N)
    assert offsets.dtype == ring_positions.dtype == torch.long and ring_positions.stride(1) == 1
    assert mask.shape == (B, N, W if ancestors is None else W + N) and mask.dtype == torch.bool
    if isinstance(root, torch.Tensor):
        assert root.shape == (B,) and root.dtype == torch.long and root.is_contiguous()
        mode, value, root_ptr = 2, 0, root
    else:
        mode, value, root_ptr = (0, 0, offsets) if root is None else (1, int(root), offsets)
    device = ring_positions.device
    positions = torch.empty(B, N, dtype=torch.long, device=device)
    near = torch.empty(B, N, N, dtype=torch.bool, device=device)
    if ancestors is not None:
        assert ancestors.dtype == torch.bool and ancestors.shape[-2:] == (N, N)
        ancestors = ancestors.expand(B, N, N).view(torch.int8)
    angles, inv_freq, cos, sin, scaling, half = (
        None,
        positions,
        positions,
        positions,
        1.0,
        1,
    )  # unused pointers
    if rope is not None:
        inv_freq, scaling, dtype = rope
        (half,) = inv_freq.shape
        assert inv_freq.dtype == torch.float32 and inv_freq.is_contiguous() and inv_freq.device == device
        angles = cos, sin = torch.empty(2, B, N, 2 * half, dtype=dtype, device=device).unbind(0)
    if B * N:
        _draft_nodes_kernel[(B * N,)](
            offsets, root_ptr, ring_positions, near if ancestors is None else ancestors,
            positions, mask.view(torch.int8), near.view(torch.int8), inv_freq, cos, sin,
            value, N, W, window, float(scaling),
            *offsets.stride(), ring_positions.stride(0), *(ancestors.stride() if ancestors is not None else (0,) * 3),
            *mask.stride(),
            ROOT_MODE=mode, HAS_ANCESTORS=ancestors is not None,
            BLOCK_W=min(BLOCK_W, triton.next_power_of_2(max(W, 1))), BLOCK_N=triton.next_power_of_2(N),
            HAS_ANGLES=rope is not None, SCALED=float(scaling) != 1.0, HALF=half,
            BLOCK_R=triton.next_power_of_2(half), num_warps=4,
        )  # fmt: skip
    return positions, near, angles
