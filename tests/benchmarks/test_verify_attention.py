"""benchmarks/verify_attention.py: the timing needs a GPU; its ragged-batch inputs and check run on CPU (Triton
interpreter) at tiny shapes."""

import os

import pytest
import torch

# Triton picks interpreter vs compiled when a kernel is defined: before the script imports the kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def verify_attention(load_benchmark):
    return load_benchmark("verify_attention")


def test_ragged_lengths_span_the_bucket(verify_attention):
    lengths = verify_attention.ragged_lengths(8, 8192)
    assert lengths[0] == 8192 and len(set(lengths)) == 8
    assert all(8192 // 4 - 100 <= n <= 8192 for n in lengths)
    assert any(n % 64 for n in lengths), "some lengths must end inside a tile"
    assert verify_attention.ragged_lengths(1, 100) == [100]


@pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning")
def test_ragged_check_passes_at_tiny_shapes(verify_attention):
    inputs = verify_attention.ragged_inputs(3, 150, 11, "cpu", torch.float32, heads=(4, 2, 16))
    q, _, _, k_cache, _, lengths, masks = inputs
    assert lengths.tolist() == verify_attention.ragged_lengths(3, 150) and k_cache.shape[2] == 150
    assert masks.shape == (3, 11, 11) and not torch.equal(masks[0], masks[1])
    assert k_cache[2, :, lengths[2] :].isnan().all(), "slots past a row's length are poisoned"
    checks = verify_attention.check_ragged(inputs, 0.25)
    assert checks["out_max_err"] < 1e-5 and checks["lse_max_err"] < 1e-5, checks
    assert checks["separate_vs_batch_max_err"] < 1e-5, checks


def test_batch_needs_ragged(verify_attention):
    with pytest.raises(SystemExit):
        verify_attention.main(["--batch", "4"])
