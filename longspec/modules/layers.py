"""Small building blocks of the drafter block: RMSNorm and the SwiGLU MLP (Llama/Qwen layout), and the packing of
several projections into one (inference: one GEMM for q/k/v, one for gate/up) shared by target and drafter.

Shape legend: B batch, T tokens, Dm model width, F MLP width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from longspec.modules.layer_ops import add_rms_norm

__all__ = ["RMSNorm", "SwiGLU", "bind_views", "pack_linears"]


class RMSNorm(nn.Module):
    """y = w * x / sqrt(mean(x^2) + eps), normalised in float32 (the HF Llama arithmetic, so bf16 matches)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One fused Triton launch on CUDA without gradients (drafting), the same arithmetic elsewhere.
        return add_rms_norm(x, None, self.weight, self.eps)[0]

    def extra_repr(self) -> str:
        return f"{self.weight.numel()}, eps={self.eps}"


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)): [B,T,Dm] -> [B,T,Dm] through width F."""

    def __init__(self, dim: int, hidden_dim: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=bias)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=bias)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def pack_linears(linears) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(weight [sum of out, in], bias or None) of linears stacked along their outputs; None when only some of
    them have a bias."""
    biases = [lin.bias for lin in linears]
    if any(b is None for b in biases) and not all(b is None for b in biases):
        return None
    weight = torch.cat([lin.weight.detach() for lin in linears])
    bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
    return weight, bias


def bind_views(linears, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Make each linear's weight (and bias) a view of its rows of the packed tensors: one copy in memory."""
    start = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight = nn.Parameter(weight[start : start + rows], requires_grad=False)
        if bias is not None:
            lin.bias = nn.Parameter(bias[start : start + rows], requires_grad=False)
        start += rows
