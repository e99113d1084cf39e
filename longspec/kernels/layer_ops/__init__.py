"""The decoder layer's element-wise steps fused into one launch each: residual add + RMSNorm (or the token
embeddings' gather + a forward's first RMSNorm), q/k norm + RoPE (straight from the packed QKV projection into the
[B, H, T, D] layout attention reads), and SiLU(gate) * up."""

from longspec.kernels.layer_ops.naive import (
    add_rms_norm_naive,
    embed_rms_norm_naive,
    qkv_rope_naive,
    silu_mul_naive,
    write_kv,
)

__all__ = [
    "add_rms_norm",
    "add_rms_norm_naive",
    "embed_rms_norm",
    "embed_rms_norm_naive",
    "qkv_rope",
    "qkv_rope_naive",
    "silu_mul",
    "silu_mul_naive",
    "write_kv",
]


def __getattr__(name):
    # The Triton kernels are imported on first use so that importing this package never imports Triton.
    if name in ("add_rms_norm", "embed_rms_norm", "qkv_rope", "silu_mul"):
        from longspec.kernels.layer_ops import triton as kernels

        return getattr(kernels, name)
    raise AttributeError(name)
