"""The fast attention backends behind `longspec.modules.attention`: whether each can run a call (`*_ok`), and an
adapter per backend that calls it in our [B, H, T, D] layout and returns our (out, lse) contract (fully masked rows:
out 0, lse -inf). Which backend runs a call is `attention.py`'s decision; nothing here picks or falls back.

Shape legend: B batch, H query heads, Hkv key/value heads (H % Hkv == 0, GQA), Tq queries, Tk keys, D head dim,
Tmax static-cache slots. Layout is [B, H, T, D] everywhere; lse is [B, H, Tq] in float32, natural log.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from longspec.kernels import triton_runs_on
from longspec.modules.attention_math import needs_grad

__all__ = [
    "HAS_FLASH_ATTN",
    "flash_attn_ok",
    "torch_flash_ok",
    "cpu_flash_ok",
    "triton_ok",
    "triton_auto",
    "flash_attn_call",
    "flash_attn_cache",
    "torch_flash_call",
    "cpu_flash_cache",
    "triton_masked",
    "triton_cache",
]

HAS_FLASH_ATTN = importlib.util.find_spec("flash_attn") is not None
HALF = (torch.float16, torch.bfloat16)
HAS_CPU_FLASH = hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")


def flash_attn_ok(q: torch.Tensor) -> bool:
    return HAS_FLASH_ATTN and q.is_cuda and q.dtype in HALF


def torch_flash_ok(q: torch.Tensor) -> bool:
    d = q.shape[-1]
    return q.is_cuda and q.dtype in HALF and d <= 256 and d % 8 == 0


def cpu_flash_ok(q: torch.Tensor, *tensors: torch.Tensor) -> bool:
    """PyTorch's CPU flash kernel, for inference (no autograd) in float32 / bf16."""
    return (
        HAS_CPU_FLASH
        and q.device.type == "cpu"
        and q.dtype in (torch.float32, torch.bfloat16)
        and not needs_grad(q, *tensors)
    )


def triton_ok(q: torch.Tensor, *tensors: torch.Tensor) -> bool:
    return triton_runs_on(q.device) and not needs_grad(q, *tensors)


def triton_auto(q: torch.Tensor, *tensors: torch.Tensor) -> bool:
    """What "auto" sends to Triton: fp16/bf16 on CUDA. float32 goes to the exact math path (the kernels run
    float32 too when asked explicitly, with IEEE products, but are tuned for half precision)."""
    return q.is_cuda and q.dtype in HALF and triton_ok(q, *tensors)


def flash_attn_call(q, k, v, *, causal: bool, window: int | None, scale: float):
    """flash_attn_func in its [B, T, H, D] layout; GQA and bottom-right causal are native."""
    from flash_attn import flash_attn_func

    # Our window counts keys back from the query (t - j <= window); flash-attn's (left, right) does the same,
    # with -1 meaning unbounded. Without causal the keys after the query stay visible.
    window_size = (-1 if window is None else window, 0 if causal else -1)
    out, lse, _ = flash_attn_func(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        softmax_scale=scale,
        causal=causal,
        window_size=window_size,
        return_attn_probs=True,
    )
    return out.transpose(1, 2), _flash_lse(lse)


def _flash_lse(lse: torch.Tensor) -> torch.Tensor:
    """flash-attn's LSE is [B, H, Tq] float32 with +inf for rows that see no key (so its backward gets zero
    probabilities); our contract says -inf there."""
    return lse.masked_fill(torch.isposinf(lse), float("-inf"))


def flash_attn_cache(q, k_cache, v_cache, cache_len, *, scale: float, causal: bool = False):
    """flash_attn_with_kvcache: per-batch lengths stay on the device, so this is CUDA-graph safe. Its causal mask
    is aligned bottom-right (the queries are the last cache_seqlens slots), as `cache_attention` defines it."""
    from flash_attn import flash_attn_with_kvcache

    B = q.shape[0]
    if isinstance(cache_len, torch.Tensor):
        seqlens = cache_len.to(device=q.device, dtype=torch.int32).expand(B).contiguous()
    else:
        seqlens = int(cache_len)
    out, lse = flash_attn_with_kvcache(
        q.transpose(1, 2),
        k_cache.transpose(1, 2),
        v_cache.transpose(1, 2),
        cache_seqlens=seqlens,
        softmax_scale=scale,
        causal=causal,
        return_softmax_lse=True,
    )
    return out.transpose(1, 2), _flash_lse(lse)


def _flash(q, k, v, causal: bool, scale: float):
    """PyTorch's flash kernel on q's device -> (out, lse): CUDA's, or its CPU twin (inference: `cpu_flash_ok`)."""
    if q.is_cuda:
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[
            :2
        ]
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)[:2]


def torch_flash_call(q, k, v, *, causal: bool, scale: float):
    """aten._scaled_dot_product_flash_attention (or, on the CPU, its CPU twin) with equal head counts (GQA folded
    or repeated)."""
    B, H, Tq, D = q.shape
    Hkv = k.shape[1]
    group = H // Hkv
    if k.shape[2] == 0:  # empty key set: the kernel rejects it, the answer is known
        return q.new_zeros(q.shape), q.new_full((B, H, Tq), float("-inf"), dtype=torch.float32)
    if group > 1 and not causal:
        # Every query sees the same keys, so the group's queries can share one kv head: [B, Hkv, G*Tq, D].
        out, lse = _flash(q.reshape(B, Hkv, group * Tq, D), k, v, False, scale)
        return out.reshape(B, H, Tq, D), lse.reshape(B, H, Tq)
    if group > 1:
        # Causal masks differ per query position, so folding would break alignment: repeat K/V instead.
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    return _flash(q, k, v, causal, scale)


def cpu_flash_cache(q, k_cache, v_cache, cache_len: int, *, causal: bool, branches: int, scale: float):
    """Few queries vs the first `cache_len` slots of a static cache on the CPU (`cache_attention`'s contract,
    a causal tail and a forest included) through aten._scaled_dot_product_flash_attention_for_cpu. Each kv head's
    group of query heads is folded into its query axis (no K/V copy: [B, Hkv, G * Tq, D]); a causal tail is an
    additive mask over those rows (`_tail_mask`, made once per round shape and shared by the layers). The math
    path's five-dimensional broadcasts run at a fraction of the memory speed, which a CPU decode step feels in
    every layer."""
    k, v = k_cache[:, :, :cache_len], v_cache[:, :, :cache_len]
    if not causal:  # every query sees the same keys: the unmasked call (an empty cache included)
        return torch_flash_call(q, k, v, causal=False, scale=scale)
    B, H, Tq, D = q.shape  # a causal tail: its keys are in the cache, so cache_len >= Tq > 0
    group = H // k_cache.shape[1]
    mask = _tail_mask(cache_len, Tq, group, branches, q.dtype)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.reshape(B, H // group, group * Tq, D),
        k,
        v,
        0.0,
        False,
        attn_mask=mask,
        scale=scale,
    )[:2]
    return out.reshape(B, H, Tq, D), lse.reshape(B, H, Tq)


@functools.lru_cache(maxsize=16)
def _tail_mask(cache_len: int, tail: int, group: int, branches: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask [group * tail, cache_len] of a causal tail (`cache_attention`'s rule) over the folded
    query rows (row g * tail + t: query t of the group's head g): 0 where visible, -inf elsewhere. Tail query t
    sees every slot before the tail and tail slot j <= t -- with `branches` > 1 only the root (j = 0) and its own
    chain ((t - j) % branches == 0). Shared, read only: a round's layers all take the one made for its shape."""
    t = torch.arange(tail)[:, None]
    j = torch.arange(tail)[None, :]
    visible = (j <= t) & ((j == 0) | ((t - j) % branches == 0))
    mask = torch.zeros(tail, cache_len, dtype=dtype)
    mask[:, cache_len - tail :].masked_fill_(~visible, float("-inf"))
    return mask.repeat(group, 1)


def triton_masked(q, k, v, mask, *, scale: float):
    from longspec.kernels.fused_mask_attn.triton import fused_mask_attn

    return fused_mask_attn(q, k, v, mask, scale)


def triton_cache(
    q, k_cache, v_cache, cache_len, *, scale: float, causal: bool = False, branches: int = 1, merge_with=None
):
    from longspec.kernels.split_kv_attn.triton import split_kv_attn

    return split_kv_attn(
        q, k_cache, v_cache, cache_len, scale, causal=causal, branches=branches, merge_with=merge_with
    )
