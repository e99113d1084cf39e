"""Which projections take the GEMV route: its row and weight-size limits (read by the package and its kernel),
and the rows view the few-row kernels read."""

import torch

__all__ = ["MAX_ROWS", "TWO_ROW_MAX_BYTES", "as_rows"]

# An AR step's row, or a chain of one's two: each row multiplies every weight tile on CUDA cores, one
# accumulator each; more rows go to cuBLAS's tensor-core kernels.
MAX_ROWS = 2
# Two rows only for weights up to this size: two rows in one GEMV beat cuBLAS at small weights (the SmolLM2
# shape's) and lose to it at large ones (the 8B shape's), where the second accumulator costs more
# than a tensor-core kernel's pass (`benchmarks/projection_routes.py`).
TWO_ROW_MAX_BYTES = 16 << 20


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] as [M, D] with contiguous rows (a view where it can be)."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()
