"""Attention of the new (tree) tokens among themselves under an arbitrary boolean mask, returning LSE."""

from longspec.kernels.fused_mask_attn.naive import fused_mask_attn_naive

__all__ = ["fused_mask_attn", "fused_mask_attn_naive"]


def __getattr__(name):
    # The Triton kernel is imported on first use so that importing this package never imports Triton.
    if name == "fused_mask_attn":
        from longspec.kernels.fused_mask_attn.triton import fused_mask_attn

        return fused_mask_attn
    raise AttributeError(name)
