"""Drafter weights that are numbers: a tensor holding NaN or inf is refused wherever weights enter or leave
(`Drafter.from_pretrained`, `longspec.export`, a training checkpoint), with one line naming the file and tensor.
A NaN weight does not fail loudly on its own: the drafter's proposals are all rejected (τ 1.00) and training on
it runs every step at `loss nan`."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

__all__ = ["nonfinite_counts", "check_finite"]


def nonfinite_counts(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """int64 [len(tensors)]: how many NaN / inf values each tensor holds, on the tensors' device (nothing is read
    back to the host until the caller reads the result)."""
    counts = [(~torch.isfinite(t.detach())).sum() for t in tensors]
    return torch.stack(counts) if counts else torch.zeros(0, dtype=torch.int64)


def check_finite(state: Mapping[str, torch.Tensor], path: str, *, purpose: str) -> None:
    """Raise ValueError naming `path` and the first tensor of `state` that holds a NaN or inf."""
    names = list(state)
    for name, count in zip(names, nonfinite_counts(state[n] for n in names).tolist(), strict=True):
        if count:
            raise ValueError(
                f"{path}: tensor {name!r} holds {count} NaN/inf value(s) of {state[name].numel()}: refusing to "
                f"{purpose} a drafter whose weights are not numbers (use an earlier checkpoint of its run)"
            )
