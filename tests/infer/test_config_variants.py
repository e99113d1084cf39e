"""Lossless on config variants of the supported families that real checkpoints use and the tiny variants of
`longspec.testing` do not: biases, a head dim other than hidden / heads, MQA and MHA, tied embeddings, YaRN and
dynamic rope, per-layer sliding windows (Qwen2/3's max_window_layers), Mistral without a window, a partial rope. Each decodes
with longspec and ar, eager and on static shapes, against the HF model's own greedy output."""

import pytest
import torch
from infer_helpers import random_drafter, reference_greedy

from longspec.infer.engine import GenerationConfig, SpeculativeEngine
from longspec.modules.rope import exact_positions
from longspec.target import TargetModel
from longspec.testing import longrope_overrides, make_tiny_hf_model

VARIANTS = {
    "llama-biases": ("llama", dict(attention_bias=True, mlp_bias=True)),
    "llama-head-dim-32": ("llama", dict(head_dim=32)),
    "llama-mqa": ("llama", dict(num_key_value_heads=1)),
    "llama-mha": ("llama", dict(num_key_value_heads=4)),
    "llama-tied": ("llama", dict(tie_word_embeddings=True)),
    "llama-yarn": (
        "llama",
        dict(
            max_position_embeddings=128,
            rope_parameters={
                "rope_type": "yarn",
                "factor": 4.0,
                "rope_theta": 1e4,
                "original_max_position_embeddings": 32,
            },
        ),
    ),
    "llama-dynamic": (
        "llama",
        dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}),
    ),
    "qwen2-window-layers": ("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)),
    "qwen3-window-layers": ("qwen3", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)),
    "mistral-no-window": ("mistral", dict(sliding_window=None)),
    # half of each head rotates, plain rope (the tiny phi4-mini variant covers partial + LongRoPE)
    "phi3-partial-rope": (
        "phi3",
        dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
    ),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_config_variant_is_lossless(variant):
    family, overrides = VARIANTS[variant]
    target = TargetModel(make_tiny_hf_model(family, **overrides))
    assert target.pack_weights()  # the fused path is what runs
    prompt = torch.randint(0, 256, (45,), generator=torch.Generator().manual_seed(0))
    ref = reference_greedy(target, prompt, 16)
    engine = SpeculativeEngine(target, random_drafter(target))
    for method in ("longspec", "ar"):
        for static in (False, True):
            config = GenerationConfig(max_new_tokens=16, prefill_chunk=16, static_shapes=static)
            assert engine.generate(prompt, config, method=method).tokens == ref, (method, static)


LONGROPE = longrope_overrides()


def test_a_dynamic_ntk_rope_is_exact_within_its_range_and_refused_past_it():
    """HF recomputes dynamic-NTK frequencies past max_position_embeddings, continuously (the logits then differ
    by ~1e-3 in fp32): within the range fixed frequencies are exact, past it the engine refuses."""
    rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}
    target = TargetModel(make_tiny_hf_model("llama", max_position_embeddings=32, rope_parameters=rope))
    assert exact_positions(target.config) == 32
    ids = torch.randint(0, 256, (1, 45), generator=torch.Generator().manual_seed(0))
    assert torch.allclose(
        target.model(ids[:, :32]).logits, target.logits(target(ids[:, :32]).hidden), atol=1e-5
    )
    assert not torch.allclose(target.model(ids).logits, target.logits(target(ids).hidden), atol=1e-4)
    engine = SpeculativeEngine(target, random_drafter(target))
    prompt = ids[0, :20]
    assert engine.generate(prompt, GenerationConfig(max_new_tokens=12)).tokens == reference_greedy(
        target, prompt, 12
    )
    with pytest.raises(ValueError, match="must stay within 32"):
        engine.generate(prompt, GenerationConfig(max_new_tokens=13))


def _hf_generate(target, prompt, tokens):
    """HF's own greedy generation with its cache: a longrope model picks its factors per forward there."""
    out = target.model.generate(prompt[None], max_new_tokens=tokens, do_sample=False, pad_token_id=0)
    return out[0, prompt.numel() :].tolist()


def test_longrope_uses_the_factors_hf_uses_and_refuses_a_crossing():
    """LongRoPE (Phi-3): HF's forward takes the long factors iff it reaches past the original context (32 here).
    A plain forward follows that rule (logits equal HF's on either side); the engine fixes one set per call
    (and releases it after):
    prompts within the context decode with the short factors, longer ones (HF's prefill already long) with the
    long ones, both equal to HF's own generation; a sequence that would cross it is refused."""
    target = TargetModel(make_tiny_hf_model("llama", **LONGROPE))
    assert exact_positions(target.config) is None and target.rotary.original_positions == 32
    ids = torch.randint(0, 256, (1, 45), generator=torch.Generator().manual_seed(0))
    for n in (20, 32, 33, 45):
        torch.testing.assert_close(target.logits(target(ids[:, :n]).hidden), target.model(ids[:, :n]).logits)
    engine = SpeculativeEngine(target, random_drafter(target))
    for prompt, tokens in ((ids[0, :20], 12), (ids[0, :40], 16)):
        for static in (False, True):
            config = GenerationConfig(max_new_tokens=tokens, prefill_chunk=16, static_shapes=static)
            assert engine.generate(prompt, config).tokens == _hf_generate(target, prompt, tokens), (
                len(prompt),
                static,
            )
    # The call's set ends with the call: a plain forward afterwards follows HF's rule again (short factors here;
    # left on the long call's set, these logits were off)
    assert engine.drafter.rotary.long is target.rotary.long is None
    torch.testing.assert_close(target.logits(target(ids[:, :20]).hidden), target.model(ids[:, :20]).logits)
    with pytest.raises(ValueError, match="switches to its long factors past 32"):
        engine.generate(ids[0, :20], GenerationConfig(max_new_tokens=13))
    with pytest.raises(ValueError, match="switches to its long factors past 32"):  # rows on both sides
        engine.generate_batch([ids[0, :20], ids[0, :40]], GenerationConfig(max_new_tokens=4))
    # a batch of prompts past the context (ragged, static shapes): each row HF's own generation
    prompts = [ids[0, :n] for n in (33, 45, 38)]
    config = GenerationConfig(max_new_tokens=10, prefill_chunk=16, static_shapes=True, tree_widths=(2, 2))
    for result, prompt in zip(engine.generate_batch(prompts, config), prompts, strict=True):
        assert result.tokens == _hf_generate(target, prompt, 10)


@pytest.mark.parametrize("family", ["mixtral", "qwen3-moe"])
def test_a_mixture_of_experts_target_runs_static_but_refuses_cuda_graphs(family):
    """HF's expert blocks pick their experts with host-side indexing (nonzero, a Python loop): static shapes
    run them as they are; a CUDA graph could not capture them, and asking for one is one clear error."""
    from longspec.testing import make_tiny_target

    target = make_tiny_target(family)
    assert target.sparse_layers == ([0, 1] if family == "mixtral" else [0])  # qwen3-moe: layer 1 is dense
    engine = SpeculativeEngine(target, random_drafter(target))
    prompt = torch.randint(0, 256, (30,), generator=torch.Generator().manual_seed(0))
    ref = reference_greedy(target, prompt, 12)
    assert engine.generate(prompt, GenerationConfig(max_new_tokens=12, static_shapes=True)).tokens == ref
    with pytest.raises(ValueError, match="mixture-of-experts blocks"):
        engine.generate(prompt, GenerationConfig(max_new_tokens=12, cuda_graphs=True))
