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
  axis (no K/V copy); causal GQA repeats K/V. No sliding window.
- "triton": our forward-only kernels (`longspec.kernels`): `split_kv_attn` for the cache, `fused_mask_attn` for
  masks. CUDA, or CPU under TRITON_INTERPRET=1 (tests).
- "math": plain PyTorch in float32 (any device, with grads): the reference every other backend is tested against.
- "auto": the fastest one that supports the call, by case. `attention`: flash_attn > torch_flash > triton > math.
  `cache_attention` / `hybrid_attention` (few queries vs a long cache, inference): triton > flash_attn >
  torch_flash > math, because our split-KV kernel was measured 1.8-2.7x faster than the FA2-family kernel on
  this shape (docs/BENCHMARKS.md). `tree_attention`: triton > math. It warns once when it falls back to math
  on a GPU.
An explicitly requested backend that cannot run the call raises ValueError saying what to install or change.
Gradients flow through `out` only (the LSE of the fast backends is not differentiable); "triton" is forward only.
"""

from __future__ import annotations

import importlib.util
import logging
import math

import torch
import torch.utils.checkpoint

from longspec.kernels import triton_runs_on

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
HAS_FLASH_ATTN = importlib.util.find_spec("flash_attn") is not None

_INSTALL_HINT = {
    "flash_attn": "install it with `pip install 'longspec[flash]'` (needs a CUDA GPU and fp16/bf16 tensors)",
    "torch_flash": "it needs a CUDA GPU, fp16/bf16 tensors and a head dim <= 256 that is a multiple of 8",
    "triton": "it needs `pip install triton` and a CUDA GPU (or TRITON_INTERPRET=1 on CPU), and is forward only",
}
_HALF = (torch.float16, torch.bfloat16)
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


def _default_scale(q: torch.Tensor, scale: float | None) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


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


def _needs_grad(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _flash_attn_ok(q: torch.Tensor) -> bool:
    return HAS_FLASH_ATTN and q.is_cuda and q.dtype in _HALF


def _torch_flash_ok(q: torch.Tensor) -> bool:
    d = q.shape[-1]
    return q.is_cuda and q.dtype in _HALF and d <= 256 and d % 8 == 0


def _triton_ok(q: torch.Tensor, *tensors: torch.Tensor) -> bool:
    return triton_runs_on(q.device) and not _needs_grad(q, *tensors)


def _triton_auto(q: torch.Tensor, *tensors: torch.Tensor) -> bool:
    """What "auto" sends to Triton: fp16/bf16 on CUDA. float32 goes to the exact math path (the kernels run
    float32 too when asked explicitly, with IEEE products, but are tuned for half precision)."""
    return q.is_cuda and q.dtype in _HALF and _triton_ok(q, *tensors)


# --------------------------------------------------------------------------------------------------- math


def within_window(query_pos, key_pos, window: int):
    """The sliding-window rule, the one place it is written: the key at position j is within the window of the
    query at position t iff t - j <= window ("the token + `window` previous tokens"). Positions are tensors
    (broadcast against each other) or ints; causality (j <= t) is the caller's separate test."""
    return (query_pos - key_pos) <= window


def visibility_mask(
    num_queries: int, num_keys: int, *, causal: bool, window: int | None, device: torch.device | None = None
) -> torch.Tensor | None:
    """[Tq, Tk] bool mask (True = visible) for bottom-right causal / sliding-window attention."""
    if not causal and window is None:
        return None
    q_pos = torch.arange(num_keys - num_queries, num_keys, device=device)[:, None]
    k_pos = torch.arange(num_keys, device=device)[None, :]
    mask = torch.ones(num_queries, num_keys, dtype=torch.bool, device=device)
    if causal:
        mask &= k_pos <= q_pos
    if window is not None:
        mask &= within_window(q_pos, k_pos, window)
    return mask


def math_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference attention in float32. mask: broadcastable to [B, H, Tq, Tk], True = visible."""
    B, H, Tq, D = q.shape
    Hkv = k.shape[1]
    assert H % Hkv == 0, f"query heads {H} not a multiple of kv heads {Hkv}"
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    group = H // Hkv
    # Fold the GQA group into the query axis instead of repeating K/V.
    qf = q.float().reshape(B, Hkv, group * Tq, D)
    scores = torch.matmul(qf, k.float().transpose(-1, -2)) * scale  # [B, Hkv, group*Tq, Tk]
    scores = scores.view(B, Hkv, group, Tq, -1)
    if mask is not None:
        if mask.dim() == 2:  # [Tq, Tk]
            m = mask[None, None, None]
        elif mask.dim() == 3:  # [B, Tq, Tk]
            m = mask[:, None, None]
        else:  # [B, H, Tq, Tk]
            m = (
                mask.view(mask.shape[0], -1, group, Tq, mask.shape[-1])
                if mask.shape[1] == H
                else mask[:, :, None]
            )
        scores = scores.masked_fill(~m, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B, Hkv, group, Tq]
    # exp(-inf - -inf) is NaN: give fully masked rows zero weight instead.
    safe_lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    probs = torch.exp(scores - safe_lse[..., None])
    out = torch.matmul(probs.view(B, Hkv, group * Tq, -1), v.float()).view(B, H, Tq, D)
    return out.to(q.dtype), lse.reshape(B, H, Tq)


# ------------------------------------------------------------------------------------------- fast paths


def _flash_attn_call(q, k, v, *, causal: bool, window: int | None, scale: float):
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


def _flash_attn_cache(q, k_cache, v_cache, cache_len, *, scale: float):
    """flash_attn_with_kvcache: per-batch lengths stay on the device, so this is CUDA-graph safe."""
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
        causal=False,
        return_softmax_lse=True,
    )
    return out.transpose(1, 2), _flash_lse(lse)


def _torch_flash_call(q, k, v, *, causal: bool, scale: float):
    """aten._scaled_dot_product_flash_attention with equal head counts (GQA folded or repeated)."""
    B, H, Tq, D = q.shape
    Hkv = k.shape[1]
    group = H // Hkv
    if k.shape[2] == 0:  # empty key set: the kernel rejects it, the answer is known
        return q.new_zeros(q.shape), q.new_full((B, H, Tq), float("-inf"), dtype=torch.float32)
    if group > 1 and not causal:
        # Every query sees the same keys, so the group's queries can share one kv head: [B, Hkv, G*Tq, D].
        qf = q.reshape(B, Hkv, group * Tq, D)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
            qf, k, v, 0.0, False, False, scale=scale
        )[:2]
        return out.reshape(B, H, Tq, D), lse.reshape(B, H, Tq)
    if group > 1:
        # Causal masks differ per query position, so folding would break alignment: repeat K/V instead.
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[
        :2
    ]
    return out, lse


def _triton_masked(q, k, v, mask, *, scale: float):
    from longspec.kernels.fused_mask_attn.triton import fused_mask_attn

    return fused_mask_attn(q, k, v, mask, scale)


def _triton_cache(q, k_cache, v_cache, cache_len, *, scale: float, merge_with=None):
    from longspec.kernels.split_kv_attn.triton import split_kv_attn

    return split_kv_attn(q, k_cache, v_cache, cache_len, scale, merge_with=merge_with)


def _window_block(window: int) -> int:
    return max(256, window + 1)


def _window_block_attention(q, k, v, mask, scale):
    return math_attention(q, k, v, mask, scale)


def blocked_window_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, window: int, scale: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal sliding-window self-attention (Tq == Tk) in query blocks of size Bq >= window + 1.

    A query block [s, e) only sees keys [s - window, e), so each block is an exact masked attention over at most
    Bq + window keys: memory O(T * window) instead of O(T^2). With gradients each block is recomputed in the
    backward (activation checkpointing), so only the inputs are kept. This is the path the drafter's self-attention
    takes on long training sequences when flash-attn (which has a native window) is not installed.
    """
    T = q.shape[2]
    assert k.shape[2] == T, "blocked_window_attention is for self-attention (Tq == Tk)"
    scale = _default_scale(q, scale)
    block = _window_block(window)
    grad = _needs_grad(q, k, v)
    outs, lses = [], []
    for s in range(0, T, block):
        e = min(T, s + block)
        ks = max(0, s - window)
        q_pos = torch.arange(s, e, device=q.device)[:, None]
        k_pos = torch.arange(ks, e, device=q.device)[None, :]
        mask = (k_pos <= q_pos) & within_window(q_pos, k_pos, window)
        args = (q[:, :, s:e], k[:, :, ks:e], v[:, :, ks:e], mask, scale)
        if grad:
            out, lse = torch.utils.checkpoint.checkpoint(_window_block_attention, *args, use_reentrant=False)
        else:
            out, lse = _window_block_attention(*args)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


# ----------------------------------------------------------------------------------------------- public


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
    scale = _default_scale(q, scale)
    Tq, Tk = q.shape[2], k.shape[2]
    # PyTorch's flash kernel has no window, and its causal mask is only unambiguous for square blocks.
    torch_flash_fits = window is None and (not causal or Tq == Tk) and _torch_flash_ok(q)

    if backend == "auto":
        if _flash_attn_ok(q):
            backend = "flash_attn"
        elif torch_flash_fits:
            backend = "torch_flash"
        elif _triton_auto(q, k, v) and Tq * Tk <= 1 << 26:
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
        if not _flash_attn_ok(q):
            raise _cannot(backend, "flash-attn is not installed or the tensors are not CUDA fp16/bf16")
        return _flash_attn_call(q, k, v, causal=causal, window=window, scale=scale)
    if backend == "torch_flash":
        if not torch_flash_fits:
            raise _cannot(
                backend, "no sliding window and no non-square causal block in PyTorch's flash kernel"
            )
        return _torch_flash_call(q, k, v, causal=causal, scale=scale)
    if backend == "math" and window is not None and causal and Tq == Tk and Tq > 2 * _window_block(window):
        # Long sliding-window sequences (training stages 2-3 without flash-attn): O(T * window) memory.
        return blocked_window_attention(q, k, v, window=window, scale=scale)
    mask = visibility_mask(Tq, Tk, causal=causal, window=window, device=q.device)
    if backend == "triton":
        if not _triton_ok(q, k, v):
            raise _cannot(backend, "Triton is unavailable for this device or gradients are required")
        if mask is None:
            mask = torch.ones(Tq, Tk, dtype=torch.bool, device=q.device)
        return _triton_masked(q, k, v, mask, scale=scale)
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
    scale: float | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Few queries vs the first `cache_len` slots of a static cache [B, Hkv, Tmax, D], no mask.

    `cache_len` is an int or a 0-d / [B] integer tensor; a tensor never leaves the device on the "triton",
    "flash_attn" and "math" paths (CUDA-graph safe). "torch_flash" needs the length on the host."""
    _check_qkv(q, k_cache, v_cache)
    _check_backend(backend)
    _check_cache_len(cache_len, q.shape[0], k_cache.shape[2])
    scale = _default_scale(q, scale)

    if backend == "auto":
        if _triton_auto(q, k_cache, v_cache):
            backend = "triton"
        elif _flash_attn_ok(q) and not _needs_grad(q, k_cache, v_cache):
            backend = "flash_attn"
        elif _torch_flash_ok(q) and not isinstance(cache_len, torch.Tensor):
            backend = "torch_flash"
        else:
            if q.is_cuda:
                _warn_once("cache-math", "cache_attention: no fast backend fits; using the float32 math path")
            backend = "math"

    if backend == "flash_attn":
        if not _flash_attn_ok(q):
            raise _cannot(backend, "flash-attn is not installed or the tensors are not CUDA fp16/bf16")
        return _flash_attn_cache(q, k_cache, v_cache, cache_len, scale=scale)
    if backend == "triton":
        if not _triton_ok(q, k_cache, v_cache):
            raise _cannot(backend, "Triton is unavailable for this device or gradients are required")
        return _triton_cache(q, k_cache, v_cache, cache_len, scale=scale)
    if backend == "torch_flash":
        if not _torch_flash_ok(q):
            raise _cannot(backend, "unsupported device, dtype or head dim")
        lengths = torch.as_tensor(cache_len).flatten().tolist()  # host sync when cache_len is a tensor
        if len(set(lengths)) != 1:
            raise _cannot(backend, "per-batch cache lengths need a mask")
        n = lengths[0]
        return _torch_flash_call(q, k_cache[:, :, :n], v_cache[:, :, :n], causal=False, scale=scale)
    if isinstance(cache_len, torch.Tensor):
        slots = torch.arange(k_cache.shape[2], device=q.device)
        lengths = cache_len.to(q.device).reshape(-1, 1, 1)  # [B or 1, 1, 1]
        mask = (slots < lengths).expand(q.shape[0], 1, -1)  # [B, 1 (any query), Tmax]
        return math_attention(q, k_cache, v_cache, mask, scale)
    n = int(cache_len)
    return math_attention(q, k_cache[:, :, :n], v_cache[:, :, :n], None, scale)


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
    scale = _default_scale(q, scale)
    if backend in ("flash_attn", "torch_flash"):
        raise ValueError(
            f"backend {backend!r} has no arbitrary-mask attention; use 'triton', 'math' or 'auto'"
        )
    if backend == "auto":
        backend = "triton" if _triton_auto(q, k, v) else "math"
    if backend == "triton":
        if not _triton_ok(q, k, v):
            raise _cannot(backend, "Triton is unavailable for this device or gradients are required")
        return _triton_masked(q, k, v, mask, scale=scale)
    return math_attention(q, k, v, mask, scale)


def merge_attention(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of two attentions over disjoint key sets (docs/ALGORITHM.md §4.2):
    lse = log(e^lse_a + e^lse_b);  out = out_a * e^(lse_a - lse) + out_b * e^(lse_b - lse).
    Works when either side is fully masked (lse = -inf)."""
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    w_a = torch.exp(lse_a - safe)[..., None]
    w_b = torch.exp(lse_b - safe)[..., None]
    out = out_a.float() * w_a + out_b.float() * w_b
    return out.to(out_a.dtype), lse


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
    For speed, allocate `tree_mask` with rows padded to 16 bytes (see longspec.kernels.online_softmax)."""
    _check_qkv(q, k_new, v_new)
    _check_backend(backend)
    scale = _default_scale(q, scale)
    tree_backend = backend if backend in ("triton", "math") else "auto"
    triton_path = backend == "triton" or (
        backend == "auto" and _triton_auto(q, k_cache, v_cache, k_new, v_new)
    )
    if triton_path:
        _check_qkv(q, k_cache, v_cache)
        _check_cache_len(cache_len, q.shape[0], k_cache.shape[2])
        if not _triton_ok(q, k_cache, v_cache, k_new, v_new):
            raise _cannot("triton", "Triton is unavailable for this device or gradients are required")
        tree = tree_attention(q, k_new, v_new, tree_mask, scale=scale, backend="triton")
        return _triton_cache(q, k_cache, v_cache, cache_len, scale=scale, merge_with=tree)
    out_c, lse_c = cache_attention(q, k_cache, v_cache, cache_len, scale=scale, backend=backend)
    out_t, lse_t = tree_attention(q, k_new, v_new, tree_mask, scale=scale, backend=tree_backend)
    return merge_attention(out_c, lse_c, out_t, lse_t)
