"""Projections of few rows (an AR step's one row, a chain of one's two: M <= MAX_ROWS) as a GEMV on CUDA cores,
written in the model's dtype, optionally with SiLU(gate) * up fused into the gate/up projection.

Why: at one row cuBLAS streams some weights well below the bytes rate and, where it splits K, adds a reduce
launch of its own (`benchmarks/projection_routes.py` compares both with the bytes floor at the 8B and SmolLM2
shapes). Here every program
streams [BLOCK_N, K] weight rows once in wide tiles and keeps the whole sum along K in float32, so the output is
rounded once, as one GEMM's accumulator is (the order of the sum differs: a last-bit difference, as between two
cuBLAS kernels), and no other launch is needed. `naive.py` is the reference."""

from longspec.kernels.gemv.naive import gemv_naive, gemv_silu_mul_naive
from longspec.kernels.gemv.rows import MAX_ROWS, TWO_ROW_MAX_BYTES

__all__ = ["MAX_ROWS", "TWO_ROW_MAX_BYTES", "gemv", "gemv_naive", "gemv_silu_mul", "gemv_silu_mul_naive"]


def __getattr__(name):
    # The Triton kernels are imported on first use so that importing this package never imports Triton.
    if name in ("gemv", "gemv_silu_mul"):
        from longspec.kernels.gemv import triton as kernels

        return getattr(kernels, name)
    raise AttributeError(name)
