"""Shared helpers for the inference tests."""

import pytest
import torch


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square test of observed `counts` [K] against `probs` [K]; cells with expected < 5 are pooled
    into one so the chi-square approximation holds."""
    counts, probs = counts.double(), probs.double() / probs.double().sum()
    expected = probs * counts.sum()
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum().reshape(1)])
    exp = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


@pytest.fixture
def chi_square():
    """chi_square(counts [K], probs [K]) -> p-value."""
    return chi_square_pvalue


@pytest.fixture(autouse=True, scope="session")
def _one_thread(one_thread):
    """Tiny shapes only: one intra-op thread (tests/conftest.py)."""
