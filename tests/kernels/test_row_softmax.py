"""The row softmax kernels (the CPU interpreter in CI) against torch.softmax: float32 agreement to the last bits
(the sums run in another order), rows summing to 1, -inf giving exact zeros and a one-hot row exact ones, NaN
rows as torch's, rows read through their stride with the columns past the vocabulary poisoned."""

import pytest
import torch

pytest.importorskip("triton")

from longspec.kernels.row_softmax import row_softmax, row_softmax_naive, row_softmax_triton  # noqa: E402
from longspec.kernels.row_softmax.triton import CHUNK  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Largest |kernel - torch| allowed, absolute (8 float32 ulps of a probability in [0.5, 1): ~4 seen in the
# interpreter) and relative to torch's probability (~5 ulps seen in the interpreter, where the sums' order
# changes S's last bits; on CUDA Triton's exp(x) is ex2(x log2 e), whose argument's rounding grows with |x - M|,
# ~2.6e-6 at x - M = -30). Below float32's smallest normal the GPU flushes to 0.
ABS_TOL, REL_TOL, FLOOR = 2.0**-21, 4e-6, torch.finfo(torch.float32).tiny


def _check(x: torch.Tensor) -> torch.Tensor:
    """The kernel against the exact value of the reference's formula (softmax in float64): torch's own float32 CPU
    softmax (`row_softmax_naive`) is off by more than the kernel on some CPUs' vector paths."""
    want = torch.softmax(x.double(), dim=-1)
    got = row_softmax_triton(x.to(DEVICE)).cpu()
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert not got.isnan().any(), "NaN: an element left unwritten or a finite row gone wrong"
    err = (got.double() - want).abs()
    assert err.max() <= ABS_TOL, f"max abs error {err.max():.2e}"
    assert (err <= REL_TOL * want + FLOOR).all(), f"max relative error {(err / want).max():.2e}"
    row_sums = got.double().sum(-1)
    assert (row_sums - 1).abs().max() <= 1e-6, row_sums
    return got


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [37, CHUNK, CHUNK + 1, 3 * CHUNK - 5])  # one partial chunk, one, 2, 3
def test_kernel_equals_softmax(dtype, vocab):
    gen = torch.Generator().manual_seed(vocab)
    # logits' spread: probabilities from ~1e-13 to ~0.5
    _check((3 * torch.randn(5, vocab, generator=gen)).to(dtype))
    _check((3 * torch.randn(2, 3, vocab, generator=gen)).to(dtype))  # leading dims [B, N, V]
    peaked = torch.randn(2, vocab, generator=gen)
    peaked[:, -1] = 40.0  # one token holds nearly all the mass, in the last (partial) chunk
    _check(peaked.to(dtype))


def test_masked_entries_are_exact_zeros_and_a_lone_entry_exactly_one():
    vocab = 3 * CHUNK - 5
    gen = torch.Generator().manual_seed(0)
    x = 3 * torch.randn(5, vocab, generator=gen)
    x[0, torch.rand(vocab, generator=gen) < 0.9] = float("-inf")  # top-p style: most of the row masked
    x[1, : 2 * CHUNK] = float("-inf")  # whole chunks masked
    x[2] = float("-inf")
    x[2, vocab - 1] = 1.5  # the one kept token, in the last (partial) chunk
    x[3] = float("-inf")
    x[3, 7] = -80.0  # a lone entry far below 0: still exactly 1
    got = _check(x)
    assert (got[x.isneginf()] == 0).all()
    assert got[2, vocab - 1] == 1.0 and got[3, 7] == 1.0


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # the interpreter's numpy on inf - inf
def test_nan_rows_as_torch():
    x = torch.randn(4, 2 * CHUNK + 3, generator=torch.Generator().manual_seed(1))
    x[0, CHUNK + 1] = float("nan")
    x[1, 5] = float("inf")
    x[2] = float("-inf")
    x[3] = float("-inf")
    x[3, 2 * CHUNK] = float("nan")  # NaN, every other entry -inf
    want = row_softmax_naive(x)
    assert want.isnan().all()  # torch's rule, the one the kernel follows
    assert row_softmax_triton(x.to(DEVICE)).cpu().isnan().all()


def test_rows_read_through_their_stride_and_nothing_past_the_vocabulary():
    vocab = CHUNK + 100
    x = torch.randn(5, vocab, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    wide = torch.full((5, vocab + 300), float("nan"), dtype=torch.bfloat16)  # poison: a read past V gives NaN
    wide[:, :vocab] = x
    view = wide.to(DEVICE)[:, :vocab]
    assert view.stride(0) == vocab + 300
    got = row_softmax_triton(view).cpu()
    assert not got.isnan().any()
    assert (got - row_softmax_naive(x)).abs().max() <= ABS_TOL


def test_empty_and_the_dispatcher():
    assert row_softmax_triton(torch.randn(0, 50, device=DEVICE)).shape == (0, 50)
    assert row_softmax_triton(torch.randn(3, 0, device=DEVICE)).shape == (3, 0)
    x = torch.randn(2, 3, 77)
    assert torch.equal(row_softmax(x), torch.softmax(x, -1))  # on CPU the reference itself
