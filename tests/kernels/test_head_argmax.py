"""head_argmax (Triton; the CPU interpreter in CI) vs its reference (the head's logits rounded, then torch.argmax):
one and two rows, heads that end in a partial block, ties inside and across programs and across the merge's
chunks, NaN the largest, an id map, a bias, operands read through their strides out of NaN-poisoned buffers (a
read past a row or past the head returns NaN, and a NaN wins the argmax), and the counter left ready for the next
launch."""

import pytest
import torch

pytest.importorskip("triton")

from longspec.kernels.head_argmax import head_argmax, head_argmax_naive, head_argmax_triton  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _poisoned(values: torch.Tensor, pad_rows: int, pad_cols: int) -> torch.Tensor:
    """`values` [R, C] as a view of a larger NaN-filled buffer: NaN columns after each row, NaN rows after the
    last."""
    rows, cols = values.shape
    wide = torch.full((rows + pad_rows, cols + pad_cols), float("nan"), dtype=values.dtype)
    wide[:rows, :cols] = values
    return wide.to(DEVICE)[:rows, :cols]


def _check(x, weight, bias=None, ids=None, config=None):
    want = head_argmax_naive(x.cpu(), weight.cpu(), None if bias is None else bias.cpu(), ids)
    got = head_argmax_triton(
        x,
        weight,
        None if bias is None else bias.to(DEVICE),
        None if ids is None else ids.to(DEVICE),
        config=config,
    ).cpu()
    assert got.dtype == torch.long and got.shape == want.shape
    assert torch.equal(got, want), (got, want)


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("vocab", [7, 64, 1000])  # under one block, whole blocks, a partial last block
@pytest.mark.parametrize("with_bias", [False, True])
def test_random_heads_pick_the_reference_argmax(rows, vocab, with_bias):
    gen = torch.Generator().manual_seed(vocab + rows)
    x = _poisoned(torch.randn(rows, 300, generator=gen), 0, 20)  # K = 300: tiles of 128, a masked third
    weight = _poisoned(torch.randn(vocab, 300, generator=gen), 5, 36)
    bias = torch.randn(vocab, generator=gen) if with_bias else None
    _check(x, weight, bias, config={"BLOCK_K": 128})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2])
def test_ties_keep_the_first_index_inside_and_across_programs_and_chunks(dtype, rows):
    # Small integer logits (exact in bf16 and in any summation order): many tied maxima everywhere. Two head
    # rows per program and 84 rows: 42 partials, merged 16 at a time (three chunks).
    gen = torch.Generator().manual_seed(rows)
    vocab, width = 84, 8
    x = torch.ones(rows, width, dtype=dtype).to(DEVICE)
    weight = torch.randint(0, 3, (vocab, width), generator=gen).to(dtype)
    config = {"BLOCK_N": 2, "BLOCK_K": 8, "BLOCK_P": 16}
    _check(x, _poisoned(weight, 3, 0), config=config)
    weight[:] = 1  # every logit tied: index 0
    _check(x, weight.to(DEVICE), config=config)
    weight[vocab - 1] = 3  # the maximum alone in the last program of the last chunk
    _check(x, weight.to(DEVICE), config=config)
    weight[40, 0] = (
        2  # a larger one in the second chunk and a tie of it in the third: the second chunk's wins
    )
    weight[70, 0] = 2
    weight[vocab - 1] = 1
    _check(x, weight.to(DEVICE), config=config)


def test_nan_is_the_largest_and_the_first_nan_wins():
    gen = torch.Generator().manual_seed(3)
    vocab, width = 84, 16
    x = torch.randn(2, width, generator=gen).to(DEVICE)
    weight = torch.randn(vocab, width, generator=gen)
    weight[5, 0] = float("inf")  # +inf logits (row 0 at least) lose to a later NaN
    weight[75, 3] = float("nan")
    weight[45, 2] = float("nan")  # the first NaN, a chunk earlier
    _check(x, weight.to(DEVICE), config={"BLOCK_N": 2, "BLOCK_K": 16, "BLOCK_P": 16})
    _check(x, weight.to(DEVICE))  # the default blocks


def test_an_id_map_returns_the_pick_s_id():
    gen = torch.Generator().manual_seed(4)
    vocab = 333
    x = torch.randn(2, 64, generator=gen).to(DEVICE)
    weight = torch.randn(vocab, 64, generator=gen).to(DEVICE)
    ids = torch.randperm(40 * vocab, generator=gen)[:vocab]  # draft id -> target id, not sorted
    _check(x, weight, ids=ids)
    _check(x[:1], weight, ids=ids)


def test_bf16_picks_a_maximum_of_the_rounded_logits():
    # Random bf16 logits: the kernel's sum order (and the interpreter's truncating conversion) may move a logit
    # by its last bit, so the pick is checked to hold the reference's maximum within that bit.
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 576, generator=gen).bfloat16().to(DEVICE)
    weight = (torch.randn(4096, 576, generator=gen) / 24).bfloat16().to(DEVICE)
    logits = (x.float().cpu() @ weight.float().cpu().T).bfloat16().float()  # [2, V]
    got = head_argmax_triton(x, weight).cpu()
    top = logits.max(-1).values
    picked = logits.gather(-1, got[:, None])[:, 0]
    assert (top - picked <= top.abs() * 2**-7).all(), (top, picked)


def test_the_counter_is_left_at_zero_for_the_next_launch():
    from longspec.kernels.head_argmax.triton import _counter

    gen = torch.Generator().manual_seed(6)
    x = torch.randn(1, 32, generator=gen).to(DEVICE)
    heads = [torch.randn(v, 32, generator=gen).to(DEVICE) for v in (100, 517, 100)]
    for weight in heads:  # each launch merges its own partials alone
        _check(x, weight)
        assert int(_counter(x.device)) == 0


def test_bad_calls_and_the_dispatcher():
    x = torch.randn(3, 16)
    weight = torch.randn(50, 16)
    with pytest.raises(ValueError, match="at most 2 rows"):
        head_argmax_triton(x.to(DEVICE), weight.to(DEVICE))
    with pytest.raises(ValueError, match="empty head"):
        head_argmax_triton(x[:1].to(DEVICE), weight[:0].to(DEVICE))
    assert head_argmax_triton(x[:0].to(DEVICE), weight.to(DEVICE)).shape == (0,)
    # the dispatcher: leading dims kept; on the CPU (or past two rows) the reference itself
    x3 = torch.randn(3, 1, 16)
    assert torch.equal(head_argmax(x3, weight), (x3 @ weight.T).argmax(-1))
