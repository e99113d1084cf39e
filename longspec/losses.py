"""Token losses through the frozen LM head without materialising [tokens x vocab] logits.

Shape legend: N tokens (batch x time flattened), Dm model width, V vocab, C rows per chunk.

At 64K tokens x 128K vocab, fp32 logits would take 32 GB, so the LM-head matmul and the loss are fused:
- CUDA: Liger's `LigerFusedLinearCrossEntropyLoss` (Triton; it computes the gradients chunk by chunk during
  the forward).
- elsewhere: `_ChunkedLinearCrossEntropy`, our autograd.Function that walks C-row chunks in the forward (keeping
  only the per-token log-sum-exp) and recomputes each chunk's logits in the backward. Peak extra memory: C x V.
- "torch": plain F.cross_entropy on full logits — the reference the fused paths are tested against.

Losses are SUMS over valid tokens: the trainer divides by the global count of valid tokens (across micro-batches
and ranks), which a per-micro-batch mean would get wrong.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

__all__ = [
    "HAS_LIGER",
    "LOSS_BACKENDS",
    "fused_linear_cross_entropy",
    "fused_linear_kl",
    "linear_top1_correct",
]

HAS_LIGER = importlib.util.find_spec("liger_kernel") is not None
LOSS_BACKENDS = ("auto", "liger", "chunked", "torch")
_CHUNK_ELEMENTS = 1 << 23  # logits elements per chunk: 32 MiB in fp32


def _chunk_rows(vocab_size: int, chunk_size: int | None) -> int:
    if chunk_size is not None:
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        return chunk_size
    return max(1, _CHUNK_ELEMENTS // vocab_size)


def _flatten(hidden: torch.Tensor, weight: torch.Tensor, other: torch.Tensor, what: str):
    if hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"hidden width {hidden.shape[-1]} does not match the LM head weight {tuple(weight.shape)}"
        )
    if other.shape != hidden.shape[:-1]:
        raise ValueError(
            f"{what} shape {tuple(other.shape)} must equal hidden's leading shape {tuple(hidden.shape[:-1])}"
        )
    return hidden.reshape(-1, hidden.shape[-1]), other.reshape(-1)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """sum_i [lse(h_i W^T) - (h_i W^T)[y_i]] over tokens with y_i != ignore_index, chunk by chunk.

    Backward: d/dlogits = softmax(logits) - onehot(y), recomputed per chunk from the saved lse."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, ignore_index: int, chunk: int):
        valid = labels != ignore_index
        safe = torch.where(valid, labels, 0)
        lse = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        picked = torch.empty_like(lse)
        for s in range(0, hidden.shape[0], chunk):
            logits = (hidden[s : s + chunk] @ weight.T).float()  # [C,V]
            lse[s : s + chunk] = logits.logsumexp(-1)
            picked[s : s + chunk] = logits.gather(1, safe[s : s + chunk, None]).squeeze(1)
        ctx.save_for_backward(hidden, weight, safe, valid, lse)
        ctx.chunk = chunk
        return ((lse - picked) * valid).sum()

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, safe, valid, lse = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        scale = grad_out.float()
        for s in range(0, hidden.shape[0], ctx.chunk):
            h = hidden[s : s + ctx.chunk]
            logits = (h @ weight.T).float()  # [C,V]
            g = torch.exp(logits - lse[s : s + ctx.chunk, None])  # softmax
            g.scatter_add_(1, safe[s : s + ctx.chunk, None], torch.full_like(g[:, :1], -1.0))
            g *= valid[s : s + ctx.chunk, None] * scale
            if need_h:
                grad_h[s : s + ctx.chunk] = (g @ weight.float()).to(hidden.dtype)
            if need_w:
                grad_w += g.T @ h.float()
        return grad_h, grad_w.to(weight.dtype) if need_w else None, None, None, None


def _liger_linear_cross_entropy(hidden, weight, labels, ignore_index):
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    loss_fn = LigerFusedLinearCrossEntropyLoss(
        ignore_index=ignore_index, reduction="sum", accum_dtype=torch.float32
    )
    return loss_fn(weight, hidden, labels).float()


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    backend: str = "auto",
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Cross-entropy of softmax(hidden @ weight^T) against labels, SUMMED over tokens whose label is not
    `ignore_index` (fp32 scalar). hidden [..., Dm], weight [V, Dm] (the LM head), labels [...] long.

    backend: "auto" (Liger on CUDA when installed, else chunked), "liger", "chunked", "torch" (full logits)."""
    hidden, labels = _flatten(hidden, weight, labels, "labels")
    if backend not in LOSS_BACKENDS:
        raise ValueError(f"unknown loss backend {backend!r}; choose one of {LOSS_BACKENDS}")
    if backend == "auto":
        backend = "liger" if hidden.is_cuda and HAS_LIGER else "chunked"
    if backend == "liger":
        if not HAS_LIGER:
            raise ValueError("backend 'liger' needs liger-kernel: `pip install liger-kernel`")
        return _liger_linear_cross_entropy(hidden, weight, labels, ignore_index)
    if backend == "torch":
        logits = (hidden @ weight.T).float()
        return F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="sum")
    chunk = _chunk_rows(weight.shape[0], chunk_size)
    return _ChunkedLinearCrossEntropy.apply(hidden, weight, labels, ignore_index, chunk)


@torch.no_grad()
def linear_top1_correct(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Number of valid tokens whose argmax(hidden @ weight^T) equals the label (long scalar, stays on device).
    Top-1 accuracy is the drafter's first-level acceptance proxy."""
    hidden, labels = _flatten(hidden, weight, labels, "labels")
    chunk = _chunk_rows(weight.shape[0], chunk_size)
    correct = torch.zeros((), dtype=torch.long, device=hidden.device)
    for s in range(0, hidden.shape[0], chunk):
        pred = (hidden[s : s + chunk] @ weight.T).argmax(-1)
        y = labels[s : s + chunk]
        correct += ((pred == y) & (y != ignore_index)).sum()
    return correct


class _ChunkedLinearKL(torch.autograd.Function):
    """sum_i KL(p_t,i || p_s,i), p = softmax(h W^T / tau), over masked rows; gradients to the student only.

    Per row: KL = sum_v p_t (log p_t - log p_s);  dKL/dz_s = (p_s - p_t) / tau  (z = h W^T)."""

    @staticmethod
    def forward(ctx, student, teacher, weight, mask, temperature: float, chunk: int):
        total = torch.zeros((), dtype=torch.float32, device=student.device)
        for s in range(0, student.shape[0], chunk):
            log_ps = ((student[s : s + chunk] @ weight.T).float() / temperature).log_softmax(-1)  # [C,V]
            log_pt = ((teacher[s : s + chunk] @ weight.T).float() / temperature).log_softmax(-1)
            kl = (log_pt.exp() * (log_pt - log_ps)).sum(-1)  # [C]
            total += (kl * mask[s : s + chunk]).sum()
        ctx.save_for_backward(student, teacher, weight, mask)
        ctx.temperature, ctx.chunk = temperature, chunk
        return total

    @staticmethod
    def backward(ctx, grad_out):
        student, teacher, weight, mask = ctx.saved_tensors
        tau, chunk = ctx.temperature, ctx.chunk
        need_s, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[2]
        grad_s = torch.empty_like(student) if need_s else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        for s in range(0, student.shape[0], chunk):
            hs = student[s : s + chunk]
            ps = ((hs @ weight.T).float() / tau).softmax(-1)
            pt = ((teacher[s : s + chunk] @ weight.T).float() / tau).softmax(-1)
            g = (ps - pt) * (mask[s : s + chunk, None] * grad_out.float() / tau)  # dKL/dz_s, [C,V]
            if need_s:
                grad_s[s : s + chunk] = (g @ weight.float()).to(student.dtype)
            if need_w:
                # The LM head is frozen in longspec; supported for completeness (teacher path ignored: the
                # teacher is a fixed target, so only the student's dependence on W is differentiated).
                grad_w += g.T @ hs.float()
        return grad_s, None, grad_w.to(weight.dtype) if need_w else None, None, None, None


def fused_linear_kl(
    student_hidden: torch.Tensor,
    teacher_hidden: torch.Tensor,
    weight: torch.Tensor,
    mask: torch.Tensor | None = None,
    temperature: float = 1.0,
    *,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Distillation loss sum_i KL(target || drafter) at temperature `tau` over rows where `mask` is True,
    never materialising full logits. student/teacher hidden [..., Dm] (the teacher's is treated as a constant),
    weight [V, Dm] the shared LM head. Not multiplied by tau^2: scale it in the trainer if wanted."""
    if student_hidden.shape != teacher_hidden.shape:
        raise ValueError(
            f"student {tuple(student_hidden.shape)} and teacher {tuple(teacher_hidden.shape)} differ"
        )
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if mask is None:
        mask = torch.ones(student_hidden.shape[:-1], dtype=torch.bool, device=student_hidden.device)
    student, mask = _flatten(student_hidden, weight, mask, "mask")
    teacher = teacher_hidden.reshape(student.shape).detach()
    chunk = _chunk_rows(weight.shape[0], chunk_size)
    return _ChunkedLinearKL.apply(student, teacher, weight, mask.float(), float(temperature), chunk)
