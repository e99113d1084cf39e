"""BatchSlots: the bookkeeping behind batch buckets and finished rows leaving a static batch."""

import pytest
import torch

from longspec.infer.slots import BatchSlots, bucket, compaction


def test_bucket_is_the_next_power_of_two():
    assert [bucket(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 16]


def test_shrink_keeps_the_running_slots_in_their_bucket():
    slots = BatchSlots([True, False, True, True, True, False, True, False], torch.device("cpu"))
    assert slots.shrink() is None  # 5 of 8 still run
    slots.active[4] = slots.active[6] = False
    assert torch.equal(slots.mask(), torch.tensor(slots.active))
    assert slots.shrink() == [0, 2, 3, 3]  # 3 of 8: the bucket of 4; its padding slot keeps what it holds
    assert slots.rows[:3] == [0, 2, 3] and slots.active == [True, True, True, False]
    assert slots.running() == [(0, 0), (1, 2), (2, 3)]
    assert torch.equal(slots.mask(), torch.tensor([True, True, True, False]))  # a new pattern, a new mask
    slots.active[1] = False
    assert slots.shrink() == [0, 2] and slots.rows == [0, 3]  # 2 of 4: the bucket of 2
    slots.active[0] = False
    assert slots.shrink() == [1] and slots.rows == [3]
    assert slots.shrink() is None  # one slot left: nothing to shrink


def test_compaction_moves_rows_front_to_back():
    """The moves of a shrink are safe in place: each reads a row no earlier move wrote."""
    assert compaction([0, 2, 3, 3]) == [(1, 2), (2, 3)]
    assert compaction([1]) == [(0, 1)]
    with pytest.raises(ValueError, match="in place"):
        compaction([2, 0])  # row 1 would take row 0 after row 0 was overwritten
    with pytest.raises(ValueError, match="in place"):
        compaction([0, 0])
