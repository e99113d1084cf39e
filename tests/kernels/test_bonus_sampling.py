"""The bonus draw of a sampled chain round: the Triton kernels (the CPU interpreter in CI) against the plain-PyTorch
reference, reading only the stop node's rows (every other row NaN-poisoned) and writing into a poisoned buffer."""

import pytest
import torch

pytest.importorskip("triton")

from longspec.infer.accept import target_distribution  # noqa: E402
from longspec.kernels.bonus_sampling import inverse_cdf, sample_bonus, sample_bonus_naive  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(batch, nodes, vocab, generator, *, rule):
    """p per node, q close to it (rrs) or None, a stop node per row, whether it stopped on a rejection, the
    rejected draft (drawn from q or p: likely tokens, so p without it or max(p - q, 0) differ from p), uniforms."""
    logits = torch.randn(batch, nodes, vocab, generator=generator) * 3
    p = target_distribution(logits, temperature=1.0)
    q = target_distribution(logits + torch.randn(logits.shape, generator=generator), temperature=1.0)
    stop = torch.randint(0, nodes, (batch,), generator=generator)
    rejected = (torch.rand(batch, generator=generator) < 0.7) & (stop < nodes - 1)
    source = (q if rule == "rrs" else p)[torch.arange(batch), stop]
    token = torch.multinomial(source, 1, generator=generator)[:, 0]
    u = torch.rand(batch, dtype=torch.float64, generator=generator)
    draft = q[:, : nodes - 1] if rule == "rrs" else None  # the leaf has no q
    return p, draft, stop, rejected, token, u


def _poison_all_but_stop(x, stop):
    poisoned = torch.full_like(x, float("nan"))
    rows = torch.arange(x.shape[0])
    poisoned[rows, stop.clamp(max=x.shape[1] - 1)] = x[rows, stop.clamp(max=x.shape[1] - 1)]
    return poisoned


@pytest.mark.parametrize("rule", ["rrs", "deterministic"])
@pytest.mark.parametrize(
    "vocab", [37, 1024, 5000]
)  # one partial chunk, exactly one, several and a partial one
def test_kernel_draw_equals_the_reference(rule, vocab):
    generator = torch.Generator().manual_seed(vocab)
    batch, nodes = 64, 4
    p, q, stop, rejected, token, u = _case(batch, nodes, vocab, generator, rule=rule)
    expected = sample_bonus_naive(p, q, stop, rejected, token, u)
    p_in = _poison_all_but_stop(p, stop)
    q_in = None if q is None else _poison_all_but_stop(q, stop)
    out = torch.full((batch,), -7, dtype=torch.long, device=DEVICE)
    to = lambda x: None if x is None else x.to(DEVICE)  # noqa: E731
    got = sample_bonus(to(p_in), to(q_in), to(stop), to(rejected), to(token), to(u), out=out)
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(got.cpu(), expected)
    assert rejected.any() and (~rejected).any()
    # a rejected draft is never the bonus under the deterministic rule (p without it), and is less likely under rrs
    if rule == "deterministic":
        assert not (expected[rejected] == token[rejected]).any()


def test_kernel_draw_uniform_extremes_and_fallbacks():
    """u at 0 and just below 1 (the first and last tokens with weight), a residual without mass (q == p: rrs falls
    back to p) and a deterministic draft that held all of p's mass (falls back to p)."""
    vocab = 3000
    p = torch.zeros(4, 2, vocab)
    p[:, :, 5], p[:, :, 2999], p[:, :, 1700] = 0.25, 0.25, 0.5
    q = p[:, :1].clone()
    stop = torch.zeros(4, dtype=torch.long)
    rejected = torch.tensor([False, False, True, True])
    u = torch.tensor([0.0, 1.0 - 1e-12, 0.3, 0.99], dtype=torch.float64)
    token = torch.full((4,), 1700, dtype=torch.long)
    for draft in (q, None):
        expected = sample_bonus_naive(p, draft, stop, rejected, token, u)
        d = None if draft is None else draft.to(DEVICE)
        got = sample_bonus(
            p.to(DEVICE), d, stop.to(DEVICE), rejected.to(DEVICE), token.to(DEVICE), u.to(DEVICE)
        )
        assert torch.equal(got.cpu(), expected)
    assert sample_bonus_naive(p, q, stop, rejected, token, u).tolist() == [5, 2999, 1700, 2999]  # q == p: p
    assert sample_bonus_naive(p, None, stop, rejected, token, u).tolist() == [
        5,
        2999,
        5,
        2999,
    ]  # p without 1700
    one = torch.zeros(1, 1, vocab)
    one[0, 0, 1700] = 1.0  # the draft held all the mass: rejected only through rounding, p itself
    args = (torch.zeros(1, dtype=torch.long), torch.tensor([True]), torch.tensor([1700]))
    assert sample_bonus_naive(one, None, *args, torch.tensor([0.5], dtype=torch.float64)).item() == 1700


def test_inverse_cdf_never_draws_a_zero_weight():
    weights = torch.tensor([[0.0, 1.0, 0.0, 0.0, 2.0, 0.0]])
    draws = [
        inverse_cdf(weights, torch.tensor([u], dtype=torch.float64)).item() for u in (0.0, 0.3, 0.34, 0.99)
    ]
    assert draws == [1, 1, 4, 4]
