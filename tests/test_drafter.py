"""Drafter block: structure, sharing, masking semantics, ring-buffer decoding == full-sequence forward."""

import pytest
import torch

from longspec.drafter import Drafter, DrafterCache, DrafterConfig
from longspec.kernels import HAS_TRITON
from longspec.modules import layer_ops
from longspec.testing import make_tiny_target

B, T, WINDOW = 2, 30, 8  # T > WINDOW so the ring buffer wraps and the self-attention window binds
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")


def _setup(variant="llama", window=WINDOW, seed=0):
    target = make_tiny_target(variant)
    config = DrafterConfig.from_target_config(target.config, window=window)
    torch.manual_seed(seed)
    drafter = Drafter(config, target.embed_tokens, target.lm_head).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, 300, (B, T), generator=gen)
    # Different offsets per row: ring positions and RoPE must follow each row's own ids.
    pos = torch.arange(T).expand(B, T) + torch.tensor([[0], [517]])
    out = target(ids, pos)
    return target, drafter, ids, pos, out.last_k, out.last_v


def _draft(drafter, ids, pos, cache, tk, tv, cross_len):
    """Tokens ids [B,Tq] at pos as ONE causal level of `Drafter.tree_level` (the engine's draft step) ->
    (h [B,Tq,Dm], their self K/V [B,Hkv,Tq,D] for `cache.append`)."""
    nodes = drafter.draft_nodes(cache, pos)
    Tq = ids.shape[1]
    causal = torch.ones(Tq, Tq, dtype=torch.bool).tril()
    h = drafter.tree_level(ids, nodes, slice(0, Tq), causal, tk, tv, cross_len)
    return h, nodes.keys, nodes.values


def test_config_mirrors_target():
    for variant, bias, qk_norm in [("llama", False, False), ("qwen2", True, False), ("qwen3", False, True)]:
        target = make_tiny_target(variant)
        cfg = DrafterConfig.from_target_config(target.config)
        assert cfg.window == 512
        assert (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (64, 4, 2, 16)
        assert cfg.intermediate_size == target.config.intermediate_size
        assert cfg.rope_parameters == target.config.rope_parameters
        assert (cfg.attention_bias, cfg.qk_norm) == (bias, qk_norm)
        assert cfg.target_fingerprint["model_type"] == target.config.model_type


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(window=0), "window"),
        (dict(num_kv_heads=3), "multiple"),
        (dict(hidden_act="gelu"), "silu"),
        (dict(head_dim=15), "even"),
        (dict(rope_parameters={"rope_type": "default"}), "rope_theta"),
    ],
)
def test_config_validation(bad, match):
    good = DrafterConfig.from_target_config(make_tiny_target("llama").config).to_dict()
    with pytest.raises(ValueError, match=match):
        DrafterConfig(**{**good, **bad})


def test_config_from_dict_rejects_unknown_fields():
    data = DrafterConfig.from_target_config(make_tiny_target("llama").config).to_dict()
    assert DrafterConfig.from_dict(data) == DrafterConfig(**data)
    with pytest.raises(ValueError, match="unknown DrafterConfig fields"):
        DrafterConfig.from_dict({**data, "num_layers": 2})


def test_only_the_block_is_registered():
    target, drafter, *_ = _setup("qwen2")
    names = set(drafter.state_dict())
    assert not any("embed" in n or "lm_head" in n for n in names)
    assert {n for n in names if n.startswith("cross_attn.")} == {
        "cross_attn.q_proj.weight",
        "cross_attn.q_proj.bias",
        "cross_attn.o_proj.weight",
    }  # no unused k/v projections
    assert "self_attn.k_proj.bias" in names  # bias follows the target (Qwen2)
    cfg = drafter.config
    Dm, F, HD, KD = (
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.num_heads * cfg.head_dim,
        cfg.num_kv_heads * cfg.head_dim,
    )
    expected = (
        3 * Dm  # three RMSNorms
        + (Dm * HD + HD)
        + 2 * (Dm * KD + KD)
        + HD * Dm  # self q,k,v (+bias), o
        + (Dm * HD + HD)
        + HD * Dm  # cross q (+bias), o
        + 3 * Dm * F  # SwiGLU
    )
    assert sum(p.numel() for p in drafter.parameters()) == expected


def test_shared_modules_are_the_targets_storage():
    target, drafter, ids, pos, tk, tv = _setup("qwen2-tied")
    assert drafter.shared_storage_ok(target)
    assert drafter.embed_tokens is target.embed_tokens and drafter.lm_head is target.lm_head
    params = {p.data_ptr() for p in drafter.parameters()}
    assert target.embed_tokens.weight.data_ptr() not in params
    drafter.to(torch.float32)  # .to() on the drafter must not touch (or copy) the shared modules
    assert drafter.shared_storage_ok(target)
    with torch.no_grad():  # an in-place change to the target is seen by the drafter: no copy exists
        before = drafter(ids, pos, tk, tv)
        target.embed_tokens.weight[ids[0, 0]] += 1.0
        after = drafter(ids, pos, tk, tv)
    assert not torch.allclose(before[0, 0], after[0, 0])


def test_qk_norm_follows_target():
    _, drafter, *_ = _setup("qwen3")
    assert drafter.self_attn.q_norm is not None and drafter.cross_attn.q_norm is not None
    _, plain, *_ = _setup("llama")
    assert plain.self_attn.q_norm is None


def test_forward_shapes_and_grads_only_on_block():
    target, drafter, ids, pos, tk, tv = _setup("llama")
    drafter.train()
    h = drafter(ids, pos, tk, tv, lag=2)
    assert h.shape == (B, T, 64)
    logits = drafter.logits(h)
    assert logits.shape == (B, T, 300)
    logits.logsumexp(-1).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in drafter.parameters())
    assert target.embed_tokens.weight.grad is None and target.lm_head.weight.grad is None


def test_init_statistics():
    _, drafter, *_ = _setup("llama")
    w = drafter.mlp.gate_proj.weight
    assert abs(w.std().item() - 0.02) < 0.002 and abs(w.mean().item()) < 0.002
    assert torch.equal(drafter.mlp_norm.weight, torch.ones(64))


@pytest.mark.parametrize("lag", [0, 1, 3])
def test_cross_attention_sees_target_kv_only_up_to_t_minus_lag(lag):
    _, drafter, ids, pos, tk, tv = _setup("llama")
    s = 10  # perturb the target KV at index s: only queries t >= s + lag may change
    tk2, tv2 = tk.clone(), tv.clone()
    tk2[:, :, s] += 1.0
    tv2[:, :, s] -= 1.0
    with torch.no_grad():
        changed = (
            (drafter(ids, pos, tk, tv, lag=lag) - drafter(ids, pos, tk2, tv2, lag=lag)).abs().amax(dim=(0, 2))
        )
    assert (changed[: s + lag] == 0).all()
    assert (changed[s + lag :] > 0).all()


def test_cross_attention_output_is_zero_before_lag():
    _, drafter, ids, pos, tk, tv = _setup("llama")
    with torch.no_grad():
        lag = 4
        a = drafter(ids, pos, tk, tv, lag=lag)
        b = drafter(ids, pos, torch.randn_like(tk), torch.randn_like(tv), lag=lag)
    assert torch.equal(a[:, :lag], b[:, :lag])


def test_self_attention_window():
    _, drafter, ids, pos, tk, tv = _setup("llama")
    s = 5  # changing token s changes h at t in [s, s + window] only (target KV held fixed)
    ids2 = ids.clone()
    ids2[:, s] = (ids2[:, s] + 1) % 300
    with torch.no_grad():
        changed = (
            (drafter(ids, pos, tk, tv, lag=1) - drafter(ids2, pos, tk, tv, lag=1)).abs().amax(dim=(0, 2))
        )
    assert (changed[:s] == 0).all()
    assert (changed[s : s + WINDOW + 1] > 0).all()
    assert (changed[s + WINDOW + 1 :] == 0).all()


@pytest.mark.parametrize("variant", ["llama3", "qwen2", "qwen3"])
@pytest.mark.parametrize("lag", [0, 1, 3])
def test_token_by_token_ring_decoding_equals_forward(variant, lag):
    _, drafter, ids, pos, tk, tv = _setup(variant)
    with torch.no_grad():
        full = drafter(ids, pos, tk, tv, lag=lag)
        cache = DrafterCache(drafter.config, B)
        steps = []
        for t in range(T):
            # Query t sees target KV at indices <= t - lag, i.e. a prefix of t + 1 - lag entries.
            h, k, v = _draft(
                drafter, ids[:, t : t + 1], pos[:, t : t + 1], cache, tk, tv, max(t + 1 - lag, 0)
            )
            cache.append(k, v, pos[:, t : t + 1])
            steps.append(h)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


def test_chunked_ring_decoding_with_per_query_cross_len_equals_forward():
    _, drafter, ids, pos, tk, tv = _setup("llama")
    lag, chunk = 2, 3
    with torch.no_grad():
        full = drafter(ids, pos, tk, tv, lag=lag)
        cache = DrafterCache(drafter.config, B)
        steps = []
        for start in range(0, T, chunk):
            sl = slice(start, min(start + chunk, T))
            idx = torch.arange(sl.start, sl.stop)
            cross_len = (idx + 1 - lag).clamp(min=0).expand(B, -1)  # [B,Tq] per-query target prefix
            h, k, v = _draft(drafter, ids[:, sl], pos[:, sl], cache, tk, tv, cross_len)
            cache.append(k, v, pos[:, sl])
            steps.append(h)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


def test_tree_levels_equal_each_path_decoded_alone():
    # A root r (level 0) with two children a, b at the same position (level 1), drafted level by level as the
    # engine does: with the ancestor mask, each child's output must equal decoding [r, child] as a plain chain.
    _, drafter, ids, pos, tk, tv = _setup("llama")
    with torch.no_grad():
        cache = DrafterCache(drafter.config, B)
        k, v = drafter.self_kv(ids[:, :20], pos[:, :20])
        cache.append(k, v, pos[:, :20])
        r, a, b = ids[:, 20], ids[:, 21], (ids[:, 21] + 7) % 300
        p = pos[:, 20]
        tree_ids = torch.stack([r, a, b], dim=1)
        nodes = drafter.draft_nodes(cache, torch.stack([p, p + 1, p + 1], dim=1))
        ancestors = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
        h_root = drafter.tree_level(tree_ids[:, :1], nodes, slice(0, 1), ancestors[:1, :1], tk, tv, 20)
        h_kids = drafter.tree_level(tree_ids[:, 1:], nodes, slice(1, 3), ancestors[1:], tk, tv, 20)
        for col, child in ((0, a), (1, b)):
            path_ids = torch.stack([r, child], dim=1)
            h_path, k_path, _ = _draft(drafter, path_ids, nodes.positions[:, :2], cache, tk, tv, 20)
            torch.testing.assert_close(h_root[:, 0], h_path[:, 0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(h_kids[:, col], h_path[:, 1], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(nodes.keys[:, :, [0, col + 1]], k_path, atol=1e-6, rtol=1e-6)


def test_tree_level_window_hides_far_ancestors():
    # A chain drafted one level at a time, longer than the window: level t must see its ancestors (ring slots
    # and earlier levels) only within the window, i.e. equal the full-sequence forward.
    _, drafter, ids, pos, tk, tv = _setup("llama")
    n = 4  # ring holds tokens 0..3; the chain is tokens 4..T-1 (T - n levels > window) at their positions
    with torch.no_grad():
        full = drafter(ids, pos, tk, tv, lag=0)
        cache = DrafterCache(drafter.config, B)
        drafter.fill_cache(cache, ids[:, :n], pos[:, :n])
        nodes = drafter.draft_nodes(cache, pos[:, n:])
        chain = torch.ones(T - n, T - n, dtype=torch.bool).tril()
        for level in range(T - n):
            sl = slice(level, level + 1)
            t = n + level  # sees target KV <= t, as forward with lag 0
            h = drafter.tree_level(ids[:, t, None], nodes, sl, chain[sl, : sl.stop], tk, tv, t + 1)
            torch.testing.assert_close(h[:, 0], full[:, t], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", ["llama", "qwen2", "qwen3"])  # plain, q/k/v biases, per-head q/k norms
def test_packed_tree_level_equals_forward(variant):
    # The engine packs the drafter's projections (`pack_weights`: one GEMM for q/k/v, one for gate/up); the
    # packed draft step must still be the training forward, and the state dict must keep its names and values.
    _, drafter, ids, pos, tk, tv = _setup(variant)
    n = 10
    state = {k: v.clone() for k, v in drafter.state_dict().items()}
    with torch.no_grad():
        full = drafter(ids, pos, tk, tv, lag=0)
        unpacked_kv = drafter.self_kv(ids, pos)
        for param in drafter.parameters():
            param.requires_grad_(False)
        assert drafter.pack_weights()
        # every ring fill runs the packed K/V (norm, the packed projection's k/v rows, fused RoPE)
        for got, want in zip(drafter.self_kv(ids, pos), unpacked_kv, strict=True):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
        cache = DrafterCache(drafter.config, B)
        drafter.fill_cache(cache, ids[:, :n], pos[:, :n])
        nodes = drafter.draft_nodes(cache, pos[:, n:])
        chain = torch.ones(T - n, T - n, dtype=torch.bool).tril()
        for level in range(T - n):
            sl, t = slice(level, level + 1), n + level
            h = drafter.tree_level(ids[:, t, None], nodes, sl, chain[sl, : sl.stop], tk, tv, t + 1)
            torch.testing.assert_close(h[:, 0], full[:, t], atol=1e-5, rtol=1e-5)
    assert drafter.state_dict().keys() == state.keys()
    assert all(torch.equal(drafter.state_dict()[k], v) for k, v in state.items())
    assert drafter.to(torch.float64).packed_qkv_weight.dtype == torch.float64  # packed weights follow .to()


def test_pack_weights_refuses_weights_that_train():
    _, drafter, *_ = _setup()
    assert not drafter.pack_weights()  # requires_grad: the optimizer's parameters must stay separate tensors
    assert not drafter.packed


def test_prefill_fills_only_the_window_and_matches_forward():
    _, drafter, ids, pos, tk, tv = _setup("llama3")
    lag, n = 1, 25  # prompt = tokens 0..24, then decode token 25
    with torch.no_grad():
        full = drafter(ids, pos, tk, tv, lag=lag)
        cache = DrafterCache(drafter.config, B)
        drafter.fill_cache(cache, ids[:, :n], pos[:, :n])
        # every prompt token counted (the ring's clock, as `append`), the last `window` held
        assert cache.num_appended.tolist() == [n, n]
        held = [sorted(row.tolist()) for row in cache.positions]
        assert held == [sorted(row.tolist()) for row in pos[:, n - WINDOW : n]]
        h, _, _ = _draft(drafter, ids[:, n : n + 1], pos[:, n : n + 1], cache, tk, tv, n + 1 - lag)
    torch.testing.assert_close(h[:, 0], full[:, n], atol=1e-5, rtol=1e-5)


def test_cross_len_zero_means_no_cross_attention():
    _, drafter, ids, pos, tk, tv = _setup("llama")
    with torch.no_grad():
        cache = DrafterCache(drafter.config, B)
        h0, _, _ = _draft(drafter, ids[:, :1], pos[:, :1], cache, tk, tv, 0)
        h_other, _, _ = _draft(drafter, ids[:, :1], pos[:, :1], cache, torch.randn_like(tk), tv, 0)
    assert torch.equal(h0, h_other)


# ---- DrafterCache ------------------------------------------------------------------------------------------


def _cfg(window=WINDOW):
    return DrafterConfig.from_target_config(make_tiny_target("llama").config, window=window)


def test_cache_memory_is_independent_of_context_length():
    cfg = _cfg(window=16)
    sizes = []
    for n in (100, 10_000):
        cache = DrafterCache(cfg, 1)
        k = torch.randn(1, cfg.num_kv_heads, n, cfg.head_dim)
        for start in range(0, n, 1000):  # appended in chunks, as decoding would
            cache.append(
                k[:, :, start : start + 1000],
                k[:, :, start : start + 1000],
                torch.arange(start, min(n, start + 1000)),
            )
        sizes.append(cache.nbytes)
        assert int(cache.num_appended) == n
        assert sorted(cache.positions[0].tolist()) == list(range(n - 16, n))
    assert sizes[0] == sizes[1] == 2 * 16 * cfg.num_kv_heads * cfg.head_dim * 4 + 16 * 8 + 8


def test_cache_wraparound_matches_full_reference():
    cfg = _cfg()
    gen = torch.Generator().manual_seed(3)
    n = 29
    k = torch.randn(B, cfg.num_kv_heads, n, cfg.head_dim, generator=gen)
    v = torch.randn(B, cfg.num_kv_heads, n, cfg.head_dim, generator=gen)
    positions = torch.arange(n).expand(B, n) + 100
    cache = DrafterCache(cfg, B)
    for start, stop in [(0, 3), (3, 4), (4, 13), (13, 29)]:  # uneven chunks, one longer than the window
        cache.append(k[:, :, start:stop], v[:, :, start:stop], positions[:, start:stop])
    for b in range(B):
        order = cache.positions[b].argsort()
        assert torch.equal(cache.positions[b, order], positions[b, n - WINDOW :])
        assert torch.equal(cache.keys[b][:, order], k[b, :, n - WINDOW :])
        assert torch.equal(cache.values[b][:, order], v[b, :, n - WINDOW :])


def test_cache_append_skips_padding_per_row():
    cfg = _cfg()
    cache = DrafterCache(cfg, 2)
    k = torch.arange(4.0).view(1, 1, 4, 1).expand(2, cfg.num_kv_heads, 4, cfg.head_dim).clone()
    positions = torch.tensor([[0, 1, 2, 3], [0, 1, -1, -1]])  # row 1 accepted only 2 tokens
    cache.append(k, k, positions)
    assert cache.num_appended.tolist() == [4, 2]
    cache.append(k[:, :, :1] + 10, k[:, :, :1], torch.tensor([[4], [2]]))
    assert cache.positions[0, :5].tolist() == [0, 1, 2, 3, 4]
    assert cache.positions[1, :3].tolist() == [0, 1, 2] and (cache.positions[1, 3:] == -1).all()
    assert cache.keys[1, 0, 2, 0].item() == 10.0


def _rotary():
    from longspec.modules.rope import RotaryEmbedding

    return RotaryEmbedding(1.0 / 10000.0 ** (torch.arange(0, 4, 2, dtype=torch.float) / 4))


def test_draft_nodes_see_the_filled_ring_slots_within_their_window():
    from longspec.drafter.cache import DraftNodes

    cfg = _cfg(window=4)
    cache = DrafterCache(cfg, 1)
    kv = torch.zeros(1, cfg.num_kv_heads, 6, cfg.head_dim)
    cache.append(kv, kv, torch.arange(6))  # ring keeps positions 2..5
    nodes = DraftNodes(cache, torch.tensor([[6, 7, 9]]), _rotary())
    visible = [sorted(cache.positions[0][nodes._mask[0, i, :4]].tolist()) for i in range(3)]
    assert visible == [[2, 3, 4, 5], [3, 4, 5], [5]]
    # root + offsets: the same nodes
    by_root = DraftNodes(cache, torch.tensor([0, 1, 3]), _rotary(), root=6)
    assert torch.equal(by_root.positions, nodes.positions)
    want_cos, want_sin = _rotary().cos_sin(nodes.positions, dtype=cache.keys.dtype)  # the nodes' angles
    assert torch.equal(by_root.cos, want_cos) and torch.equal(by_root.sin, want_sin)
    assert torch.equal(by_root._mask[:, :, :4], nodes._mask[:, :, :4])
    cache.reset()
    assert not DraftNodes(cache, torch.tensor([[6]]), _rotary())._mask[:, :, :4].any()


def test_draft_nodes_angles_follow_a_longrope_rule():
    """A longrope rotary under HF's per-forward rule has no fixed frequencies: the nodes' angles come from
    `cos_sin`, which picks the set by the nodes' positions (the long one past the original context); fixed to one
    set (`set_long`), they are that set's."""
    from longspec.drafter.cache import DraftNodes
    from longspec.modules.rope import RotaryEmbedding

    short = 1.0 / 10000.0 ** (torch.arange(0, 4, 2, dtype=torch.float) / 4)
    rotary = RotaryEmbedding(short, long_inv_freq=short / 4, original_positions=8)
    cache = DrafterCache(_cfg(window=4), 1)
    assert rotary.fixed_frequencies() is None
    for positions, freq in ((torch.tensor([[2, 3]]), short), (torch.tensor([[9, 10]]), short / 4)):
        nodes = DraftNodes(cache, positions, rotary)
        angles = positions[..., None].float() * freq
        assert torch.allclose(nodes.cos, torch.cat([angles, angles], -1).cos())
    rotary.set_long(False)
    assert torch.equal(rotary.fixed_frequencies(), short)
    nodes = DraftNodes(cache, torch.tensor([[9, 10]]), rotary)  # past the original context, yet the short set
    angles = torch.tensor([[9.0], [10.0]])[None] * short
    assert torch.allclose(nodes.cos, torch.cat([angles, angles], -1).cos())


def test_draft_nodes_masks_equal_the_window_rule():
    """The ring part of a draft's mask and `_near` (ranges and one comparison each) equal the rule written out:
    filled, causal and `within_window`, for ring rows that wrapped, are partly empty or empty, and node
    positions of a tree and of a chain (the tree's nodes also before a row's oldest slot), given whole or as
    offsets from each row's root (an int or [B])."""
    from longspec.drafter.cache import DraftNodes
    from longspec.modules.masks import within_window

    window, gen = 8, torch.Generator().manual_seed(0)
    cfg = _cfg(window=window)
    cache = DrafterCache(cfg, 3)
    kv = torch.zeros(3, cfg.num_kv_heads, 20, cfg.head_dim)
    lengths = torch.tensor([20, 5, 0])  # wrapped, partly filled (-1 slots), empty
    cache.append(kv, kv, torch.where(torch.arange(20) < 20 - lengths[:, None], -1, torch.arange(20)))
    cache.append(kv[:, :, :3], kv[:, :, :3], torch.tensor([[20, 21, 22], [-1, 5, 6], [-1, -1, -1]]))
    assert (cache.positions == -1).any() and cache.num_appended.tolist() == [23, 7, 0]
    tree_depths = torch.tensor([0, 1, 1, 2, 2, 2, 3, 3, 4, 12])
    for depths in (tree_depths, torch.arange(12)):  # a tree and a chain, each longer than the window
        for roots in (torch.tensor([23, 7, 0]), torch.randint(0, 40, (3,), generator=gen), 9):
            positions = (roots[:, None] if isinstance(roots, torch.Tensor) else roots) + depths
            positions = positions.expand(3, -1)  # [B, N]
            q, ring = positions[:, :, None], cache.positions[:, None, :]
            expect = (ring >= 0) & (ring <= q) & within_window(q, ring, window)
            for nodes in (
                DraftNodes(cache, positions, _rotary()),
                DraftNodes(cache, depths, _rotary(), root=roots),
            ):
                assert torch.equal(nodes.positions, positions)
                assert torch.equal(nodes._mask[:, :, :window], expect)
                assert torch.equal(nodes._near, within_window(q, positions[:, None, :], window))
            assert expect.any() and not expect.all() and not nodes._near.all()


def test_drafter_learns_a_fixed_batch_with_the_fused_loss():
    # Integration: target forward -> flash-noisy drafter forward -> fused CE; the block alone trains.
    from longspec.losses import fused_linear_cross_entropy
    from longspec.modules.noisy import sample_lag

    target, drafter, ids, pos, tk, tv = _setup("llama")
    drafter.train()
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(8):
        h = drafter(ids, pos, tk, tv, lag=sample_lag(5, generator=gen))
        loss = fused_linear_cross_entropy(h[:, :-1], target.lm_head.weight, ids[:, 1:]) / ids[:, 1:].numel()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0]
    assert target.lm_head.weight.grad is None


def test_bf16_drafter_on_bf16_target_is_close_to_fp32():
    target, drafter, ids, pos, tk, tv = _setup("qwen2")
    with torch.no_grad():
        ref = drafter(ids, pos, tk, tv, lag=1)
        target.to(torch.bfloat16)
        out = target(ids, pos)
        drafter.to(torch.bfloat16)
        h = drafter(ids, pos, out.last_k, out.last_v, lag=1)
    assert h.dtype == torch.bfloat16
    torch.testing.assert_close(h.float(), ref, atol=0.1, rtol=0.05)


class _PerTokenRing:
    """The obvious ring write, from a ring's state: each valid token, in order, goes to slot
    num_appended % window of its row; padding (-1) is skipped. The ring's spare slots (set to a mark here) are
    no slots of the ring: no write reaches them."""

    def __init__(self, cache: DrafterCache):
        self.window = cache.window
        for storage in cache._storage[:2]:
            storage[:, :, cache.window :] = 7.0
        self.spare = [t[:, :, cache.window :].clone() for t in cache._storage[:2]]
        self.keys, self.values = cache.keys.clone(), cache.values.clone()
        self.positions, self.count = cache.positions.clone(), cache.num_appended.tolist()

    def write(self, k, v, pos):
        for row in range(pos.shape[0]):
            for col in range(pos.shape[1]):
                if pos[row, col] >= 0:
                    slot = self.count[row] % self.window
                    self.keys[row, :, slot], self.values[row, :, slot] = k[row, :, col], v[row, :, col]
                    self.positions[row, slot] = pos[row, col]
                    self.count[row] += 1

    def assert_is(self, cache: DrafterCache):
        assert cache.num_appended.tolist() == self.count
        assert torch.equal(cache.positions, self.positions)
        assert torch.equal(cache.keys, self.keys) and torch.equal(cache.values, self.values)
        assert all(
            torch.equal(t[:, :, self.window :], s)
            for t, s in zip(cache._storage[:2], self.spare, strict=True)
        )


@pytest.mark.parametrize("spare", [0, 3])  # with spare slots, the ring's keys/values are strided views
def test_ring_append_is_the_per_token_ring_write(spare):
    """DrafterCache.append (fixed shapes, no host sync) against the obvious loop. Ragged rows, padding at the
    left (prefill), on the right (a round's shorter accepted path), wrap-around, and n > window."""
    config = DrafterConfig.from_target_config(make_tiny_target("llama").config, window=4)
    cache = DrafterCache(config, 2, spare=spare)
    reference = _PerTokenRing(cache)
    gen = torch.Generator().manual_seed(0)
    calls = [
        [[-1, -1, 0, 1], [0, 1, 2, 3]],  # left-padded prompt tails
        [[2, 3, -1], [4, -1, -1]],  # accepted paths of different lengths
        [[-1, -1, -1], [5, 6, 7]],  # a frozen row
        [[4, 5, 6, 7, 8, 9], [8, 9, 10, 11, 12, 13]],  # more than the window
    ]
    for pos in calls:
        pos = torch.tensor(pos)
        k = torch.randn(2, config.num_kv_heads, pos.shape[1], config.head_dim, generator=gen)
        v = torch.randn_like(k)
        cache.append(k, v, pos)
        reference.write(k, v, pos)
        reference.assert_is(cache)


@pytest.mark.parametrize(
    "route, dtype",
    [
        ("unpacked", torch.float32),
        ("packed", torch.float32),
        pytest.param("packed, triton", torch.float32, marks=needs_triton),
        pytest.param("packed, triton", torch.bfloat16, marks=needs_triton),  # into a float32 ring
    ],
)
@pytest.mark.parametrize("spare", [0, 5])  # with spare slots, the ring's keys/values are strided views
def test_fill_cache_is_the_per_token_ring_write(route, dtype, spare, monkeypatch):
    """Drafter.fill_cache (slots from `DrafterCache.claim_slots`; on the packed path the RoPE step writes the K/V
    into the ring, skipping the padding's negative slots) leaves the ring, to the bit, as the per-token write of
    `self_kv`'s K/V of every column: a batch of 3 ragged rows, left-padded (prefill, catch-up),
    right-padded (as a round's accepted paths), unpadded, more columns than the window, a row that enters
    nothing, and rings that wrap."""
    target = make_tiny_target("llama")
    config = DrafterConfig.from_target_config(target.config, window=8)
    drafter = Drafter(config, target.embed_tokens, target.lm_head).requires_grad_(False).to(dtype)
    if route != "unpacked":
        assert drafter.pack_weights()
    if route == "packed, triton":  # the CUDA route (fused Triton steps), in the CPU interpreter
        monkeypatch.setattr(layer_ops, "use_triton", lambda x: True)
    cache = DrafterCache(config, 3, spare=spare)
    reference = _PerTokenRing(cache)
    fills = [
        [[-1, -1, -1, 0, 1, 2], [0, 1, 2, 3, 4, 5], [-1, -1, -1, -1, -1, 0]],
        [[3, 4, -1, -1], [6, 7, 8, 9], [1, -1, -1, -1]],
        [list(range(5, 16)), [-1, -1, *range(10, 19)], [-1] * 11],
        [[16, 17, 18], [19, -1, -1], [2, 3, 4]],
        [[19, 20], [20, 21], [5, 6]],
    ]
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for positions in fills:
            pos = torch.tensor(positions)
            ids = torch.randint(0, 300, pos.shape, generator=gen)
            drafter.fill_cache(cache, ids, pos)
            # every column written token by token: those before the last `window` are overwritten in the ring,
            # as fill_cache leaves them out (but counts them)
            reference.write(*drafter.self_kv(ids, pos.clamp(min=0)), pos)
            reference.assert_is(cache)
