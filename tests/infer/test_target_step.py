"""The target side of a round: the sliding-window key selection of the one target forward, host vs device."""

import pytest
import torch

from longspec.infer.target_step import _window_keys


@pytest.mark.parametrize("n", [0, 3, 5, 6, 11])
def test_window_keys_host_and_device_select_the_same_visible_keys(n):
    """The sliding-window key selection of the one target forward, with the cache length on the host (a slice)
    and on the device (fixed-size indices, what a CUDA graph replays), against the plain rule: new token i at
    position n + offsets[i] sees key position j iff j < n (cached) or j is a new token under new_mask, and
    t - j <= window. n < window covers the clamped, non-existent slots of the device selection."""
    window = 5
    offsets = torch.tensor([0, 1, 1, 2, 3])  # a tree: root, two children, a grandchild, its child
    new_mask = torch.tensor(
        [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 1, 0, 1, 1]],
        dtype=torch.bool,
    )
    T = offsets.numel()
    # Absolute key position of cache slot s is s (s < n); new token k sits in slot n + k at position n + offsets[k].
    expected = set()
    for i in range(T):
        t = n + int(offsets[i])
        expected |= {(i, ("cache", j)) for j in range(n) if t - j <= window}
        expected |= {
            (i, ("new", k)) for k in range(T) if new_mask[i, k] and offsets[i] - offsets[k] <= window
        }
    for length in (n, torch.tensor(n)):
        select, mask = _window_keys(length, offsets, new_mask, window)
        slots = torch.arange(n + T)[select].tolist()
        seen = {
            (i, ("cache", slot) if slot < n else ("new", slot - n))
            for i in range(T)
            for col, slot in enumerate(slots)
            if mask[i, col]
        }
        assert seen == expected, type(length)


@pytest.mark.parametrize("family", ["llama", "mistral"])
@pytest.mark.parametrize("static", [False, True])
def test_a_chain_verify_equals_the_hybrid_path(family, static):
    """A chain tree's verify (DraftTree.chain: the cache attention's causal tail over [0, n + T), one kernel pair
    on a GPU) gives the logits of the same tree verified as a general tree (cache part + masked tree part,
    merged), over a ragged batch on static shapes too; a Mistral layer's sliding window keeps its own path."""
    import dataclasses

    from infer_helpers import random_drafter

    from longspec.infer.engine import GenerationConfig, SpeculativeEngine
    from longspec.infer.tree import chain_tree
    from longspec.testing import make_tiny_target

    target = make_tiny_target(family)
    engine = SpeculativeEngine(target, random_drafter(target))
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=gen) for n in (40, 27)]
    engine.reserve_for([p.numel() for p in prompts], GenerationConfig(max_new_tokens=8))
    engine.runner.start(prompts, GenerationConfig(max_new_tokens=8), None, history=False, ring=False)
    roots = torch.tensor([5, 9])
    chain = chain_tree(roots, torch.randint(0, 256, (2, 4), generator=gen), 4, 5)
    assert chain.chain
    logits = engine.runner.verify(chain, static=static)
    general = engine.runner.verify(dataclasses.replace(chain, chain=False), static=static)
    torch.testing.assert_close(logits, general, atol=1e-5, rtol=1e-5)
