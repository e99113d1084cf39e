"""Flash-noisy cross-attention vs an explicit-mask reference (query t sees target KV <= t - lag)."""

import math

import pytest
import torch

from longspec.modules.noisy import flash_noisy_attention, sample_lag


def _reference(q, k, v, lag):
    """Plain softmax attention with the lag mask written out; rows with no visible key are zero."""
    B, H, T, D = q.shape
    group = H // k.shape[1]
    k = k.repeat_interleave(group, dim=1).double()
    v = v.repeat_interleave(group, dim=1).double()
    scores = q.double() @ k.transpose(-1, -2) / math.sqrt(D)
    t = torch.arange(T)
    visible = t[None, :] <= t[:, None] - lag  # [query, key]
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # all -inf rows -> NaN -> 0
    return (probs @ v).float()


@pytest.mark.parametrize("lag", [0, 1, 2, 3, 4])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2), (8, 1)])
def test_matches_explicit_mask(lag, heads, kv_heads):
    T = 13  # odd
    q = torch.randn(2, heads, T, 8)
    k, v = torch.randn(2, kv_heads, T, 8), torch.randn(2, kv_heads, T, 8)
    out = flash_noisy_attention(q, k, v, lag)
    torch.testing.assert_close(out, _reference(q, k, v, lag), atol=1e-5, rtol=1e-5)
    assert (out[:, :, :lag] == 0).all()


def test_gradients_match_reference():
    lag, T = 3, 11
    q = torch.randn(1, 4, T, 8, requires_grad=True)
    k = torch.randn(1, 2, T, 8, requires_grad=True)
    v = torch.randn(1, 2, T, 8, requires_grad=True)
    w = torch.randn(1, 4, T, 8)
    grads = torch.autograd.grad((flash_noisy_attention(q, k, v, lag) * w).sum(), (q, k, v))
    ref = torch.autograd.grad((_reference(q, k, v, lag) * w).sum(), (q, k, v))
    for g, r in zip(grads, ref, strict=True):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)
    assert (grads[1][:, :, T - lag :] == 0).all()  # the last `lag` target keys are never visible


def test_lag_at_least_sequence_length_is_all_zero():
    q, k = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
    assert (flash_noisy_attention(q, k, k, 4) == 0).all()
    assert (flash_noisy_attention(q, k, k, 9) == 0).all()


def test_input_validation():
    q, k = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="same 5 positions"):
        flash_noisy_attention(q, k, k, 1)
    with pytest.raises(ValueError, match="lag"):
        flash_noisy_attention(q, q, q, -1)


def test_sample_lag_range_and_reproducibility():
    gen = torch.Generator().manual_seed(0)
    draws = [sample_lag(5, generator=gen) for _ in range(400)]
    assert set(draws) == {1, 2, 3, 4}  # j in 1..γ-1 for γ = 5
    again = torch.Generator().manual_seed(0)
    assert draws[:20] == [sample_lag(5, generator=again) for _ in range(20)]
    assert sample_lag(2) == 1
    with pytest.raises(ValueError, match="num_draft_levels"):
        sample_lag(1)
