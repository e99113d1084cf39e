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
own cache is a ring buffer of `window` slots (`DrafterCache`, longspec/drafter/cache.py), O(window) memory at
any context length.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from longspec.drafter.cache import DrafterCache, DraftNodes
from longspec.drafter.config import DrafterConfig
from longspec.drafter.files import CONFIG_NAME, WEIGHTS_NAME, load_drafter, save_drafter
from longspec.drafter.vocab import DraftVocab
from longspec.modules.attention import attention, cache_attention, tree_attention
from longspec.modules.layer_ops import (
    add_rms_norm,
    embed_rms_norm,
    head_logits,
    head_pick,
    linear,
    linear_silu_mul,
    project,
    qkv_rope,
    silu_mul,
    write_kv,
)
from longspec.modules.layers import RMSNorm, SwiGLU, bind_views, pack_linears
from longspec.modules.noisy import flash_noisy_attention
from longspec.modules.rope import RotaryEmbedding, apply_rotary, rope_config

__all__ = ["Drafter", "WEIGHTS_NAME", "CONFIG_NAME"]


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
        # The head it drafts with: the target's LM head, or its rows of a draft vocabulary (`use_draft_vocab`).
        object.__setattr__(self, "draft_vocab", None)
        object.__setattr__(self, "_head", lm_head)
        object.__setattr__(self, "_draft_ids", None)
        # `pack_weights`: the stacked projections, as non-persistent buffers (they follow .to(), stay out of the
        # state dict, whose names are the modules' own).
        for name in ("packed_qkv_weight", "packed_qkv_bias", "packed_gate_up_weight", "packed_gate_up_bias"):
            self.register_buffer(name, None, persistent=False)
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

    def use_draft_vocab(self, vocab: DraftVocab | None, *, head: bool = True) -> None:
        """Draft over `vocab`'s ids only (longspec.drafter.vocab; None: the whole vocabulary); the config records
        the map. With `head`, the drafting head becomes a frozen copy of those rows of the target's LM head, on
        its device (training reads the rows itself: its LM head may be a ZeRO-3 shard, train.model)."""
        object.__setattr__(self, "draft_vocab", vocab)
        use_rows = vocab is not None and head
        object.__setattr__(self, "_head", vocab.head(self.lm_head) if use_rows else self.lm_head)
        ids = None if vocab is None else vocab.ids.to(self.lm_head.weight.device)
        object.__setattr__(self, "_draft_ids", ids)
        self.config.draft_vocab_size = None if vocab is None else vocab.size
        self.config.draft_vocab_sha256 = None if vocab is None else vocab.fingerprint()

    @property
    def draft_vocab_size(self) -> int:
        """Kd, the size of the logits `logits` returns: the draft vocabulary's, else the target's V."""
        return self.config.vocab_size if self.draft_vocab is None else self.draft_vocab.size

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., Dm] -> [..., Kd] through the drafting head (no final norm): indexed by draft id."""
        return head_logits(self._head, hidden.to(self._head.weight.dtype))

    def pick(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., Dm] -> [...]: the target id of each row's largest draft logit (the first, among ties): a greedy
        chain's level, in one launch on the GPU where it can (`modules.layer_ops.head_pick`), the logits never
        written."""
        return head_pick(self._head, hidden.to(self._head.weight.dtype), self._draft_ids)

    @property
    def draft_ids(self) -> torch.Tensor | None:
        """The draft vocabulary's ids [Kd] (draft id -> target id) on the drafter's device; None without one."""
        return self._draft_ids

    def target_probs(self, draft_probs: torch.Tensor) -> torch.Tensor:
        """[..., Kd] probabilities over draft ids -> [..., V] over target ids (0 outside the draft vocabulary)."""
        if self._draft_ids is None:
            return draft_probs
        full = draft_probs.new_zeros(*draft_probs.shape[:-1], self.config.vocab_size)
        return full.index_copy_(-1, self._draft_ids, draft_probs)

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
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        *,
        cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Self-attention K (post-RoPE) and V [B,Hkv,T,D] of tokens at positions: a function of (token, position)
        only, so it can be computed once per token (e.g. the last `window` prompt tokens at prefill). cache =
        (k_cache, v_cache [B,Hkv,W,D], slots [B,T]): k and v are also written there, a negative slot writing
        nothing (`layer_ops.qkv_rope`)."""
        dtype = self.mlp_norm.weight.dtype
        cos, sin = self.rotary.cos_sin(position_ids, dtype=dtype)
        if not self.packed:
            k, v = self._self_kv(self.self_attn_norm(self.embed(input_ids)), cos, sin)
            if cache is not None:
                write_kv(*cache, k, v, skip_negative=True)
            return k, v
        # After `pack_weights`: the fused steps `tree_level` computes a node's K/V with, so the ring holds exactly
        # what the node held while drafting (every ring fill runs it: prefill, catch-up, each round's commit).
        cfg = self.config
        norm = self.self_attn_norm
        x, _ = embed_rms_norm(self.embed_tokens, input_ids, norm.weight, norm.eps, dtype)
        q_rows = cfg.num_heads * cfg.head_dim
        bias = self.packed_qkv_bias
        kv = linear(x, self.packed_qkv_weight[q_rows:], None if bias is None else bias[q_rows:])
        _, k, v = qkv_rope(
            kv, cos, sin, 0, cfg.num_kv_heads, **self._norms(self.self_attn), cache=cache, skip_negative=True
        )
        return k, v

    def fill_cache(
        self,
        cache: DrafterCache,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
    ) -> None:
        """Append committed tokens' self-attention K/V to the ring, e.g. the prompt at prefill. Only the last
        `window` columns can survive in the ring, so only they are computed (no O(n^2) work over the prompt).
        Rows may be padded (position -1) on either side, with at most `window` columns unless unpadded or
        left-padded (`DrafterCache.claim_slots`). The K/V go straight into the ring's slots (the RoPE step writes
        them)."""
        if position_ids.dim() == 1:
            position_ids = position_ids.expand(input_ids.shape[0], -1)
        drop = cache.drop_older(position_ids)
        ids, pos = input_ids[:, drop:], position_ids[:, drop:]
        # Padding's slot is negative: its K/V (RoPE at a negative position, finite) are computed, never written.
        self.self_kv(ids, pos, cache=(cache.keys, cache.values, cache.claim_slots(pos)))

    def draft_nodes(
        self,
        cache: DrafterCache,
        positions: torch.Tensor,
        root: int | torch.Tensor | None = None,
        ancestors: torch.Tensor | None = None,
    ) -> DraftNodes:
        """The per-draft layout (`DraftNodes`) of uncommitted tokens at `positions` [B,N] (or [N]; with `root`, an
        int or [B], their offsets from each row's root position) beside the ring `cache`: their positions, masks
        (with `ancestors`, the whole tree's ancestor mask, the node part too) and rotary angles once, in the
        drafter's compute dtype."""
        return DraftNodes(
            cache, positions, self.rotary, self.mlp_norm.weight.dtype, root=root, ancestors=ancestors
        )

    def pack_weights(self) -> bool:
        """Inference only: one projection for the self-attention's q/k/v and one for the MLP's gate/up (the
        modules' weights become views of the packed ones, no extra memory), as `TargetModel.pack_weights`.
        Returns False, changing nothing, for weights that train or are sharded (ZeRO-3)."""
        if self.packed:
            return True
        if any(p.requires_grad or hasattr(p, "ds_id") or p.device.type == "meta" for p in self.parameters()):
            return False
        attn, mlp = self.self_attn, self.mlp
        qkv = pack_linears((attn.q_proj, attn.k_proj, attn.v_proj))
        gate_up = pack_linears((mlp.gate_proj, mlp.up_proj))
        if qkv is None or gate_up is None:
            return False
        bind_views((attn.q_proj, attn.k_proj, attn.v_proj), *qkv)
        bind_views((mlp.gate_proj, mlp.up_proj), *gate_up)
        self.packed_qkv_weight, self.packed_qkv_bias = qkv
        self.packed_gate_up_weight, self.packed_gate_up_bias = gate_up
        return True

    @property
    def packed(self) -> bool:
        """Whether `pack_weights` has run."""
        return self.packed_qkv_weight is not None

    def _self_qkv(self, x: torch.Tensor) -> torch.Tensor:
        """[B,T,Dm] -> packed [B,T,(H+2Hkv)*D]: one GEMM after `pack_weights`."""
        if self.packed:
            return linear(x, self.packed_qkv_weight, self.packed_qkv_bias)
        attn = self.self_attn
        return torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], dim=-1)

    def _gate_up_act(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate(x)) * up(x) [B,T,F]: one GEMM + one fused step after `pack_weights` (one launch at 1-2 rows:
        `layer_ops.linear_silu_mul`)."""
        if self.packed:
            return linear_silu_mul(x, self.packed_gate_up_weight, self.packed_gate_up_bias)
        mlp = self.mlp
        return silu_mul(torch.cat([mlp.gate_proj(x), mlp.up_proj(x)], dim=-1))

    def _norms(self, attn: nn.Module) -> dict:
        """qkv_rope's per-head norm arguments (Qwen3-style q/k norms), empty without them."""
        if attn.q_norm is None:
            return {}
        k_norm = attn.k_norm if hasattr(attn, "k_norm") else attn.q_norm  # cross-attention: no k heads
        return dict(q_norm=attn.q_norm.weight, k_norm=k_norm.weight, eps=attn.q_norm.eps)

    def tree_level(
        self,
        input_ids: torch.Tensor,
        nodes: DraftNodes,
        level: slice,
        node_mask: torch.Tensor | None,
        target_k: torch.Tensor,
        target_v: torch.Tensor,
        cross_len: int | torch.Tensor,
    ) -> torch.Tensor:
        """One draft step over the uncommitted tokens in `nodes` slots `level` -> h3 [B,P,Dm] (P = the level's
        width): the one inference step, run by the engine per tree level and checked by the tests against the
        training forward.

        input_ids [B,P] are the level's tokens, at positions `nodes.positions[:, level]`; their self K/V are
        written into `nodes` (slots `level`, by the RoPE step), so later levels reuse them. A query sees the
        ring (as `nodes` lays it out) within its window and node j iff node_mask[.., i, j] (the tree's ancestor
        mask over nodes [0, level.stop), self included; [P, stop] or [B, P, stop]) and within the window
        (`DraftNodes`; None: the node part `nodes` wrote up front, a chain's). cross_len: the visible target
        prefix -- an int or [B] (the same for every query: all tree nodes see the committed prefix) or [B,P] (per
        query, e.g. re-fed accepted tokens). The ring is NOT modified (its slots and bookkeeping: the nodes go to
        its spare slots, or after a copy of it).

        The residual stream is carried as (delta, residual) so that each add is fused into the next norm, as
        the target's packed layers do (`modules.layer_ops`; one launch per step on CUDA)."""
        cfg = self.config
        cos, sin = nodes.cos[:, level], nodes.sin[:, level]  # [B,P,D]
        norm = self.self_attn_norm
        x, h = embed_rms_norm(self.embed_tokens, input_ids, norm.weight, norm.eps, self.mlp_norm.weight.dtype)
        q, _, _ = qkv_rope(
            self._self_qkv(x), cos, sin, cfg.num_heads, cfg.num_kv_heads, **self._norms(self.self_attn),
            cache=(nodes.keys, nodes.values, nodes.slots[:, level]),
        )  # fmt: skip
        out, _ = tree_attention(q, *nodes.self_attention(level, node_mask))
        x, h = add_rms_norm(
            project(self.self_attn.o_proj, _merge_heads(out)),
            h,
            self.cross_attn_norm.weight,
            self.cross_attn_norm.eps,
        )  # h = h1
        qc, _, _ = qkv_rope(
            project(self.cross_attn.q_proj, x), cos, sin, cfg.num_heads, 0, **self._norms(self.cross_attn)
        )
        target_k, target_v = target_k.to(qc.dtype), target_v.to(qc.dtype)
        if isinstance(cross_len, torch.Tensor) and cross_len.dim() == 2:
            slots = torch.arange(target_k.shape[2], device=qc.device)
            mask = slots[None, None, :] < cross_len.to(qc.device)[:, :, None]  # [B,P,S]
            out, _ = tree_attention(qc, target_k, target_v, mask)
        else:
            out, _ = cache_attention(qc, target_k, target_v, cross_len)
        x, h = add_rms_norm(
            project(self.cross_attn.o_proj, _merge_heads(out)), h, self.mlp_norm.weight, self.mlp_norm.eps
        )
        return project(self.mlp.down_proj, self._gate_up_act(x), h)  # h3 = h2 + MLP(RMSNorm_c(h2))

    # ---- checkpoints ------------------------------------------------------------------------------------------
    def save_pretrained(self, out_dir: str | os.PathLike) -> None:
        """Write the block alone (longspec.drafter.files.save_drafter)."""
        save_drafter(self, out_dir)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, target, tokenizer=None, **kwargs) -> Drafter:
        """Load a saved block onto `target`, refusing a target it was not trained for
        (longspec.drafter.files.load_drafter: dtype, device)."""
        return load_drafter(cls, path, target, tokenizer, **kwargs)
