"""Anchor-offset position ids (ALGORITHM §3.1)."""

import pytest
import torch

from longspec.positions import PAPER_MAX_LEN, anchor_offset_position_ids, default_max_len


def test_anchors_then_one_contiguous_shifted_run():
    pos = anchor_offset_position_ids(8, 50, max_len=15_000, generator=torch.Generator().manual_seed(0))
    assert pos.shape == (8, 50) and pos.dtype == torch.long
    assert (pos[:, :4] == torch.arange(4)).all()
    assert (pos[:, 5:] - pos[:, 4:-1] == 1).all()  # contiguous after the anchors
    offsets = pos[:, 4] - 4
    assert (offsets >= 0).all()
    assert len(set(offsets.tolist())) > 1  # one offset per row


def test_positions_stay_below_max_len():
    gen = torch.Generator().manual_seed(1)
    pos = anchor_offset_position_ids(4096, 20, max_len=30, generator=gen)
    assert pos.max() <= 29 and pos.min() >= 0
    offsets = (pos[:, 4] - 4).unique().tolist()
    assert offsets == list(range(0, 30 - 20 + 1))  # the whole range U[0, max_len - L] is reachable


def test_seeded_reproducibility():
    a = anchor_offset_position_ids(3, 16, max_len=1000, generator=torch.Generator().manual_seed(7))
    b = anchor_offset_position_ids(3, 16, max_len=1000, generator=torch.Generator().manual_seed(7))
    c = anchor_offset_position_ids(3, 16, max_len=1000, generator=torch.Generator().manual_seed(8))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_max_len_equal_to_seq_len_is_plain_arange():
    pos = anchor_offset_position_ids(2, 12, max_len=12)
    assert torch.equal(pos, torch.arange(12).expand(2, 12))


def test_num_anchors():
    gen = torch.Generator().manual_seed(2)
    none = anchor_offset_position_ids(2, 10, max_len=500, num_anchors=0, generator=gen)
    assert (none[:, 1:] - none[:, :-1] == 1).all()
    short = anchor_offset_position_ids(2, 3, max_len=500, generator=gen)  # shorter than the anchors
    assert torch.equal(short, torch.arange(3).expand(2, 3))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(batch_size=1, seq_len=100, max_len=99), "max_len"),
        (dict(batch_size=0, seq_len=10, max_len=99), "batch_size"),
        (dict(batch_size=1, seq_len=10, max_len=99, num_anchors=-1), "num_anchors"),
    ],
)
def test_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        anchor_offset_position_ids(**kwargs)


def test_default_max_len_is_the_papers_rule():
    """15K for the paper's 16K-context target, 30K for its 32K / 40K / 128K ones; a little under any context."""
    assert [default_max_len(n) for n in (16384, 32768, 40960, 131072)] == [15000, 30000, 30000, 30000]
    assert (default_max_len(8192), default_max_len(4096)) == (7500, 3750)
    for n in (1, 2, 63, 1000, 4096, 20000, 10**6):
        assert 1 <= default_max_len(n) <= min(n, PAPER_MAX_LEN)
    with pytest.raises(ValueError, match="max_positions must be >= 1"):
        default_max_len(0)
