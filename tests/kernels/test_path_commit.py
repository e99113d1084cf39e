"""The commit bookkeeping kernel (the CPU interpreter in CI) against its reference, and the reference's ring slots
against the ring's general slot rule (`DrafterCache.claim_slots` on the same right-padded path): rows that keep
every path column, some, or none (a frozen row); a ring that wraps; a history row whose end clamps the padding;
with and without the history and the ring. Outputs are allocated poisoned, so an unwritten entry shows."""

import pytest
import torch

pytest.importorskip("triton")

from longspec.drafter import DrafterConfig  # noqa: E402
from longspec.drafter.cache import DrafterCache  # noqa: E402
from longspec.kernels.path_commit import commit_path_naive  # noqa: E402
from longspec.kernels.path_commit import triton as kernels  # noqa: E402
from longspec.testing import make_tiny_target  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
W, S = 8, 20  # ring slots, history slots


@pytest.fixture
def poisoned(monkeypatch):
    """The kernel's outputs allocated full of -7, so an entry it leaves unwritten shows."""
    empty = torch.empty
    monkeypatch.setattr(kernels.torch, "empty", lambda *a, **k: empty(*a, **k).fill_(-7))


def _state(k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 100, (4, k), generator=gen)
    counts = torch.tensor([k, 1, 0, min(2, k)])  # every column, the root only, a frozen row, some
    lengths = torch.tensor([3, 9, 5, S - 1])  # the last row's padding runs past the history's end
    history = torch.randint(0, 100, (4, S), generator=gen)
    ring_positions = torch.randint(-1, 30, (4, W), generator=gen)
    ring_appended = torch.tensor([0, 7, 13, 30])  # an empty ring, one about to wrap, wrapped rings
    return tokens, counts, lengths, history, ring_positions, ring_appended


@pytest.mark.parametrize("k", [1, 2, 5, W])
@pytest.mark.parametrize("history, ring", [(True, True), (True, False), (False, False)])
def test_kernel_equals_reference(k, history, ring, poisoned):
    tokens, counts, lengths, hist, ring_pos, ring_app = _state(k, seed=k)
    ref = [t.clone() for t in (lengths, hist, ring_pos, ring_app)]
    got = [t.clone().to(DEVICE) for t in (lengths, hist, ring_pos, ring_app)]
    want_out = commit_path_naive(
        tokens, counts, ref[0], history=ref[1] if history else None,
        ring_positions=ref[2] if ring else None, ring_appended=ref[3] if ring else None,
    )  # fmt: skip
    got_out = kernels.commit_path_triton(
        tokens.to(DEVICE), counts.to(DEVICE), got[0], history=got[1] if history else None,
        ring_positions=got[2] if ring else None, ring_appended=got[3] if ring else None,
    )  # fmt: skip
    for g, w in zip(got_out, want_out, strict=True):
        assert (g is None and w is None) or torch.equal(g.cpu(), w)
    # Columns past the history's end all land in its last slot (clamped, junk no reader sees): which one wins is
    # the device's order there, so that slot is compared only where one column writes it.
    if history:
        crowded = lengths + k - 1 > S - 1
        got[1][crowded.to(DEVICE), -1] = ref[1][crowded, -1] = 0
    for g, w in zip(got, ref, strict=True):
        assert torch.equal(g.cpu(), w)
    assert torch.equal(ref[0], lengths + counts)  # the lengths advanced
    if not history:
        assert torch.equal(ref[1], hist)
    if not ring:
        assert torch.equal(ref[2], ring_pos) and torch.equal(ref[3], ring_app)


@pytest.mark.parametrize("k", [1, 3, W])
def test_reference_claims_the_slots_the_rings_rule_gives(k):
    """The commit's ring slots and bookkeeping are what `claim_slots` gives the same path, right-padded (position
    -1 past each row's count), and its history write is each column at its position."""
    tokens, counts, lengths, hist, _, _ = _state(k, seed=1)
    config = DrafterConfig.from_target_config(make_tiny_target("llama").config, window=W)
    ring = DrafterCache(config, 4)
    ring.positions.copy_(torch.randint(-1, 30, (4, W), generator=torch.Generator().manual_seed(2)))
    ring.num_appended.copy_(torch.tensor([0, 7, 13, 30]))
    rule = DrafterCache(config, 4)
    rule.positions.copy_(ring.positions)
    rule.num_appended.copy_(ring.num_appended)
    steps = torch.arange(k)
    padded = torch.where(steps < counts[:, None], lengths[:, None] + steps, -1)
    want_slots = rule.claim_slots(padded)
    new_lengths, new_hist = lengths.clone(), hist.clone()
    positions, slots = commit_path_naive(
        tokens, counts, new_lengths, history=new_hist, ring_positions=ring.positions,
        ring_appended=ring.num_appended,
    )  # fmt: skip
    kept = padded >= 0
    assert torch.equal(slots[kept], want_slots[kept]) and (slots[~kept] == -1).all()
    assert torch.equal(ring.positions, rule.positions) and torch.equal(ring.num_appended, rule.num_appended)
    assert torch.equal(positions, lengths[:, None] + steps)
    want_hist = hist.clone()
    for row in range(4):
        for col in range(k):
            want_hist[row, min(int(lengths[row]) + col, S - 1)] = tokens[row, col]
    assert torch.equal(new_hist, want_hist)
