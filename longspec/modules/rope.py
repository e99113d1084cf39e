"""Rotary position embedding for arbitrary position ids, with the target's exact rope scaling.

Shape legend: B batch, H heads, T tokens, D head dim.

The inverse frequencies and the attention scaling come from transformers' own rope init functions
(`transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS`: linear, llama3, yarn, longrope, dynamic, ...), so the
drafter and our target loop rotate exactly like the HF model. cos/sin are computed from the position ids on the
fly (no table), because anchor-offset training positions reach 30K+ and need not be contiguous.

Two rope types change their frequencies with the sequence's length in HF:
- "dynamic" (NTK) recomputes them once a sequence grows past `max_position_embeddings`, continuously: fixed
  frequencies cannot follow, and `exact_positions` bounds the range where both agree (the engine and the eval
  refuse to generate past it; on a tiny Llama the logits were off by 1e-3 in fp32 past it).
- "longrope" (Phi-3) has two sets: HF's forward uses the long factors iff it reaches past the original context
  (`original_max_position_embeddings`). The module keeps both; `long` None applies that rule per forward (a plain
  forward, training), True / False fix one set for an engine call (`set_long`): prompts longer than the original
  context use the long factors throughout, as HF's prefill and every later step do; shorter ones the short
  factors, as long as they do not generate past it (HF would switch mid-sequence: the engine refuses).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from longspec.kernels import rope_angles as angles
from longspec.kernels.layer_ops.naive import rotate
from longspec.modules import layer_ops

__all__ = [
    "RotaryEmbedding",
    "apply_rotary",
    "exact_positions",
    "longrope_long",
    "longrope_original",
    "rope_config",
]


def _default_inv_freq(rope_parameters: dict[str, Any], head_dim: int) -> tuple[torch.Tensor, float]:
    # Same arithmetic as HF's `compute_default_rope_parameters`, so results are bit-identical.
    base = rope_parameters["rope_theta"]
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    return inv_freq, 1.0


def exact_positions(hf_config) -> int | None:
    """How many positions (prompt + generated tokens) a sequence may reach while fixed frequencies rotate exactly
    as HF does for this config; None: any (the frequencies do not depend on the length, or, for longrope, the
    engine picks the set per call)."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    if params.get("rope_type", "default") == "dynamic":
        return getattr(hf_config, "max_position_embeddings", None)
    return None


def longrope_original(hf_config) -> int | None:
    """A longrope config's original context (where HF switches to the long factors); None for other types."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    if params.get("rope_type") != "longrope":
        return None
    original = params.get("original_max_position_embeddings") or getattr(
        hf_config, "original_max_position_embeddings", None
    )
    return original or hf_config.max_position_embeddings


def longrope_long(lengths: list[int], max_new_tokens: int, original: int) -> bool | None:
    """The one LongRoPE set a call's sequences (prompts of `lengths`, up to `max_new_tokens` generated) rotate
    with throughout, as HF's forwards would pick it: True (the long factors) when every prompt is past the
    original context, False when every sequence stays within it; None when no single set fits (a sequence that
    would cross it, where HF switches mid-sequence, or prompts on both sides)."""
    if min(lengths) > original:
        return True
    if max(lengths) + max_new_tokens <= original:
        return False
    return None


def rope_config(
    *,
    rope_parameters: dict[str, Any],
    head_dim: int,
    hidden_size: int,
    num_heads: int,
    max_position_embeddings: int,
):
    """A minimal HF config carrying only what the rope init functions read (used by the drafter, which keeps
    the target's rope settings but not its whole config)."""
    from transformers import PretrainedConfig

    cfg = PretrainedConfig()
    cfg.hidden_size = hidden_size
    cfg.num_attention_heads = num_heads
    cfg.head_dim = head_dim
    cfg.max_position_embeddings = max_position_embeddings
    cfg.rope_parameters = copy.deepcopy(rope_parameters)
    return cfg


class RotaryEmbedding(nn.Module):
    """cos/sin for any position ids; `inv_freq` is a non-persistent buffer (never saved in checkpoints)."""

    def __init__(
        self,
        inv_freq: torch.Tensor,
        attention_scaling: float = 1.0,
        rope_type: str = "default",
        *,
        long_inv_freq: torch.Tensor | None = None,
        original_positions: int | None = None,
    ):
        super().__init__()
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.attention_scaling = float(attention_scaling)
        self.rope_type = rope_type
        # longrope: both sets, `inv_freq` holding the one in use (copied in place: captured graphs read it)
        short = None if long_inv_freq is None else inv_freq.float().clone()
        self.register_buffer("short_inv_freq", short, persistent=False)
        self.register_buffer(
            "long_inv_freq", None if long_inv_freq is None else long_inv_freq.float(), persistent=False
        )
        self.original_positions = original_positions
        # longrope: None = HF's rule per forward; True / False = fixed (`set_long`)
        self.long: bool | None = None

    def set_long(self, long: bool | None) -> None:
        """longrope: fix the long (True) or short (False) factors for the forwards that follow, or (None) go back
        to HF's rule per forward (long iff it reaches past the original context)."""
        if self.long_inv_freq is None:
            return
        self.long = long
        if long is not None:
            self.inv_freq.copy_(self.long_inv_freq if long else self.short_inv_freq)

    def _apply(self, fn, recurse=True):
        # Module.to(dtype) would round the frequencies to bf16: at position 30K the angles would be off by radians
        # (and disagree with the target's fp32 frequencies). Follow device moves only; stay float32.
        names = [n for n in ("inv_freq", "short_inv_freq", "long_inv_freq") if getattr(self, n) is not None]
        kept = {n: getattr(self, n) for n in names}
        super()._apply(fn, recurse)
        for name in names:
            setattr(self, name, kept[name].to(device=getattr(self, name).device))
        return self

    @classmethod
    def from_config(cls, hf_config) -> RotaryEmbedding:
        """Build from an HF model config (its `rope_parameters`, standardised by transformers 5.x)."""
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        params = getattr(hf_config, "rope_parameters", None)
        if not params:
            raise ValueError(
                f"config of model_type {getattr(hf_config, 'model_type', '?')!r} has no rope_parameters"
            )
        if "full_attention" in params and isinstance(params["full_attention"], dict):
            raise ValueError(
                "per-layer-type rope parameters are not supported (one rope for all layers expected)"
            )
        head_dim = (
            getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        )
        # Partial rotary (Phi-4-mini: 0.75): only the first int(head_dim * factor) dims of each head rotate, the
        # rest pass through (`apply_rotary`); HF's init functions size their frequencies the same way.
        rotary_dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        if rotary_dim < 2 or rotary_dim % 2:
            raise ValueError(
                f"partial_rotary_factor={params['partial_rotary_factor']} leaves {rotary_dim} rotary dims of "
                f"head_dim={head_dim}: an even number >= 2 is needed"
            )
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":
            inv_freq, scaling = _default_inv_freq(params, rotary_dim)
        elif rope_type in ROPE_INIT_FUNCTIONS:
            # The init functions mutate/standardise the config they are given: hand them a copy.
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](copy.deepcopy(hf_config), None)
        else:
            raise ValueError(
                f"unknown rope_type {rope_type!r}; supported: default, {', '.join(sorted(ROPE_INIT_FUNCTIONS))}"
            )
        original = longrope_original(hf_config)
        long_inv_freq = None
        if original is not None:  # the long factors: what HF uses once a forward reaches past `original`
            long_inv_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](copy.deepcopy(hf_config), None, original + 1)
        return cls(
            inv_freq, scaling, rope_type, long_inv_freq=long_inv_freq, original_positions=original,
        )  # fmt: skip

    @property
    def rotary_dim(self) -> int:
        """The rotated dims of each head (the head dim unless the rope is partial)."""
        return 2 * self.inv_freq.numel()

    def fixed_frequencies(self) -> torch.Tensor | None:
        """inv_freq [R] when the next forward's frequencies do not depend on its positions (every rope type but
        longrope under HF's per-forward rule): what a kernel that computes the angles of positions it makes itself
        takes (`kernels.draft_nodes`), with `attention_scaling`. None: only `cos_sin` applies the rule."""
        if self.long_inv_freq is not None and self.long is None:
            return None
        return self.inv_freq

    def cos_sin(
        self, position_ids: torch.Tensor, dtype: torch.dtype | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids [B,T] (or [T]) int -> (cos, sin) [B,T,D] in `dtype` (default float32).

        Angles are computed in float32 like HF: position * inv_freq, then duplicated over the two halves
        (`kernels.rope_angles`: one Triton launch on CUDA, the PyTorch reference elsewhere)."""
        if position_ids.dim() == 1:
            position_ids = position_ids[None]
        if self.fixed_frequencies() is None:  # HF's longrope rule for this forward (host sync)
            reaches = int(position_ids.max()) + 1 > self.original_positions
            self.inv_freq.copy_(self.long_inv_freq if reaches else self.short_inv_freq)
        dtype = torch.float32 if dtype is None else dtype
        fn = angles.rope_angles if layer_ops.use_triton(position_ids) else angles.rope_angles_naive
        # Autocast would run the reference's product in bf16 and wreck large positions; keep it in fp32.
        with torch.autocast(device_type=position_ids.device.type, enabled=False):
            return fn(position_ids, self.inv_freq.to(position_ids.device), self.attention_scaling, dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B,H,T,D], cos/sin [B,T,R] -> x rotated (the HF "rotate_half" convention). A partial rope (R < D) rotates
    the first R dims and passes the rest through, as HF's Phi-3 does. The same arithmetic as the fused q/k/v +
    RoPE step's reference: one implementation."""
    return rotate(x, cos, sin)
