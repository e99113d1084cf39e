"""The greedy chain acceptance kernel (the CPU interpreter in CI) against its reference, and the reference against
the tree walk (`accept.greedy_path`): every outcome of a chain (no draft, all drafts, a miss at each depth, invalid
drafts), rows of one batch with different outcomes, inputs read through their strides, outputs NaN-free by
construction (long): unwritten entries are caught by a poisoned allocator."""

import pytest
import torch

pytest.importorskip("triton")

from longspec.infer.accept import greedy_path  # noqa: E402
from longspec.infer.tree import ForestParts  # noqa: E402
from longspec.kernels.chain_accept import greedy_chain_packed, greedy_chain_packed_naive  # noqa: E402
from longspec.kernels.chain_accept import triton as kernels  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
POISON = -7  # what every output entry holds before the kernel writes it


@pytest.fixture
def poisoned(monkeypatch):
    """The kernel's outputs allocated full of POISON, so an entry it leaves unwritten shows."""
    empty = torch.empty

    def full_of_poison(*shape, **kwargs):
        return empty(*shape, **kwargs).fill_(POISON)

    monkeypatch.setattr(kernels.torch, "empty", full_of_poison)


def _chains(depth: int, batch: int, seed: int):
    """tokens / target argmax / valid [batch, depth + 1]: row r's drafts match the target's choice up to depth
    r % (depth + 1), then miss; the last row matches everything; some drafts past the first miss are invalid."""
    gen = torch.Generator().manual_seed(seed)
    N = depth + 1
    argmax = torch.randint(0, 50, (batch, N), generator=gen)
    tokens = torch.randint(0, 50, (batch, N), generator=gen)
    tokens[:, 1:] = argmax[:, :-1]  # every draft matches ...
    for r in range(batch - 1):
        miss = r % N
        if miss < depth:
            tokens[r, miss + 1] = (argmax[r, miss] + 1) % 50  # ... until its miss
    valid = torch.ones(batch, N, dtype=torch.bool)
    if depth >= 2:
        valid[0, 2:] = False  # row 0: an invalid draft ends the run (padding, e.g. a short lookup)
    return tokens, argmax, valid


@pytest.mark.parametrize("depth", [0, 1, 2, 4, 16, 40])
def test_kernel_equals_reference(depth, poisoned):
    tokens, argmax, valid = _chains(depth, batch=max(depth + 2, 3), seed=depth)
    want = greedy_chain_packed_naive(tokens, argmax, valid)
    got = kernels.greedy_chain_packed_triton(tokens.to(DEVICE), argmax.to(DEVICE), valid.to(DEVICE))
    for g, w in zip(got, want, strict=True):
        assert g.dtype == torch.long and torch.equal(g.cpu(), w), (g, w)
    # the outcomes built in: row r stops at its miss (depth r % N), the last row accepts every draft
    N, batch = depth + 1, tokens.shape[0]
    expected = [r % N + 1 if r % N < depth else N for r in range(batch - 1)] + [N]
    assert want[0][:, -1].tolist() == expected


def test_kernel_reads_strided_inputs():
    """A plain round's tokens are a view of the roots ([B, 1], stride (1, 1)); a lookup's valid may be expanded."""
    tokens, argmax, valid = _chains(3, batch=4, seed=1)
    wide = torch.zeros(4, 9, dtype=torch.long)
    wide[:, ::2][:, :4] = tokens
    strided = wide[:, ::2][:, :4]
    expanded = valid[:1].expand(4, -1)
    want = greedy_chain_packed_naive(tokens, argmax, expanded)
    got = kernels.greedy_chain_packed_triton(strided.to(DEVICE), argmax.to(DEVICE), expanded.to(DEVICE))
    assert all(torch.equal(g.cpu(), w) for g, w in zip(got, want, strict=True))


@pytest.mark.parametrize("depth", [1, 3])
def test_reference_equals_the_tree_walk(depth):
    """The chain's rule is the tree's rule on a chain: path, count and bonus as `greedy_path` walks them."""
    tokens, argmax, valid = _chains(depth, batch=depth + 2, seed=5)
    parents, depths, ancestor_mask, _ = ForestParts(torch.device("cpu"))(tokens.shape[0], depth)
    path, length, bonus = greedy_path(tokens, parents, depths, ancestor_mask, argmax, valid, depth)
    packed, chain_bonus = greedy_chain_packed(tokens, argmax, valid)
    N = depth + 1
    assert torch.equal(packed[:, -1], length) and torch.equal(chain_bonus, bonus)
    for row in range(tokens.shape[0]):
        n = int(length[row])
        assert packed[row, N : N + n].tolist() == path[row, :n].tolist()
        emitted = tokens[row, path[row, 1:n]].tolist() + [int(bonus[row])]
        assert packed[row, :n].tolist() == emitted


@pytest.mark.parametrize("depth", [1, 3, 17])
@pytest.mark.parametrize("rule", ["rrs", "deterministic"])
def test_sample_chain_decisions_equal_reference(depth, rule, poisoned):
    """Decisions of sampled chains: rows that stop at every depth (draws set against p / q), at an invalid draft,
    and at the leaf; rrs reads q at the draft, the deterministic rule the given row sums."""
    from longspec.kernels.chain_accept import sample_chain_decide_naive

    gen = torch.Generator().manual_seed(depth)
    B, N, V = depth + 3, depth + 1, 37
    tokens = torch.randint(0, V, (B, N), generator=gen)
    valid = torch.ones(B, N, dtype=torch.bool)
    valid[0, 1:] = False  # a lookup's padding: nothing tried
    p = torch.rand(B, N, V, generator=gen)
    p = p / p.sum(-1, keepdim=True)
    q = torch.rand(B, depth, V, generator=gen) if rule == "rrs" else None
    q = None if q is None else q / q.sum(-1, keepdim=True)
    threshold = None if q is not None else p[:, :depth].sum(-1, dtype=torch.float64)
    draws = torch.rand(B, depth + 1, generator=gen)
    draws[1:, :] = 0.0  # accepted wherever p(x) > 0 ...
    for row in range(
        1, B - 1
    ):  # ... until row r's draft r - 1 meets a draw of 1: rejected (p / t <= 1 there)
        if row - 1 < depth:
            draws[row, row - 1] = 1.0
    want = sample_chain_decide_naive(tokens, valid, p, draws, threshold, q)
    got = kernels.sample_chain_decide_triton(
        tokens.to(DEVICE), valid.to(DEVICE), p.to(DEVICE), draws.to(DEVICE),
        None if threshold is None else threshold.to(DEVICE), None if q is None else q.to(DEVICE),
    )  # fmt: skip
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g.cpu(), w), (g, w)
    assert (
        want[0][0] == 0 and not want[1][0]
    )  # the row without valid drafts: stops at the root, nothing tried
    assert want[0][-1] == depth and not want[1][-1]  # every draft accepted: the leaf


@pytest.mark.parametrize("depth", [0, 1, 4])
def test_chain_pack_equals_reference(depth, poisoned):
    from longspec.kernels.chain_accept import chain_packed_naive

    B, N = 4, depth + 1
    tokens = torch.randint(0, 50, (B, N), generator=torch.Generator().manual_seed(3))
    length = torch.tensor([1, N, min(2, N), max(1, N - 1)])
    bonus = torch.tensor([7, 8, 9, 10])
    want = chain_packed_naive(tokens, length, bonus)
    got = kernels.chain_packed_triton(tokens.to(DEVICE), length.to(DEVICE), bonus.to(DEVICE))
    assert torch.equal(got.cpu(), want)
