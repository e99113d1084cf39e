"""A projection of few rows (an AR step, a chain of one: M <= MAX_ROWS) as split-K partial sums that the next
fused element-wise step adds up (`longspec.kernels.layer_ops` takes a `SplitK` wherever it takes a projection's output).

Why: at one row cuBLAS streams some weights well below the bytes rate and, where it splits K, adds a reduce
launch of its own (on an H200 at the 8B shape, the output projection 13.2 µs a call against a 7.8 µs bytes floor,
SmolLM2's projections 3.3-5.2 µs against < 1 µs: benchmarks/projection_routes.py). Here every program streams a
[BLOCK_N, K / S] slice of the weight once and writes its float32 partial sums; the consumer, which reads the row
anyway, sums the S partials and rounds once to the model's dtype, as one GEMM's float32 accumulator would (in
another order: a last-bit difference, as between cuBLAS kernels). `naive.py` is the reference."""

from longspec.kernels.linear_partials.naive import SplitK, linear_partials_naive

__all__ = ["MAX_ROWS", "SplitK", "linear_partials", "linear_partials_naive"]

# An AR step's row, or a chain of one's two: each row multiplies every weight tile on CUDA cores, one
# accumulator each; more rows go to cuBLAS's tensor-core kernels.
MAX_ROWS = 2


def __getattr__(name):
    # The Triton kernel is imported on first use so that importing this package never imports Triton.
    if name == "linear_partials":
        from longspec.kernels.linear_partials.triton import linear_partials

        return linear_partials
    raise AttributeError(name)
