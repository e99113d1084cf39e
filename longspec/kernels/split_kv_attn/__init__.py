"""Few queries against a long static KV cache, split along the cache ("flash-decoding"), returning LSE."""

from longspec.kernels.split_kv_attn.naive import split_kv_attn_naive

__all__ = ["split_kv_attn", "split_kv_attn_naive"]


def __getattr__(name):
    # The Triton kernel is imported on first use so that importing this package never imports Triton.
    if name == "split_kv_attn":
        from longspec.kernels.split_kv_attn.triton import split_kv_attn

        return split_kv_attn
    raise AttributeError(name)
