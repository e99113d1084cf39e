"""The module DeepSpeed trains: the frozen target and the drafter, and one micro-batch's summed losses.

Shape legend: B batch, T tokens, N valid (trained) tokens, Dm model width, Hkv kv heads, D head dim, V vocab.

Per micro-batch (docs/ALGORITHM.md §3): the frozen target runs without grad at the batch's position ids and hands over its
last layer's K/V (and final hidden state, for distillation); the drafter runs at the same positions with the
flash-noisy lag; the loss is the fused cross-entropy of the drafter's hidden states through the shared LM head,
summed over valid tokens -- the trainer divides by the GLOBAL number of valid tokens. CE, KL (with distillation)
and the top-1 count share one pass over the vocabulary (`fused_linear_ce_kl`); only CE alone on the "liger"
backend (CUDA's default) or the "torch" reference runs a separate top-1 pass. Only rows with a label are sent through the LM head: for SFT data (long prompt, short
response) that skips most of the vocab projection.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from longspec.data.loader import IGNORE_INDEX
from longspec.drafter import Drafter
from longspec.losses import (
    fused_linear_ce_kl,
    fused_linear_cross_entropy,
    linear_top1_correct,
    resolve_loss_backend,
)
from longspec.target import TargetModel

__all__ = ["MicroBatchLosses", "DraftingModel"]


@dataclass
class MicroBatchLosses:
    loss: torch.Tensor  # fp32 scalar with grad: ce_sum + distill_weight * kl_sum (not yet normalised)
    ce_sum: torch.Tensor  # detached fp32 scalar
    kl_sum: torch.Tensor  # detached fp32 scalar (0 without distillation)
    num_correct: torch.Tensor  # long scalar: valid tokens where drafter argmax == label (-1: not counted)


class DraftingModel(nn.Module):
    """target (frozen) + drafter (trainable). Only the drafter's parameters require grad."""

    def __init__(
        self,
        target: TargetModel,
        drafter: Drafter,
        *,
        distill_weight: float = 0.0,
        distill_temperature: float = 1.0,
        loss_backend: str = "auto",
        chunk_size: int | None = None,
    ):
        super().__init__()
        self.target = target
        self.drafter = drafter
        self.distill_weight = distill_weight
        self.distill_temperature = distill_temperature
        self.loss_backend = loss_backend
        self.chunk_size = chunk_size
        # Under ZeRO-3 the LM head weight is a shard; the fused losses read the raw weight (no module call to
        # trigger a gather) in forward AND backward, so `replicate_head` keeps one full frozen copy per rank.
        object.__setattr__(self, "_head_weight", None)
        object.__setattr__(self, "_draft_rows", None)  # (LM head weight, its draft-vocabulary rows, id table)

    def replicate_head(self) -> None:
        """ZeRO-3: gather the LM head once and keep a full copy (frozen, outside state_dict and the optimizer).

        It is the one target weight every trained token touches, forward and backward; re-gathering it per
        micro-batch would move V x Dm (1 GB for Llama-3-8B) per step and break the saved tensor in backward."""
        import deepspeed

        weight = self.target.lm_head.weight
        with deepspeed.zero.GatheredParameters([weight]):
            object.__setattr__(self, "_head_weight", weight.detach().clone())

    @property
    def head_weight(self) -> torch.Tensor:
        """The drafting head's weight: the LM head [V, Dm], or its rows of the drafter's draft vocabulary [Kd, Dm]."""
        if self.drafter.draft_vocab is None:
            return self._full_head_weight()
        return self._draft_tables()[0]

    def draft_labels(self, labels: torch.Tensor) -> torch.Tensor:
        """Target ids -> draft ids; a label outside the draft vocabulary becomes IGNORE_INDEX: no draft can propose
        it, so its position carries no loss, CE nor KL (it still counts among the valid tokens that normalise the
        loss, and a miss in the top-1 count: both measure what the drafter can be accepted on)."""
        if self.drafter.draft_vocab is None:
            return labels
        mapped = self._draft_tables()[1][labels.clamp(min=0)]
        return torch.where((labels >= 0) & (mapped >= 0), mapped, IGNORE_INDEX)

    def _full_head_weight(self) -> torch.Tensor:
        return self._head_weight if self._head_weight is not None else self.target.lm_head.weight

    def _draft_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(the draft vocabulary's head rows [Kd, Dm], target id -> draft id [V]): copied once per LM head
        weight (the head is frozen; `replicate_head` replaces a ZeRO-3 shard by a full copy)."""
        weight = self._full_head_weight()
        if self._draft_rows is None or self._draft_rows[0] is not weight:
            vocab = self.drafter.draft_vocab
            rows = weight.detach().index_select(0, vocab.ids.to(weight.device))
            object.__setattr__(self, "_draft_rows", (weight, rows, vocab.target_to_draft(weight.device)))
        return self._draft_rows[1], self._draft_rows[2]

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        labels: torch.Tensor,
        valid_rows: torch.Tensor,
        *,
        lag: int,
        count_correct: bool = True,
    ) -> MicroBatchLosses:
        """input_ids/position_ids/labels [B,T]; valid_rows [N]: flat indices of labels != IGNORE_INDEX (computed
        on the host with the batch, so selecting them costs no device->host sync); lag: flash-noisy lag (0 = none)."""
        # The record_function ranges name the phases for a profiler (benchmarks/train_throughput.py --profile);
        # without one they cost nothing.
        with torch.no_grad(), torch.profiler.record_function("target"):
            target_out = self.target(input_ids, position_ids)  # last_k/last_v [B,Hkv,T,D], hidden [B,T,Dm]
        with torch.profiler.record_function("drafter"):
            # [B,T,Dm]; query t cross-attends to target KV at positions <= t - lag
            hidden = self.drafter(input_ids, position_ids, target_out.last_k, target_out.last_v, lag=lag)
        width = hidden.shape[-1]
        weight = self.head_weight
        hidden_n = hidden.reshape(-1, width).index_select(0, valid_rows).to(weight.dtype)  # [N,Dm]
        labels_n = self.draft_labels(labels.reshape(-1).index_select(0, valid_rows))  # [N], by draft id
        backend = resolve_loss_backend(self.loss_backend, hidden.device)
        if self.distill_weight > 0 or backend == "chunked":
            # CE (+ KL) + top-1 hits in one pass over the vocabulary (losses.fused_linear_ce_kl)
            with torch.profiler.record_function("loss_ce_kl"):
                teacher_n = None
                if self.distill_weight > 0:
                    teacher_n = target_out.hidden.reshape(-1, width).index_select(0, valid_rows)
                    teacher_n = teacher_n.to(weight.dtype)
                loss, ce_sum, kl_sum, correct = fused_linear_ce_kl(
                    hidden_n, teacher_n, weight, labels_n, distill_weight=self.distill_weight,
                    temperature=self.distill_temperature, chunk_size=self.chunk_size,
                )  # fmt: skip
        else:  # Liger's fused CE (or the full-logits reference), and a separate top-1 pass when asked
            with torch.profiler.record_function("loss_ce"):
                ce_sum = fused_linear_cross_entropy(
                    hidden_n, weight, labels_n, backend=backend, chunk_size=self.chunk_size
                )
            loss, kl_sum = ce_sum, torch.zeros_like(ce_sum)
            if count_correct:
                with torch.profiler.record_function("top1"):
                    correct = linear_top1_correct(
                        hidden_n.detach(), weight, labels_n, chunk_size=self.chunk_size
                    )
        if not count_correct:
            correct = torch.full((), -1, dtype=torch.long, device=hidden.device)
        return MicroBatchLosses(
            loss=loss, ce_sum=ce_sum.detach(), kl_sum=kl_sum.detach(), num_correct=correct
        )
