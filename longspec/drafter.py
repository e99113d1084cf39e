"""The LongSpec drafter: one decoder block over the target's embeddings, KV and LM head (docs/ALGORITHM.md §2).

Shape legend: B batch, T tokens (Tq new queries), Dm model width, H query heads, Hkv key/value heads, D head dim,
W window (ring-buffer slots), S target KV length, F MLP width, V vocab.

    h0 = target.embed_tokens(ids)
    h1 = h0 + SelfAttn(RMSNorm_a(h0))     sliding window: the token + `window` previous tokens, causal
    h2 = h1 + CrossAttn(RMSNorm_b(h1))    q_proj + RoPE at the token's own position; keys/values: the target's
                                          last-layer KV (K already rotated); only q_proj and o_proj exist
    h3 = h2 + MLP(RMSNorm_c(h2))          SwiGLU, the target's intermediate size
    logits = target.lm_head(h3)           no final norm (as upstream)

Only the block is a parameter of this module: the embedding and LM head are the target's modules, held by
reference and never registered, so they are neither in `parameters()` / `state_dict()` nor copied.

Because the block is a single layer, its self-attention K/V depend only on (token id, position): the drafter's
own cache is a ring buffer of `window` slots (`DrafterCache`), O(window) memory at any context length.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch
from torch import nn

from longspec.fingerprint import fingerprint_mismatches, target_fingerprint
from longspec.modules.attention import attention, cache_attention, tree_attention, within_window
from longspec.modules.layers import RMSNorm, SwiGLU
from longspec.modules.noisy import flash_noisy_attention
from longspec.modules.rope import RotaryEmbedding, apply_rotary, rope_config

__all__ = ["DrafterConfig", "Drafter", "DrafterCache", "DraftNodes", "WEIGHTS_NAME", "CONFIG_NAME"]

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"


DEFAULT_WINDOW = 512  # the paper's drafter window: the one default that train and eval configs refer to


@dataclass(kw_only=True)
class DrafterConfig:
    """Shapes of the drafter block; everything but `window` mirrors the target (`from_target_config`)."""

    hidden_size: int  # model width Dm (the target's: the drafter reads its embeddings and feeds its LM head)
    num_heads: int  # query heads H
    num_kv_heads: int  # key/value heads Hkv (must equal the target's: cross-attention reads its KV as is)
    head_dim: int  # D
    intermediate_size: int  # SwiGLU width F
    vocab_size: int  # V of the shared embedding / LM head
    rope_parameters: dict[str, Any]  # the target's standardised HF rope parameters (type, theta, scaling)
    max_position_embeddings: int  # the target's context length (some rope types read it)
    rms_norm_eps: float = 1e-6  # epsilon of the three RMSNorms
    attention_bias: bool = False  # bias on the q/k/v projections (as the target: Qwen2 has it)
    qk_norm: bool = False  # RMSNorm over the head dim on q and k before RoPE (as the target: Qwen3)
    hidden_act: str = "silu"  # MLP activation; SwiGLU needs "silu"
    window: int = DEFAULT_WINDOW  # self-attention: the token + `window` previous tokens; ring-buffer slots
    target_fingerprint: dict[str, Any] = field(default_factory=dict)  # see longspec.fingerprint

    def __post_init__(self):
        for name in (
            "hidden_size",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "vocab_size",
            "max_position_embeddings",
            "window",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"DrafterConfig.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if self.hidden_act != "silu":
            raise ValueError(f"the drafter MLP is SwiGLU: hidden_act must be 'silu', got {self.hidden_act!r}")
        if "rope_theta" not in self.rope_parameters:
            raise ValueError(f"rope_parameters needs a rope_theta, got {self.rope_parameters!r}")

    @classmethod
    def from_target_config(cls, hf_config, *, window: int = DEFAULT_WINDOW, tokenizer=None) -> DrafterConfig:
        """Derive the block's shapes from an HF target config (fingerprinted, with the tokenizer if given)."""
        from longspec.target import _check_model_type

        family = _check_model_type(hf_config)
        head_dim = (
            getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        )
        return cls(
            hidden_size=hf_config.hidden_size,
            num_heads=hf_config.num_attention_heads,
            num_kv_heads=hf_config.num_key_value_heads,
            head_dim=head_dim,
            intermediate_size=hf_config.intermediate_size,
            vocab_size=hf_config.vocab_size,
            rope_parameters=dict(hf_config.rope_parameters),
            max_position_embeddings=hf_config.max_position_embeddings,
            rms_norm_eps=hf_config.rms_norm_eps,
            # Qwen2 configs have no `attention_bias`: its q/k/v projections always carry a bias.
            attention_bias=family == "qwen2" or bool(getattr(hf_config, "attention_bias", False)),
            qk_norm=family == "qwen3",
            hidden_act=getattr(hf_config, "hidden_act", "silu"),
            window=window,
            target_fingerprint=target_fingerprint(hf_config, tokenizer),
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DrafterConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown DrafterConfig fields {unknown} (a config.json from a newer longspec?)")
        return cls(**data)


class _SelfAttention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None


class _CrossAttention(nn.Module):
    # No k/v projections: keys and values are the target's last-layer cache, already projected and rotated.
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None


def _heads(x: torch.Tensor, head_dim: int, norm: nn.Module | None) -> torch.Tensor:
    """[B,T,n*D] -> [B,n,T,D], with the optional per-head RMSNorm (applied before RoPE, as Qwen3)."""
    B, T, _ = x.shape
    x = x.view(B, T, -1, head_dim)
    if norm is not None:
        x = norm(x)
    return x.transpose(1, 2)


def _merge_heads(x: torch.Tensor) -> torch.Tensor:
    B, H, T, D = x.shape
    return x.transpose(1, 2).reshape(B, T, H * D)


class Drafter(nn.Module):
    """The one-block drafter. `embed_tokens` / `lm_head` are the target's modules (shared, frozen, not owned)."""

    def __init__(self, config: DrafterConfig, embed_tokens: nn.Module, lm_head: nn.Module):
        super().__init__()
        self.config = config
        # object.__setattr__ bypasses nn.Module registration: the shared modules stay out of parameters(),
        # state_dict(), .to() and the optimizer; the target owns them.
        object.__setattr__(self, "_embed_tokens", embed_tokens)
        object.__setattr__(self, "_lm_head", lm_head)
        self.self_attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)  # RMSNorm_a
        self.self_attn = _SelfAttention(config)
        self.cross_attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)  # RMSNorm_b
        self.cross_attn = _CrossAttention(config)
        self.mlp_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)  # RMSNorm_c
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)
        self.rotary = RotaryEmbedding.from_config(
            rope_config(
                rope_parameters=config.rope_parameters,
                head_dim=config.head_dim,
                hidden_size=config.hidden_size,
                num_heads=config.num_heads,
                max_position_embeddings=config.max_position_embeddings,
            )
        )
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        """Linear weights ~ N(0, std), biases 0, norm weights 1 (the HF Llama initialisation)."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    # ---- shared target modules -------------------------------------------------------------------------
    @property
    def embed_tokens(self) -> nn.Module:
        return self._embed_tokens

    @property
    def lm_head(self) -> nn.Module:
        return self._lm_head

    def shared_storage_ok(self, target) -> bool:
        """True iff the drafter's embedding / LM head are the target's tensors (same storage, no copy)."""
        return (
            self.embed_tokens.weight.data_ptr() == target.embed_tokens.weight.data_ptr()
            and self.lm_head.weight.data_ptr() == target.lm_head.weight.data_ptr()
        )

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[B,T] -> h0 [B,T,Dm] in the drafter's dtype."""
        return self.embed_tokens(input_ids).to(self.mlp_norm.weight.dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., Dm] -> [..., V] through the target's LM head (no final norm)."""
        return self.lm_head(hidden.to(self.lm_head.weight.dtype))

    # ---- pieces shared by training and inference ---------------------------------------------------------
    def _self_q(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        attn = self.self_attn
        return apply_rotary(_heads(attn.q_proj(x), self.config.head_dim, attn.q_norm), cos, sin)

    def _self_kv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        attn = self.self_attn
        k = apply_rotary(_heads(attn.k_proj(x), self.config.head_dim, attn.k_norm), cos, sin)
        v = _heads(attn.v_proj(x), self.config.head_dim, None)
        return k, v

    def _cross_q(self, h1: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        cross = self.cross_attn
        x = self.cross_attn_norm(h1)
        return apply_rotary(_heads(cross.q_proj(x), self.config.head_dim, cross.q_norm), cos, sin)

    def _mlp(self, h2: torch.Tensor) -> torch.Tensor:
        return h2 + self.mlp(self.mlp_norm(h2))

    # ---- training: the whole sequence at once -------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        target_k: torch.Tensor,
        target_v: torch.Tensor,
        *,
        lag: int = 0,
    ) -> torch.Tensor:
        """input_ids/position_ids [B,T], target_k/target_v [B,Hkv,T,D] (the target's last layer over the same
        tokens) -> h3 [B,T,Dm]. Query t cross-attends to target KV at indices <= t - lag (flash noisy)."""
        h0 = self.embed(input_ids)
        cos, sin = self.rotary.cos_sin(position_ids, dtype=h0.dtype)  # [B,T,D]
        x = self.self_attn_norm(h0)
        q = self._self_q(x, cos, sin)  # [B,H,T,D]
        k, v = self._self_kv(x, cos, sin)  # [B,Hkv,T,D]
        out, _ = attention(q, k, v, causal=True, window=self.config.window)
        h1 = h0 + self.self_attn.o_proj(_merge_heads(out))
        qc = self._cross_q(h1, cos, sin)
        out = flash_noisy_attention(qc, target_k.to(qc.dtype), target_v.to(qc.dtype), lag)
        h2 = h1 + self.cross_attn.o_proj(_merge_heads(out))
        return self._mlp(h2)

    # ---- inference: explicit K/V, masks and target prefix ---------------------------------------------------
    def self_kv(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Self-attention K (post-RoPE) and V [B,Hkv,T,D] of tokens at positions: a function of (token, position)
        only, so it can be computed once per token (e.g. the last `window` prompt tokens at prefill)."""
        h0 = self.embed(input_ids)
        cos, sin = self.rotary.cos_sin(position_ids, dtype=h0.dtype)
        return self._self_kv(self.self_attn_norm(h0), cos, sin)

    def fill_cache(self, cache: DrafterCache, input_ids: torch.Tensor, position_ids: torch.Tensor) -> None:
        """Append committed tokens' self-attention K/V to the ring, e.g. the prompt at prefill. Only the last
        `window` columns can survive in the ring, so only they are computed (no O(n^2) work over the prompt).
        Rows must be unpadded or left-padded (padding has position -1)."""
        if position_ids.dim() == 1:
            position_ids = position_ids.expand(input_ids.shape[0], -1)
        ids, pos = input_ids[:, -cache.window :], position_ids[:, -cache.window :]
        k, v = self.self_kv(ids, pos.clamp(min=0))  # padding is skipped by append; clamp keeps RoPE finite
        cache.append(k, v, pos)

    def block(
        self,
        h_in: torch.Tensor,
        position_ids: torch.Tensor,
        self_k: torch.Tensor,
        self_v: torch.Tensor,
        self_mask: torch.Tensor,
        target_k: torch.Tensor,
        target_v: torch.Tensor,
        cross_len: int | torch.Tensor,
    ) -> torch.Tensor:
        """One block over Tq new tokens with explicit attention inputs -> h3 [B,Tq,Dm].

        h_in [B,Tq,Dm] (= embed(ids)); position_ids [B,Tq]; self_k/self_v [B,Hkv,Tk,D] post-RoPE (ring buffer ++
        new tokens); self_mask bool [Tq,Tk] or [B,Tq,Tk], True = visible; target_k/target_v [B,Hkv,S,D] the
        target's last-layer cache; cross_len: visible target prefix — an int or [B] (the same for every query:
        all tree nodes see the committed prefix) or [B,Tq] (per query, e.g. re-fed accepted tokens)."""
        cos, sin = self.rotary.cos_sin(position_ids, dtype=h_in.dtype)
        q = self._self_q(self.self_attn_norm(h_in), cos, sin)
        out, _ = tree_attention(q, self_k.to(q.dtype), self_v.to(q.dtype), self_mask)
        h1 = h_in + self.self_attn.o_proj(_merge_heads(out))
        qc = self._cross_q(h1, cos, sin)
        target_k, target_v = target_k.to(qc.dtype), target_v.to(qc.dtype)
        if isinstance(cross_len, torch.Tensor) and cross_len.dim() == 2:
            slots = torch.arange(target_k.shape[2], device=qc.device)
            mask = slots[None, None, :] < cross_len.to(qc.device)[:, :, None]  # [B,Tq,S]
            out, _ = tree_attention(qc, target_k, target_v, mask)
        else:
            out, _ = cache_attention(qc, target_k, target_v, cross_len)
        h2 = h1 + self.cross_attn.o_proj(_merge_heads(out))
        return self._mlp(h2)

    def tree_level(
        self,
        input_ids: torch.Tensor,
        cache: DrafterCache,
        nodes: DraftNodes,
        level: slice,
        node_mask: torch.Tensor,
        target_k: torch.Tensor,
        target_v: torch.Tensor,
        cross_len: int | torch.Tensor,
    ) -> torch.Tensor:
        """One draft step over the uncommitted tokens in `nodes` slots `level` -> h3 [B,P,Dm] (P = the level's
        width): the one inference step, run by the engine per tree level and checked by the tests.

        input_ids [B,P] are the level's tokens, at positions `nodes.positions[:, level]`; their self K/V are
        written into `nodes` (slots `level`), so later levels (and a commit: `cache.append(nodes.keys[:, :, idx],
        ...)`) reuse them. Keys are [ring ++ nodes[:level.stop]]: a ring slot is visible within the window of
        the query's position (`cache.visible_mask`); node j to query i iff node_mask[.., i, j] (the tree's
        ancestor mask over nodes [0, level.stop), self included; [P, stop] or [B, P, stop]) and within the
        window. cross_len: the visible target prefix, as in `block`. The ring is NOT modified."""
        positions = nodes.positions[:, level]  # [B,P]
        nodes.keys[:, :, level], nodes.values[:, :, level] = self.self_kv(input_ids, positions)
        stop = level.stop
        in_window = within_window(positions[:, :, None], nodes.positions[:, None, :stop], self.config.window)
        self_mask = torch.cat([cache.visible_mask(positions), node_mask & in_window], dim=-1)  # [B,P,W+stop]
        return self.block(
            self.embed(input_ids),
            positions,
            torch.cat([cache.keys, nodes.keys[:, :, :stop]], dim=2),
            torch.cat([cache.values, nodes.values[:, :, :stop]], dim=2),
            self_mask,
            target_k,
            target_v,
            cross_len,
        )

    # ---- checkpoints ------------------------------------------------------------------------------------------
    def save_pretrained(self, out_dir: str | os.PathLike) -> None:
        """Write the block alone: model.safetensors + config.json (with the target fingerprint).

        Each file is written to a temporary name and renamed, so a crash never leaves a truncated file."""
        from safetensors.torch import save_file

        os.makedirs(out_dir, exist_ok=True)
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        weights = os.path.join(out_dir, WEIGHTS_NAME)
        save_file(state, weights + ".tmp", metadata={"format": "pt"})
        os.replace(weights + ".tmp", weights)
        config = os.path.join(out_dir, CONFIG_NAME)
        with open(config + ".tmp", "w") as f:
            json.dump(
                {"architecture": "LongSpecDrafter", **self.config.to_dict()}, f, indent=2, sort_keys=True
            )
        os.replace(config + ".tmp", config)

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike,
        target,
        tokenizer=None,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> Drafter:
        """Load a saved block onto `target` (a TargetModel), refusing a target it was not trained for.

        The tokenizer hash is compared when both the checkpoint and the call have a tokenizer."""
        from safetensors.torch import load_file

        path = os.fspath(path)
        config_path, weights_path = os.path.join(path, CONFIG_NAME), os.path.join(path, WEIGHTS_NAME)
        for p in (config_path, weights_path):
            if not os.path.isfile(p):
                raise FileNotFoundError(
                    f"{p} not found: is {path!r} a directory written by Drafter.save_pretrained?"
                )
        with open(config_path) as f:
            data = json.load(f)
        data.pop("architecture", None)
        config = DrafterConfig.from_dict(data)
        problems = fingerprint_mismatches(
            config.target_fingerprint, target_fingerprint(target.config, tokenizer)
        )
        if problems:
            raise ValueError(
                f"drafter at {path!r} does not match this target:\n  "
                + "\n  ".join(problems)
                + "\nload the target (and tokenizer) it was trained for, or train a drafter for this one"
            )
        drafter = cls(config, target.embed_tokens, target.lm_head)
        drafter.load_state_dict(load_file(weights_path), strict=True)
        return drafter.to(device=device, dtype=dtype)


class DrafterCache:
    """Ring buffer of the drafter's self-attention K/V: `window` slots per row, whatever the context length.

    Slot s of row b holds the token at `positions[b, s]` (-1 = empty). `append` writes tokens in order, the
    newest overwriting the oldest; a query at position t sees the slots with t - window <= position <= t."""

    def __init__(
        self,
        config: DrafterConfig,
        batch_size: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ):
        W = config.window
        self.window = W
        shape = (batch_size, config.num_kv_heads, W, config.head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)  # [B,Hkv,W,D] post-RoPE
        self.values = torch.zeros(shape, dtype=dtype, device=device)  # [B,Hkv,W,D]
        self.positions = torch.full((batch_size, W), -1, dtype=torch.long, device=device)  # [B,W]
        self.num_appended = torch.zeros(
            batch_size, dtype=torch.long, device=device
        )  # [B] tokens ever written

    @property
    def nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size() for t in (self.keys, self.values, self.positions, self.num_appended)
        )

    def reset(self) -> None:
        self.positions.fill_(-1)
        self.num_appended.zero_()

    def append(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """k/v [B,Hkv,n,D], positions [B,n] (or [n]); entries with position < 0 are padding and skipped,
        so rows may append different numbers of tokens. Only each row's last `window` tokens are kept."""
        B, n = k.shape[0], k.shape[2]
        if positions.dim() == 1:
            positions = positions.expand(B, n)
        positions = positions.to(self.positions.device)
        valid = positions >= 0  # [B,n]
        order = valid.long().cumsum(1) - 1  # index of each valid token among its row's new tokens
        keep = valid & (order >= valid.sum(1, keepdim=True) - self.window)  # no two writes to one slot
        rows, cols = keep.nonzero(as_tuple=True)
        slots = (self.num_appended[rows] + order[rows, cols]) % self.window
        # Advanced indexing on dims (0, 2) puts the index axis first: [N,Hkv,D] on both sides.
        self.keys[rows, :, slots] = k[rows, :, cols].to(self.keys.dtype)
        self.values[rows, :, slots] = v[rows, :, cols].to(self.values.dtype)
        self.positions[rows, slots] = positions[rows, cols]
        self.num_appended += valid.sum(1)

    def visible_mask(self, query_positions: torch.Tensor) -> torch.Tensor:
        """query_positions [B,Tq] -> bool [B,Tq,W]: slot visible iff filled and within the query's window."""
        pos = self.positions[:, None, :]  # [B,1,W]
        q = query_positions.to(pos.device)[:, :, None]  # [B,Tq,1]
        return (pos >= 0) & (pos <= q) & within_window(q, pos, self.window)


class DraftNodes:
    """Self-attention K/V of the uncommitted draft tokens (a tree's nodes, or a chain) that a draft step sees
    beside the ring buffer: `keys`/`values` [B,Hkv,N,D] in the ring's dtype, filled slot range by slot range by
    `Drafter.tree_level`; `positions` [B,N] (or [N]) long: every node's position, known up front (the root's
    position + the node's depth in a tree), possibly computed from a device tensor (no host value read)."""

    def __init__(self, cache: DrafterCache, positions: torch.Tensor):
        B, Hkv, _, D = cache.keys.shape
        if positions.dim() == 1:
            positions = positions.expand(B, -1)
        self.positions = positions
        self.keys = cache.keys.new_zeros(B, Hkv, positions.shape[1], D)
        self.values = torch.zeros_like(self.keys)
