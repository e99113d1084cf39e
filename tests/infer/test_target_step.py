"""The target side of a round: the sliding-window key selection of the one target forward, host vs device."""

import pytest
import torch

from longspec.infer.target_step import _window_keys


@pytest.mark.parametrize("n", [0, 3, 5, 6, 11])
def test_window_keys_host_and_device_select_the_same_visible_keys(n):
    """The sliding-window key selection of the one target forward, with the cache length on the host (a slice)
    and on the device (fixed-size indices, what a CUDA graph replays), against the plain rule: new token i at
    position n + offsets[i] sees key position j iff j < n (cached) or j is a new token under new_mask, and
    t - j <= window. n < window covers the clamped, non-existent slots of the device selection."""
    window = 5
    offsets = torch.tensor([0, 1, 1, 2, 3])  # a tree: root, two children, a grandchild, its child
    new_mask = torch.tensor(
        [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 1, 0, 1, 1]],
        dtype=torch.bool,
    )
    T = offsets.numel()
    # Absolute key position of cache slot s is s (s < n); new token k sits in slot n + k at position n + offsets[k].
    expected = set()
    for i in range(T):
        t = n + int(offsets[i])
        expected |= {(i, ("cache", j)) for j in range(n) if t - j <= window}
        expected |= {
            (i, ("new", k)) for k in range(T) if new_mask[i, k] and offsets[i] - offsets[k] <= window
        }
    for length in (n, torch.tensor(n)):
        select, mask = _window_keys(length, offsets, new_mask, window)
        slots = torch.arange(n + T)[select].tolist()
        seen = {
            (i, ("cache", slot) if slot < n else ("new", slot - n))
            for i in range(T)
            for col, slot in enumerate(slots)
            if mask[i, col]
        }
        assert seen == expected, type(length)
