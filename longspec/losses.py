"""Token losses through the frozen LM head without materialising [tokens x vocab] logits.

Shape legend: N tokens (batch x time flattened), Dm model width, V vocab, C rows per chunk.

At 64K tokens x 128K vocab, fp32 logits would take 32 GB, so the LM-head matmul and the loss are fused:
- CUDA: Liger's `LigerFusedLinearCrossEntropyLoss` (Triton; it computes the gradients chunk by chunk during
  the forward).
- "chunked" (elsewhere, and whenever the KL is on): `_FusedLinearCEKL`, our autograd.Function that walks C-row
  chunks once, computing the loss, the top-1 hits and the gradient in the forward (the backward only scales the
  gradient). Peak extra memory: a few C x V buffers, plus the gradient of `hidden` (its size).
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
    "fused_linear_ce_kl",
    "linear_top1_correct",
    "resolve_loss_backend",
]

HAS_LIGER = importlib.util.find_spec("liger_kernel") is not None
LOSS_BACKENDS = ("auto", "liger", "chunked", "torch")
# Logits elements per chunk: 32 MiB in fp32; on a GPU 128 MiB, so a chunk's ~10 kernels each move enough bytes
# to hide their launch (a fused CE + KL chunk holds ~5 such buffers at once).
_CHUNK_ELEMENTS = 1 << 23
_CHUNK_ELEMENTS_CUDA = 1 << 25


def _chunk_rows(vocab_size: int, chunk_size: int | None, device: torch.device | None = None) -> int:
    if chunk_size is not None:
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        return chunk_size
    elements = _CHUNK_ELEMENTS_CUDA if device is not None and device.type == "cuda" else _CHUNK_ELEMENTS
    return max(1, elements // vocab_size)


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
    backend = resolve_loss_backend(backend, hidden.device)
    if backend == "liger":
        return _liger_linear_cross_entropy(hidden, weight, labels, ignore_index)
    if backend == "torch":
        logits = (hidden @ weight.T).float()
        return F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="sum")
    chunk = _chunk_rows(weight.shape[0], chunk_size, hidden.device)
    return _FusedLinearCEKL.apply(hidden, None, weight, labels, 0.0, 1.0, ignore_index, chunk)[0]


def resolve_loss_backend(backend: str, device: torch.device) -> str:
    """The backend that runs for `backend` on `device`: "auto" is Liger on CUDA when installed, else chunked."""
    if backend not in LOSS_BACKENDS:
        raise ValueError(f"unknown loss backend {backend!r}; choose one of {LOSS_BACKENDS}")
    if backend == "auto":
        return "liger" if device.type == "cuda" and HAS_LIGER else "chunked"
    if backend == "liger" and not HAS_LIGER:
        raise ValueError("backend 'liger' needs liger-kernel: `pip install liger-kernel`")
    return backend


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


class _FusedLinearCEKL(torch.autograd.Function):
    """loss = sum_i [CE_i + w KL_i] over rows with a label, in ONE pass over the vocabulary per chunk, with the
    gradients computed in the forward (the loss is linear in grad_out: the backward only scales them).

    Per row, with z = h W^T (student logits), u = t W^T (teacher), p = softmax(z), p' = softmax(z / tau),
    q = softmax(u / tau):
        CE = lse(z) - z[y]                 dCE/dz = p - onehot(y)
        KL = sum_v q (log q - log p')      dKL/dz = (p' - q) / tau
    and dL/dh = (dL/dz) W, dL/dW = (dL/dz)^T h. A chunk's vocabulary matmuls are z, u and the gradient: three,
    where separate CE and KL functions that recompute their logits in the backward need eight, one of them in
    float32 (on the GPU those passes would be most of a training step). The
    top-1 hits come from the same z. A row without a label (ignore_index) adds nothing and gets no gradient."""

    @staticmethod
    def forward(
        ctx, hidden, teacher, weight, labels, weight_kl: float, tau: float, ignore_index: int, chunk: int
    ):
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[2]
        valid = labels != ignore_index
        safe = torch.where(valid, labels, 0)[:, None]
        ce = torch.zeros((), dtype=torch.float32, device=hidden.device)
        kl = torch.zeros_like(ce)
        correct = torch.zeros((), dtype=torch.long, device=hidden.device)
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        for s in range(0, hidden.shape[0], chunk):
            h, y, m = hidden[s : s + chunk], safe[s : s + chunk], valid[s : s + chunk]
            z = h @ weight.T  # [C,V], compute dtype
            correct += ((z.argmax(-1) == labels[s : s + chunk]) & m).sum()
            z = z.float()
            lse = z.logsumexp(-1)
            ce += ((lse - z.gather(1, y).squeeze(1)) * m).sum()
            log_p = z.sub_(lse[:, None])  # z is not needed any more
            g = log_p.exp()  # p, becoming dL/dz
            if teacher is not None:
                u = (teacher[s : s + chunk] @ weight.T).float()
                log_q = (u if tau == 1.0 else u.div_(tau)).log_softmax(-1)
                q = log_q.exp()
                if tau == 1.0:  # p' = p: dL/dz = (1 + w) p - w q - onehot(y), one pass (q + (1 + w)(p - q))
                    kl += (torch.linalg.vecdot(q, log_q.sub_(log_p)) * m).sum()
                    g = q.lerp_(g, 1 + weight_kl)
                else:
                    log_p_tau = (log_p / tau).log_softmax(-1)  # softmax is shift-invariant: lse drops out
                    kl += (torch.linalg.vecdot(q, log_q.sub_(log_p_tau)) * m).sum()
                    g.add_(log_p_tau.exp_().sub_(q), alpha=weight_kl / tau)
            g.scatter_add_(1, y, torch.full_like(g[:, :1], -1.0))
            # Rows without a label: masked on the small side ([C, Dm]), not over the vocabulary.
            mf = m[:, None].to(g.dtype)
            if need_h:
                grad_h[s : s + chunk] = ((g.to(weight.dtype) @ weight) * mf).to(hidden.dtype)
            if need_w:
                grad_w += g.T @ (h.float() * mf)
        ctx.save_for_backward(grad_h, grad_w)
        ctx.weight_dtype = weight.dtype
        ctx.mark_non_differentiable(ce, kl, correct)
        return ce + weight_kl * kl, ce, kl, correct

    @staticmethod
    def backward(ctx, grad_loss, *unused):
        grad_h, grad_w = ctx.saved_tensors
        scale = grad_loss.float()
        dh = (grad_h * scale).to(grad_h.dtype) if grad_h is not None else None
        dw = (grad_w * scale).to(ctx.weight_dtype) if grad_w is not None else None
        return dh, None, dw, None, None, None, None, None


def fused_linear_ce_kl(
    hidden: torch.Tensor,
    teacher: torch.Tensor | None,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    distill_weight: float = 0.0,
    temperature: float = 1.0,
    ignore_index: int = -100,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cross-entropy on `labels` plus `distill_weight` x KL(target || drafter) at `temperature`, through the
    shared LM head `weight` [V, Dm] in one chunked pass (`_FusedLinearCEKL`), never materialising full logits.
    hidden / teacher [..., Dm] (the teacher's is a constant; None with distill_weight 0: cross-entropy alone),
    labels [...] -> (loss, ce_sum, kl_sum, num_correct): loss = ce_sum + distill_weight * kl_sum carries the
    gradient (to hidden, and to weight if it requires one); the rest are detached; num_correct counts rows whose
    drafter argmax is the label. KL is not multiplied by tau^2: scale distill_weight if wanted."""
    if teacher is None and distill_weight > 0:
        raise ValueError("distill_weight > 0 needs the teacher's hidden states")
    if teacher is not None and teacher.shape != hidden.shape:
        raise ValueError(f"student {tuple(hidden.shape)} and teacher {tuple(teacher.shape)} differ")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if distill_weight < 0:
        raise ValueError(f"distill_weight must be >= 0, got {distill_weight}")
    hidden_flat, labels_flat = _flatten(hidden, weight, labels, "labels")
    teacher_flat = None
    if teacher is not None and distill_weight > 0:
        teacher_flat = teacher.reshape(hidden_flat.shape).detach()
    chunk = _chunk_rows(weight.shape[0], chunk_size, hidden.device)
    return _FusedLinearCEKL.apply(
        hidden_flat, teacher_flat, weight, labels_flat, float(distill_weight), float(temperature),
        ignore_index, chunk,
    )  # fmt: skip
