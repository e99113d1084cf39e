"""Fused linear losses vs plain torch on full logits (and vs Liger under the Triton interpreter)."""

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from longspec.losses import fused_linear_ce_kl, fused_linear_cross_entropy, linear_top1_correct

N, DM, V = 23, 16, 37  # odd sizes: chunks of 5 leave a ragged last chunk


def _inputs(dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, DM, generator=gen, dtype=dtype).requires_grad_()
    weight = torch.randn(V, DM, generator=gen, dtype=dtype).requires_grad_()
    labels = torch.randint(0, V, (N,), generator=gen)
    labels[[0, 7, 8, 22]] = -100
    return hidden, weight, labels


@pytest.mark.parametrize("chunk_size", [1, 5, 64])
def test_chunked_ce_equals_torch_ce_with_grads(chunk_size):
    hidden, weight, labels = _inputs()
    loss = fused_linear_cross_entropy(hidden, weight, labels, backend="chunked", chunk_size=chunk_size)
    grads = torch.autograd.grad(loss, (hidden, weight))
    ref = F.cross_entropy(hidden @ weight.T, labels, ignore_index=-100, reduction="sum")
    ref_grads = torch.autograd.grad(ref, (hidden, weight))
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-6)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)
    assert (grads[0][[0, 7, 8, 22]] == 0).all()  # ignored tokens get no gradient


def test_auto_on_cpu_is_chunked_and_returns_a_sum():
    hidden, weight, labels = _inputs()
    loss = fused_linear_cross_entropy(hidden.detach(), weight.detach(), labels)
    per_token = F.cross_entropy(hidden @ weight.T, labels, reduction="none")
    torch.testing.assert_close(loss, per_token.sum(), atol=1e-5, rtol=1e-6)  # ignored tokens contribute 0
    assert loss.dtype == torch.float32 and loss.dim() == 0


def test_grad_output_scaling_and_frozen_weight():
    hidden, weight, labels = _inputs()
    frozen = weight.detach()  # the LM head is frozen in training: no weight gradient is computed
    loss = fused_linear_cross_entropy(hidden, frozen, labels, chunk_size=4)
    (g,) = torch.autograd.grad(loss * 0.25, hidden)  # e.g. division by the global token count
    ref = F.cross_entropy(hidden @ frozen.T, labels, reduction="sum") * 0.25
    (r,) = torch.autograd.grad(ref, hidden)
    torch.testing.assert_close(g, r, atol=1e-6, rtol=1e-5)


def test_batched_leading_shape_and_all_ignored():
    hidden, weight, labels = _inputs()
    h3, y3 = hidden.detach()[:22].view(2, 11, DM), labels[:22].view(2, 11)
    flat = fused_linear_cross_entropy(hidden.detach()[:22], weight.detach(), labels[:22], chunk_size=3)
    torch.testing.assert_close(fused_linear_cross_entropy(h3, weight.detach(), y3, chunk_size=3), flat)
    none = fused_linear_cross_entropy(hidden, weight, torch.full((N,), -100))
    assert none.item() == 0.0


def test_bf16_inputs_close_to_fp32():
    hidden, weight, labels = _inputs()
    ref = fused_linear_cross_entropy(hidden.detach(), weight.detach(), labels, backend="torch")
    bf = fused_linear_cross_entropy(
        hidden.detach().bfloat16(), weight.detach().bfloat16(), labels, chunk_size=5
    )
    assert bf.dtype == torch.float32
    torch.testing.assert_close(bf, ref, rtol=2e-2, atol=0.5)


def test_validation():
    hidden, weight, labels = _inputs()
    with pytest.raises(ValueError, match="unknown loss backend"):
        fused_linear_cross_entropy(hidden, weight, labels, backend="fast")
    with pytest.raises(ValueError, match="leading shape"):
        fused_linear_cross_entropy(hidden, weight, labels[:-1])
    with pytest.raises(ValueError, match="does not match the LM head"):
        fused_linear_cross_entropy(hidden[:, :-1], weight, labels)
    with pytest.raises(ValueError, match="chunk_size"):
        fused_linear_cross_entropy(hidden, weight, labels, chunk_size=0)


def test_top1_correct_counts_valid_matches():
    hidden, weight, labels = _inputs()
    pred = (hidden @ weight.T).argmax(-1)
    labels = labels.clone()
    labels[1:6] = pred[1:6]  # make a few right
    expected = ((pred == labels) & (labels != -100)).sum()
    got = linear_top1_correct(hidden, weight, labels, chunk_size=4)
    assert got.item() == expected.item() >= 5 and got.dtype == torch.long


def _reference_ce_kl(hidden, teacher, weight, labels, distill_weight, temperature):
    """Full logits, autograd, torch's own cross-entropy and KL: the definition the fused pass must equal."""
    valid = labels != -100
    ce = F.cross_entropy(hidden @ weight.T, labels, ignore_index=-100, reduction="sum")
    log_ps = F.log_softmax(hidden @ weight.T / temperature, -1)
    log_pt = F.log_softmax(teacher @ weight.detach().T / temperature, -1)
    kl = (F.kl_div(log_ps, log_pt, log_target=True, reduction="none").sum(-1) * valid).sum()
    return ce + distill_weight * kl, ce, kl


@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("chunk_size", [1, 5, 64])
def test_fused_ce_kl_equals_full_logits_with_grads(temperature, chunk_size):
    hidden, weight, labels = _inputs(seed=1)
    teacher = torch.randn(N, DM, generator=torch.Generator().manual_seed(9))
    loss, ce, kl, correct = fused_linear_ce_kl(
        hidden, teacher, weight, labels, distill_weight=0.7, temperature=temperature, chunk_size=chunk_size
    )
    grads = torch.autograd.grad(3.0 * loss, (hidden, weight))  # a grad_out other than 1 is applied
    ref, ref_ce, ref_kl = _reference_ce_kl(hidden, teacher, weight, labels, 0.7, temperature)
    ref_grads = torch.autograd.grad(3.0 * ref, (hidden, weight))
    for got, want in ((loss, ref), (ce, ref_ce), (kl, ref_kl), *zip(grads, ref_grads, strict=True)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert not ce.requires_grad and not kl.requires_grad
    assert (grads[0][[0, 7, 8, 22]] == 0).all()  # rows without a label get no gradient
    valid = labels != -100
    assert correct.item() == (((hidden @ weight.T).argmax(-1) == labels) & valid).sum().item()


def test_fused_ce_kl_in_bf16_tracks_the_float32_definition():
    """What training runs: bf16 hidden, teacher and head (the vocabulary matmuls in bf16, their softmax in fp32)."""
    hidden, weight, labels = _inputs(seed=3)
    teacher = torch.randn(N, DM, generator=torch.Generator().manual_seed(4))
    h16 = hidden.detach().bfloat16().requires_grad_()
    loss, ce, kl, _ = fused_linear_ce_kl(
        h16, teacher.bfloat16(), weight.detach().bfloat16(), labels, distill_weight=1.0, chunk_size=5
    )
    grad = torch.autograd.grad(loss, h16)[0]
    h32, w32 = h16.detach().float().requires_grad_(), weight.detach().bfloat16().float()
    ref, ref_ce, ref_kl = _reference_ce_kl(h32, teacher.bfloat16().float(), w32, labels, 1.0, 1.0)
    ref_grad = torch.autograd.grad(ref, h32)[0]
    assert grad.dtype == torch.bfloat16
    for got, want in ((ce, ref_ce), (kl, ref_kl)):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=0.5)
    torch.testing.assert_close(grad.float(), ref_grad, rtol=5e-2, atol=5e-2)


def test_fused_ce_kl_without_teacher_is_the_cross_entropy():
    hidden, weight, labels = _inputs()
    pred = (hidden @ weight.T).argmax(-1)
    labels = labels.clone()
    labels[1:6] = pred[1:6]  # a few hits to count
    loss, ce, kl, correct = fused_linear_ce_kl(hidden, None, weight, labels, chunk_size=4)
    ref = F.cross_entropy(hidden @ weight.T, labels, ignore_index=-100, reduction="sum")
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(
        torch.autograd.grad(loss, hidden)[0], torch.autograd.grad(ref, hidden)[0], atol=1e-5, rtol=1e-5
    )
    assert kl.item() == 0.0 and correct.item() == ((pred == labels) & (labels != -100)).sum().item() >= 5


def test_fused_ce_kl_frozen_head_and_validation():
    hidden, weight, labels = _inputs()
    weight = weight.detach()  # the shared LM head is frozen in training: no vocabulary-sized gradient
    _, _, kl, _ = fused_linear_ce_kl(hidden, hidden.detach(), weight, labels, distill_weight=1.0)
    assert kl.abs().item() < 1e-5  # identical student and teacher
    teacher = torch.randn(N, DM, generator=torch.Generator().manual_seed(5))
    loss = fused_linear_ce_kl(hidden, teacher, weight, labels, distill_weight=1.0)[0]
    ref = _reference_ce_kl(hidden, teacher, weight, labels, 1.0, 1.0)[0]
    torch.testing.assert_close(
        torch.autograd.grad(loss, hidden)[0], torch.autograd.grad(ref, hidden)[0], atol=1e-5, rtol=1e-5
    )
    with pytest.raises(ValueError, match="temperature"):
        fused_linear_ce_kl(hidden, hidden, weight, labels, distill_weight=1.0, temperature=0.0)
    with pytest.raises(ValueError, match="differ"):
        fused_linear_ce_kl(hidden, hidden[:-1], weight, labels, distill_weight=1.0)
    with pytest.raises(ValueError, match="distill_weight"):
        fused_linear_ce_kl(hidden, hidden, weight, labels, distill_weight=-1.0)
    with pytest.raises(ValueError, match="teacher"):
        fused_linear_ce_kl(hidden, None, weight, labels, distill_weight=1.0)


_LIGER_SCRIPT = """
import json, torch
from longspec.losses import fused_linear_cross_entropy
gen = torch.Generator().manual_seed(0)
h = torch.randn(7, 16, generator=gen, requires_grad=True)
w = torch.randn(37, 16, generator=gen, requires_grad=True)
y = torch.randint(0, 37, (7,), generator=gen); y[2] = -100
out = {}
for backend in ("liger", "chunked"):
    loss = fused_linear_cross_entropy(h, w, y, backend=backend, chunk_size=3)
    gh, gw = torch.autograd.grad(loss, (h, w))
    out[backend] = [loss.item(), gh.flatten().tolist(), gw.flatten().tolist()]
print(json.dumps(out))
"""


@pytest.mark.slow
def test_chunked_matches_liger_under_triton_interpreter():
    # Triton reads TRITON_INTERPRET at import time: run in a fresh interpreter.
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", _LIGER_SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for liger, chunked in zip(out["liger"], out["chunked"], strict=True):
        torch.testing.assert_close(torch.tensor(liger), torch.tensor(chunked), atol=1e-5, rtol=1e-5)
