"""Attention backends behind one API, each returning (out, lse).

Shape legend: B batch, H query heads, Hkv key/value heads (H % Hkv == 0, GQA), Tq queries, Tk keys, D head dim,
Tmax static-cache slots. Layout is [B, H, T, D] everywhere (the SDPA layout); lse is [B, H, Tq] in float32,
natural log.

Causal alignment is bottom-right: query i sits at key position Tk - Tq + i, so a block of new queries
against [cache ++ new] keys needs no offset argument. A key j is visible to the query at position t iff
j <= t and (window is None or t - j <= window)  -- "the token + `window` previous tokens".
Rows with no visible key return out = 0 and lse = -inf.

Backends (`backend=`):
- "flash_attn": the flash-attn package (CUDA, fp16/bf16): causal, sliding window and GQA natively, with grads.
- "torch_flash": PyTorch's own flash kernel `aten._scaled_dot_product_flash_attention` (CUDA, fp16/bf16), which
  returns the LSE but needs equal q/kv head counts: an unmasked query block folds the GQA group into the query
  axis (no K/V copy); causal GQA repeats K/V. No sliding window. Off CUDA its CPU twin
  (`_scaled_dot_product_flash_attention_for_cpu`, float32 / bf16, no autograd: inference on the CPU), in
  `cache_attention` a causal tail and a forest included, through an additive mask.
- "triton": our forward-only kernels (`longspec.kernels`): `split_kv_attn` for the cache, `fused_mask_attn` for
  masks. CUDA, or CPU under TRITON_INTERPRET=1 (tests).
- "math": plain PyTorch in float32 (any device, with grads): the reference every other backend is tested against.
- "auto": the fastest one that supports the call, by case. `attention`: flash_attn > torch_flash > triton > math
  (on the CPU without autograd: torch_flash where it fits, else math).
  `cache_attention` / `hybrid_attention` (few queries vs a long cache, inference): triton > flash_attn >
  torch_flash > math, because our split-KV kernel is faster than the FA2-family kernel on this shape (see the
  benchmarks); a causal tail that is a forest (`cache_attention(branches=...)`) skips
  flash_attn, which has no such mask; on the CPU, torch_flash with the length on the host (eager decoding),
  math with a per-row length tensor. `tree_attention`: triton > math. It warns once when it falls back to math
  on a GPU.
An explicitly requested backend that cannot run the call raises ValueError saying what to install or change.
Gradients flow through `out` only (the LSE of the fast backends is not differentiable); "triton" is forward only.

This module checks the arguments and picks the backend; the pieces it dispatches to live by role:
`attention_backends` (can a fast backend run this call, and its adapter), `attention_math` (the float32 reference,
the blocked sliding window, the LSE merge), `masks` (the window rule, the causal / window mask).
"""

from __future__ import annotations

import logging

import torch

from longspec.modules import attention_backends as backends
from longspec.modules.attention_backends import HAS_FLASH_ATTN
from longspec.modules.attention_math import (
    blocked_window_attention,
    default_scale,
    math_attention,
    merge_attention,
    needs_grad,
    window_block,
)
from longspec.modules.masks import visibility_mask, within_window

__all__ = [
    "blocked_window_attention",
    "BACKENDS",
    "HAS_FLASH_ATTN",
    "attention",
    "cache_attention",
    "tree_attention",
    "merge_attention",
    "hybrid_attention",
    "visibility_mask",
    "math_attention",
    "within_window",
]

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "flash_attn", "torch_flash", "triton", "math")

_INSTALL_HINT = {
    "flash_attn": "install it with `pip install 'longspec[flash]'` (needs a CUDA GPU and fp16/bf16 tensors)",
    "torch_flash": (
        "it needs a CUDA GPU, fp16/bf16 tensors and a head dim <= 256 that is a multiple of 8 (cache_attention: "
        "or float32 / bf16 on the CPU without gradients)"
    ),
    "triton": "it needs `pip install triton` and a CUDA GPU (or TRITON_INTERPRET=1 on CPU), and is forward only",
}
_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key in _warned:
        return
    _warned.add(key)
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    logger.warning(message)


def _cannot(backend: str, why: str) -> ValueError:
    hint = _INSTALL_HINT.get(backend, "")
    return ValueError(
        f"attention backend {backend!r} cannot run this call: {why}" + (f"; {hint}" if hint else "")
    )


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"expected [B, H, T, D] tensors, got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})")


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {BACKENDS}")


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    window: int | None = None,
    scale: float | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal / sliding-window / unmasked attention. Returns (out [B,H,Tq,D] in q.dtype, lse [B,H,Tq] fp32)."""
    _check_qkv(q, k, v)
    _check_backend(backend)
    if window is not None and window < 0:
        raise ValueError(f"window must be >= 0 (or None), got {window}")
    scale = default_scale(q, scale)
    Tq, Tk = q.shape[2], k.shape[2]
    # PyTorch's flash kernel has no window, and its causal mask is only unambiguous for square blocks. On the CPU
    # its twin serves inference (a prefill's first chunk: O(T) memory where the math path's mask is O(T^2)).
    torch_flash_fits = (
        window is None
        and (not causal or Tq == Tk)
        and (backends.torch_flash_ok(q) or backends.cpu_flash_ok(q, k, v))
    )

    if backend == "auto":
        if backends.flash_attn_ok(q):
            backend = "flash_attn"
        elif torch_flash_fits:
            backend = "torch_flash"
        elif backends.triton_auto(q, k, v) and Tq * Tk <= 1 << 26:
            backend = "triton"  # masked kernel with an explicit [Tq, Tk] mask (64 MiB at most)
        else:
            if q.is_cuda:
                _warn_once(
                    "attention-math",
                    "attention: no fast backend fits (sliding window / non-square causal without flash-attn, "
                    "or grads through a masked case); using the float32 math path. "
                    + _INSTALL_HINT["flash_attn"],
                )
            backend = "math"

    if backend == "flash_attn":
        if not backends.flash_attn_ok(q):
            raise _cannot(backend, "flash-attn is not installed or the tensors are not CUDA fp16/bf16")
        return backends.flash_attn_call(q, k, v, causal=causal, window=window, scale=scale)
    if backend == "torch_flash":
        if not torch_flash_fits:
            raise _cannot(
                backend,
                "no sliding window and no non-square causal block in PyTorch's flash kernel (and on the CPU "
                "float32 / bf16 without gradients)",
            )
        return backends.torch_flash_call(q, k, v, causal=causal, scale=scale)
    if backend == "math" and window is not None and causal and Tq == Tk and Tq > 2 * window_block(window):
        # Long sliding-window sequences (training stages 2-3 without flash-attn): O(T * window) memory.
        return blocked_window_attention(q, k, v, window=window, scale=scale)
    mask = visibility_mask(Tq, Tk, causal=causal, window=window, device=q.device)
    if backend == "triton":
        if not backends.triton_ok(q, k, v):
            raise _cannot(backend, "Triton is unavailable for this device or gradients are required")
        if mask is None:
            mask = torch.ones(Tq, Tk, dtype=torch.bool, device=q.device)
        return backends.triton_masked(q, k, v, mask, scale=scale)
    return math_attention(q, k, v, mask, scale)


def _check_cache_len(cache_len: int | torch.Tensor, batch: int, max_len: int) -> None:
    if isinstance(cache_len, torch.Tensor):
        if cache_len.dtype.is_floating_point or cache_len.dim() > 1 or cache_len.numel() not in (1, batch):
            raise ValueError(f"cache_len must be an int, a 0-d or [B] integer tensor; got {cache_len!r}")
        return  # values stay on the device (no host sync, CUDA-graph safe)
    if not 0 <= int(cache_len) <= max_len:
        raise ValueError(f"cache_len={cache_len} outside the cache's [0, {max_len}] slots")


def _check_mask(mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> None:
    expected = (q.shape[2], k.shape[2])
    if mask.dtype != torch.bool or mask.dim() not in (2, 3) or tuple(mask.shape[-2:]) != expected:
        raise ValueError(
            f"mask must be bool [Tq, Tk] or [B, Tq, Tk] with (Tq, Tk) = {expected}, got "
            f"{mask.dtype} {tuple(mask.shape)}"
        )
    if mask.dim() == 3 and mask.shape[0] not in (1, q.shape[0]):
        raise ValueError(f"mask batch {mask.shape[0]} does not match q batch {q.shape[0]}")


def cache_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_len: int | torch.Tensor,
    *,
    causal: bool = False,
    branches: int = 1,
    scale: float | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Few queries vs the first `cache_len` slots of a static cache [B, Hkv, Tmax, D], no mask; with `causal`,
    the queries are the last Tq of those slots, in order (a chain of new tokens, their K/V written): query t
    sees slots [0, cache_len - Tq + t] (bottom-right aligned, as flash-attn's causal with a KV cache).

    `branches` (with `causal`; Tq - 1 a multiple of it): the tail is a forest of `branches` chains from one root
    laid out level by level (root at tail index 0, branch i of level d >= 1 at 1 + (d - 1) * branches + i), and
    tail query t sees the slots before the tail, the root, and its own branch's tail slots up to itself:
    t' <= t with (t' - 1) % branches == (t - 1) % branches. Why: a lookup forest (several prompt-lookup chains
    from one root, verified in one forward) then runs the split-KV kernel's two-launch causal path instead of
    the hybrid path's three. "flash_attn" cannot run it (no such mask); branches=1 is the plain chain.

    `cache_len` is an int or a 0-d / [B] integer tensor; a tensor never leaves the device on the "triton",
    "flash_attn" and "math" paths (CUDA-graph safe). "torch_flash" needs the length on the host."""
    _check_qkv(q, k_cache, v_cache)
    _check_backend(backend)
    _check_cache_len(cache_len, q.shape[0], k_cache.shape[2])
    scale = default_scale(q, scale)
    Tq = q.shape[2]
    if branches < 1 or (Tq - 1) % branches != 0:
        raise ValueError(f"branches={branches} must be >= 1 and divide Tq - 1 = {Tq - 1} (a root + levels)")
    causal = causal and Tq > 1  # one query sees every slot either way
    forest = causal and branches > 1

    if backend == "auto":
        if backends.triton_auto(q, k_cache, v_cache):
            backend = "triton"
        elif backends.flash_attn_ok(q) and not needs_grad(q, k_cache, v_cache) and not forest:
            backend = "flash_attn"
        elif (backends.torch_flash_ok(q) and not isinstance(cache_len, torch.Tensor) and not causal) or (
            backends.cpu_flash_ok(q, k_cache, v_cache) and not isinstance(cache_len, torch.Tensor)
        ):
            backend = "torch_flash"
        else:
            if q.is_cuda:
                _warn_once("cache-math", "cache_attention: no fast backend fits; using the float32 math path")
            backend = "math"

    if backend == "flash_attn":
        if forest:
            raise _cannot(backend, "its causal mask is a chain, not a forest (branches > 1)")
        if not backends.flash_attn_ok(q):
            raise _cannot(backend, "flash-attn is not installed or the tensors are not CUDA fp16/bf16")
        return backends.flash_attn_cache(q, k_cache, v_cache, cache_len, scale=scale, causal=causal)
    if backend == "triton":
        if not backends.triton_ok(q, k_cache, v_cache):
            raise _cannot(backend, "Triton is unavailable for this device or gradients are required")
        return backends.triton_cache(
            q, k_cache, v_cache, cache_len, scale=scale, causal=causal, branches=branches
        )
    if backend == "torch_flash" and not q.is_cuda:
        if not backends.cpu_flash_ok(q, k_cache, v_cache):
            raise _cannot(backend, "on the CPU it needs float32 / bf16 and no gradients")
        lengths = torch.as_tensor(cache_len).flatten().tolist()  # a CPU tensor: no device sync
        if len(set(lengths)) != 1:
            raise _cannot(backend, "per-batch cache lengths need a mask")
        return backends.cpu_flash_cache(
            q, k_cache, v_cache, lengths[0], causal=causal, branches=branches, scale=scale
        )
    if backend == "torch_flash":
        if not backends.torch_flash_ok(q):
            raise _cannot(backend, "unsupported device, dtype or head dim")
        if causal:  # its causal mask is aligned top-left when Tq < Tk
            raise _cannot(backend, "a causal tail needs the bottom-right diagonal")
        lengths = torch.as_tensor(cache_len).flatten().tolist()  # host sync when cache_len is a tensor
        if len(set(lengths)) != 1:
            raise _cannot(backend, "per-batch cache lengths need a mask")
        n = lengths[0]
        return backends.torch_flash_call(q, k_cache[:, :, :n], v_cache[:, :, :n], causal=False, scale=scale)
    if isinstance(cache_len, torch.Tensor):  # every slot, masked per row (no host value read)
        lengths = cache_len.to(q.device).reshape(-1, 1, 1)  # [B or 1, 1, 1]
    else:  # the filled slots alone
        lengths = int(cache_len)
        k_cache, v_cache = k_cache[:, :, :lengths], v_cache[:, :, :lengths]
        if not causal:
            return math_attention(q, k_cache, v_cache, None, scale)
    slots = torch.arange(k_cache.shape[2], device=q.device)
    if causal:
        ends = lengths - Tq + 1 + torch.arange(Tq, device=q.device)[:, None]  # query t's end: n - Tq + t + 1
        mask = slots < ends  # [B or 1, Tq, slots] / [Tq, slots]
        if forest:  # past the root: every branches-th slot back from the query's own (its branch)
            mask &= (slots < lengths - Tq + 1) | ((ends - 1 - slots) % branches == 0)
    else:
        mask = slots < lengths  # [B or 1, 1, slots]
    return math_attention(q, k_cache, v_cache, mask.expand(q.shape[0], -1, -1), scale)


def tree_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    *,
    scale: float | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention under an arbitrary bool mask [Tq, Tk] or [B, Tq, Tk] (True = visible), e.g. the tree's ancestor
    mask among the new tokens. Backends: "triton" (fused_mask_attn), "math"; "auto" picks Triton on CUDA."""
    _check_qkv(q, k, v)
    _check_backend(backend)
    _check_mask(mask, q, k)
    scale = default_scale(q, scale)
    if backend in ("flash_attn", "torch_flash"):
        raise ValueError(
            f"backend {backend!r} has no arbitrary-mask attention; use 'triton', 'math' or 'auto'"
        )
    if backend == "auto":
        backend = "triton" if backends.triton_auto(q, k, v) else "math"
    if backend == "triton":
        if not backends.triton_ok(q, k, v):
            raise _cannot(backend, "Triton is unavailable for this device or gradients are required")
        return backends.triton_masked(q, k, v, mask, scale=scale)
    return math_attention(q, k, v, mask, scale)


def hybrid_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_len: int | torch.Tensor,
    tree_mask: torch.Tensor,
    *,
    scale: float | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify attention of the new (tree) tokens (ALGORITHM §4.2): every query sees the whole cached prefix
    (no mask) plus the new tokens its `tree_mask` [Tq, Tq] / [B, Tq, Tq] allows. Exactly equal to one masked
    attention over [cache[:cache_len] ++ new]; computed as merge(cache part, tree part) so neither part needs
    the other's mask. `backend` picks the cache part's backend; the tree part uses Triton or math.

    On CUDA with Triton ("auto" for fp16/bf16, or "triton"): fused_mask_attn for the tree part, then the
    split-KV kernel for the cache, whose reduce merges the tree part in: three kernels, no separate merge.
    For speed, allocate `tree_mask` with rows padded to 16 bytes (`longspec.kernels.mask_layout.aligned_rows`)."""
    _check_qkv(q, k_new, v_new)
    _check_backend(backend)
    scale = default_scale(q, scale)
    tree_backend = backend if backend in ("triton", "math") else "auto"
    triton_path = backend == "triton" or (
        backend == "auto" and backends.triton_auto(q, k_cache, v_cache, k_new, v_new)
    )
    if triton_path:
        _check_qkv(q, k_cache, v_cache)
        _check_cache_len(cache_len, q.shape[0], k_cache.shape[2])
        if not backends.triton_ok(q, k_cache, v_cache, k_new, v_new):
            raise _cannot("triton", "Triton is unavailable for this device or gradients are required")
        tree = tree_attention(q, k_new, v_new, tree_mask, scale=scale, backend="triton")
        return backends.triton_cache(q, k_cache, v_cache, cache_len, scale=scale, merge_with=tree)
    out_c, lse_c = cache_attention(q, k_cache, v_cache, cache_len, scale=scale, backend=backend)
    out_t, lse_t = tree_attention(q, k_new, v_new, tree_mask, scale=scale, backend=tree_backend)
    return merge_attention(out_c, lse_c, out_t, lse_t)
