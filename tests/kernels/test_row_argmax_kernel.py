"""The row argmax kernels (the CPU interpreter in CI) against torch.argmax: first index among ties, also across
chunks; NaN as the largest value; rows read through their stride with the columns past the vocabulary poisoned."""

import pytest
import torch

pytest.importorskip("triton")

from longspec.kernels.row_argmax import row_argmax, row_argmax_naive, row_argmax_triton  # noqa: E402
from longspec.kernels.row_argmax.triton import CHUNK  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _check(x: torch.Tensor) -> None:
    want = row_argmax_naive(x)
    got = row_argmax_triton(x.to(DEVICE)).cpu()
    assert got.dtype == torch.long and got.shape == want.shape
    assert torch.equal(got, want), (got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("vocab", [37, CHUNK, CHUNK + 1, 3 * CHUNK - 5])  # one partial chunk, one, 2, 3
def test_kernel_equals_argmax_with_ties_in_and_across_chunks(dtype, vocab):
    gen = torch.Generator().manual_seed(vocab)
    # few distinct values: every row has many tied maxima, in several chunks
    x = torch.randint(0, 5, (6, vocab), generator=gen).to(dtype)
    x[1] = 0.0  # all tied: index 0
    x[2, -1] = 9.0  # the maximum alone in the last (partial) chunk
    x[3] = float("-inf")  # nothing above -inf: index 0
    x[4, vocab // 2] = float("inf")
    _check(x)
    _check(torch.randn(3, 4, vocab, generator=gen).to(dtype))  # leading dims


def test_nan_is_the_largest_and_the_first_nan_wins():
    x = torch.randn(4, 3 * CHUNK, generator=torch.Generator().manual_seed(0))
    x[0, 5] = float("inf")
    x[0, CHUNK + 7] = float("nan")  # a NaN in a later chunk beats +inf in an earlier one
    x[1, 2 * CHUNK + 1] = float("nan")
    x[1, CHUNK + 3] = float("nan")  # the first NaN, one chunk before the other
    x[2, 10] = float("nan")
    x[2, 3] = float("nan")  # two in one chunk
    _check(x)


def test_rows_read_through_their_stride_and_nothing_past_the_vocabulary():
    vocab = CHUNK + 100
    x = torch.randn(5, vocab, generator=torch.Generator().manual_seed(1))
    wide = torch.full((5, vocab + 300), float("nan"))  # poison: a read past V would return a NaN's index
    wide[:, :vocab] = x
    view = wide.to(DEVICE)[:, :vocab]
    assert view.stride(0) == vocab + 300
    assert torch.equal(row_argmax_triton(view).cpu(), x.argmax(-1))


def test_empty_rows_and_the_dispatcher():
    assert row_argmax_triton(torch.randn(0, 50, device=DEVICE)).shape == (0,)
    with pytest.raises(ValueError, match="empty last dim"):
        row_argmax_triton(torch.randn(3, 0, device=DEVICE))
    x = torch.randn(2, 3, 77)
    assert torch.equal(row_argmax(x), x.argmax(-1))  # on CPU the reference itself


@pytest.mark.parametrize("vocab", [37, CHUNK + 1])
def test_an_id_map_returns_the_argmax_id(vocab):
    # A draft vocabulary's map (draft id -> target id, not sorted): the pick's id, with ties still the first index.
    gen = torch.Generator().manual_seed(vocab)
    x = torch.randint(0, 4, (2, 3, vocab), generator=gen).float()
    ids = torch.randperm(10 * vocab, generator=gen)[:vocab]
    want = ids[x.argmax(-1)]
    assert torch.equal(row_argmax_naive(x, ids), want)
    assert torch.equal(row_argmax_triton(x.to(DEVICE), ids.to(DEVICE)).cpu(), want)
    assert torch.equal(row_argmax(x, ids), want)
