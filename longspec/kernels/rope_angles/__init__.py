"""RoPE's cos / sin for a forward's position ids in one launch (`modules.rope.RotaryEmbedding.cos_sin` on CUDA).

Why: the angles are recomputed in every target forward, every draft and every ring fill, inside CUDA graphs where
a small model's decode step is bound by the number of launches. The reference's PyTorch ops are five to nine
launches (cast, product, cat, cos, sin, two casts to the model's dtype, two more products with a scaling != 1);
the kernel computes each [R] half of a row's angles once and writes both outputs in one. `naive.py` is the
reference (HF's float32 arithmetic), and the kernel performs the same float32 operations in the same order."""

from longspec.kernels.rope_angles.naive import rope_angles_naive

__all__ = ["rope_angles", "rope_angles_naive"]


def __getattr__(name):
    # The Triton kernel is imported on first use so that importing this package never imports Triton.
    if name == "rope_angles":
        from longspec.kernels.rope_angles import triton as kernels

        return kernels.rope_angles
    raise AttributeError(name)
