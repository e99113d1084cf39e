"""The decoder layer's fused element-wise steps (residual add + RMSNorm, q/k norm + RoPE from the packed QKV
projection, SiLU(gate) * up), each one Triton launch on CUDA and the plain-PyTorch reference elsewhere.

The references (`longspec.kernels.layer_ops.naive`) use the HF modules' arithmetic, so off CUDA the packed
target forward computes what the unpacked one does; the Triton kernels are checked against them.
"""

from __future__ import annotations

import torch

from longspec.kernels import HAS_TRITON
from longspec.kernels import layer_ops as kernels
from longspec.kernels.layer_ops import write_kv  # the unpacked layer's cache write: one scatter per tensor

__all__ = ["add_rms_norm", "qkv_rope", "silu_mul", "write_kv"]


def _triton(x: torch.Tensor) -> bool:
    # Only compiled Triton: the CPU interpreter is a test tool (orders of magnitude slower than PyTorch).
    return HAS_TRITON and x.is_cuda and not torch.is_grad_enabled()


def add_rms_norm(x, residual, weight, eps: float):
    """(rms_norm(x + residual) * weight, x + residual); residual None: (rms_norm(x) * weight, x)."""
    if _triton(x) and weight.dtype == x.dtype:
        return kernels.add_rms_norm(x, residual, weight, eps)
    return kernels.add_rms_norm_naive(x, residual, weight, eps)


def qkv_rope(
    qkv,
    cos,
    sin,
    num_heads: int,
    num_kv_heads: int,
    *,
    q_norm=None,
    k_norm=None,
    eps: float = 1e-6,
    cache=None,
):
    """Packed qkv [B, T, (H + 2 Hkv) * D] -> q [B, H, T, D], k, v [B, Hkv, T, D], q and k rotated; with cache =
    (k_cache, v_cache [B, Hkv, Tmax, D], slots [B, T]) k and v are also written to those cache slots."""
    # The Triton kernel rotates whole heads; a partial rope (fewer cos / sin dims than the head's) runs the
    # reference, which splits each head.
    full = cos.shape[-1] * (num_heads + 2 * num_kv_heads) == qkv.shape[-1]
    fn = kernels.qkv_rope if _triton(qkv) and full else kernels.qkv_rope_naive
    return fn(qkv, cos, sin, num_heads, num_kv_heads, q_norm=q_norm, k_norm=k_norm, eps=eps, cache=cache)


def silu_mul(gate_up):
    """gate_up [..., 2F] -> silu(gate) * up [..., F]."""
    return kernels.silu_mul(gate_up) if _triton(gate_up) else kernels.silu_mul_naive(gate_up)
