"""The decoder layer's fused element-wise steps (residual add + RMSNorm, q/k norm + RoPE from the packed QKV
projection, SiLU(gate) * up), each one Triton launch on CUDA and the plain-PyTorch reference elsewhere, and its
projections (`linear`, `linear_silu_mul`, `head_logits`, the greedy `head_pick`): on CUDA in 16-bit dtypes, for the
one or two rows of an AR step or a chain of one, a Triton GEMV (`kernels.gemv`, the MLP's SiLU x up fused into its
gate/up projection; `kernels.head_argmax` for the pick); on the CPU, for up to 16 rows, the faster of two BLAS calls
measured per shape (`modules.cpu_projection`); F.linear otherwise.

The references (`longspec.kernels.layer_ops.naive`) use the HF modules' arithmetic, so off CUDA the packed
target forward computes what the unpacked one does; the Triton kernels are checked against them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from longspec.kernels import HAS_TRITON, gemv
from longspec.kernels import layer_ops as kernels
from longspec.kernels.head_argmax import head_argmax
from longspec.kernels.layer_ops import write_kv  # the unpacked layer's cache write: one scatter per tensor
from longspec.kernels.row_argmax import row_argmax
from longspec.modules.cpu_projection import few_rows_linear

__all__ = [
    "add_rms_norm",
    "embed_rms_norm",
    "linear",
    "linear_silu_mul",
    "head_logits",
    "head_pick",
    "project",
    "qkv_rope",
    "silu_mul",
    "use_triton",
    "write_kv",
]


def use_triton(x: torch.Tensor) -> bool:
    """Whether a fused step on `x` takes its Triton kernel: CUDA, Triton present, no autograd (inference)."""
    # Only compiled Triton: the CPU interpreter is a test tool (orders of magnitude slower than PyTorch).
    return HAS_TRITON and x.is_cuda and not torch.is_grad_enabled()


def _few_rows(x: torch.Tensor, weight: torch.Tensor) -> int | None:
    """x's row count where a few-row Triton kernel may take x @ weight^T (CUDA inference, a 16-bit model), else
    None. float32 stays on cuBLAS: the dtype of exact comparisons, where one route for every row count is wanted."""
    if not (use_triton(x) and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype):
        return None
    return x.numel() // x.shape[-1] if x.shape[-1] else 0


def _gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    # Few rows of a 16-bit model: there cuBLAS streams some weights below the bytes rate (`kernels.gemv`).
    rows = _few_rows(x, weight)
    if rows is None:
        return False
    small = weight.numel() * weight.element_size() <= gemv.TWO_ROW_MAX_BYTES
    return rows == 1 or (rows == gemv.MAX_ROWS and small)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T (+ bias); with `residual`, residual + that (in the GEMV's epilogue where the
    GEMV runs: one launch fewer)."""
    if _gemv(x, weight):
        return gemv.gemv(x, weight, bias, residual=residual)
    out = _blas(x, weight, bias)
    return out if residual is None else residual + out


def _blas(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear, or on the CPU for few rows its measured faster equivalent (`cpu_projection`)."""
    out = few_rows_linear(x, weight, bias)
    return F.linear(x, weight, bias) if out is None else out


def linear_silu_mul(x: torch.Tensor, gate_up: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """SiLU(x @ gate^T) * (x @ up^T) for the packed gate_up [2F, K] (gate rows, then up rows)."""
    if _gemv(x, gate_up):
        return gemv.gemv_silu_mul(x, gate_up, bias)
    return silu_mul(_blas(x, gate_up, bias))


def head_logits(head: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The LM head's logits, head(x): never the CUDA GEMV (cuBLAS streams a vocabulary-wide head at least as
    fast), the CPU's measured route for few rows, else the module itself."""
    if type(head) is nn.Linear:
        return _blas(x, head.weight, head.bias)
    return head(x)


def head_pick(head: nn.Module, x: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
    """The greedy pick from the LM head: the first index of the largest of head(x)'s logits per row (its id in
    `ids` [V], a draft vocabulary's map, with one). On CUDA in 16-bit dtypes, for a plain nn.Linear and one or two
    rows, one launch that never writes the logits (`kernels.head_argmax`); else `head_logits`, then `row_argmax`."""
    if type(head) is nn.Linear:
        rows = _few_rows(x, head.weight)
        if rows is not None and rows <= gemv.MAX_ROWS:
            return head_argmax(x, head.weight, head.bias, ids)
    return row_argmax(head_logits(head, x), ids)


def project(module: nn.Module, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
    """`module(x)` (residual + it, with `residual`) through `linear` where the module is a plain nn.Linear (its
    forward hooks are not run: the inference forwards call this); any other module (a quantised or adapted
    linear) runs itself."""
    if type(module) is nn.Linear:
        return linear(x, module.weight, module.bias, residual=residual)
    out = module(x)
    return out if residual is None else residual + out


def add_rms_norm(x, residual, weight, eps: float):
    """(rms_norm(x + residual) * weight, x + residual); residual None: (rms_norm(x) * weight, x)."""
    if use_triton(x) and weight.dtype == x.dtype:
        return kernels.add_rms_norm(x, residual, weight, eps)
    return kernels.add_rms_norm_naive(x, residual, weight, eps)


def embed_rms_norm(
    embedding: nn.Module, ids: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype
):
    """A forward's start: (rms_norm(h0) * weight, h0) for the token embeddings h0 = embedding(ids) in `dtype`; one
    launch on CUDA for a plain nn.Embedding of that dtype (the gather fused into the norm)."""
    plain = type(embedding) is nn.Embedding and embedding.max_norm is None
    if plain and use_triton(embedding.weight) and embedding.weight.dtype == weight.dtype == dtype:
        return kernels.embed_rms_norm(ids, embedding.weight, weight, eps)
    return add_rms_norm(embedding(ids).to(dtype), None, weight, eps)


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
    skip_negative: bool = False,
):
    """Packed qkv [B, T, (H + 2 Hkv) * D] -> q [B, H, T, D], k, v [B, Hkv, T, D], q and k rotated; with cache =
    (k_cache, v_cache [B, Hkv, Tmax, D], slots [B, T]) k and v are also written to those cache slots (slots >= 0;
    with `skip_negative`, a negative slot is not written: `write_kv`)."""
    # The Triton kernel rotates whole heads; a partial rope (fewer cos / sin dims than the head's) runs the
    # reference, which splits each head.
    full = cos.shape[-1] * (num_heads + 2 * num_kv_heads) == qkv.shape[-1]
    fn = kernels.qkv_rope if use_triton(qkv) and full else kernels.qkv_rope_naive
    return fn(
        qkv, cos, sin, num_heads, num_kv_heads, q_norm=q_norm, k_norm=k_norm, eps=eps, cache=cache,
        skip_negative=skip_negative,
    )  # fmt: skip


def silu_mul(gate_up):
    """gate_up [..., 2F] -> silu(gate) * up [..., F]."""
    return kernels.silu_mul(gate_up) if use_triton(gate_up) else kernels.silu_mul_naive(gate_up)
