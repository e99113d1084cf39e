"""Lossless on config variants of the supported families that real checkpoints use and the tiny variants of
`longspec.testing` do not: biases, a head dim other than hidden / heads, MQA and MHA, tied embeddings, YaRN and
dynamic rope, per-layer sliding windows (Qwen2/3's max_window_layers), Mistral without a window. Each decodes
with longspec and ar, eager and on static shapes, against the HF model's own greedy output."""

import pytest
import torch
from infer_helpers import random_drafter, reference_greedy

from longspec.infer.engine import GenerationConfig, SpeculativeEngine
from longspec.target import TargetModel
from longspec.testing import make_tiny_hf_model

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


LENGTH_DEPENDENT_ROPE = {
    # HF switches to the long factors past original_max_position_embeddings
    "longrope": dict(
        max_position_embeddings=128,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 1e4,
            "short_factor": [1.0] * 8,
            "long_factor": [4.0] * 8,
            "original_max_position_embeddings": 32,
        },
    ),  # fmt: skip
    # HF recomputes the frequencies past max_position_embeddings
    "dynamic": dict(
        max_position_embeddings=32, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}
    ),
}


@pytest.mark.parametrize("rope", LENGTH_DEPENDENT_ROPE)
def test_a_length_dependent_rope_is_exact_within_its_range_and_refused_past_it(rope):
    """Fixed frequencies equal HF's within the range (logits, and lossless decoding up to its end); past it HF
    changes them with the length (logits then differ by 1e-3 to 1e-2 in fp32), and the engine refuses."""
    target = TargetModel(make_tiny_hf_model("llama", **LENGTH_DEPENDENT_ROPE[rope]))
    assert target.rotary.exact_positions == 32
    ids = torch.randint(0, 256, (1, 45), generator=torch.Generator().manual_seed(0))
    within = ids[:, :32]
    assert torch.allclose(target.model(within).logits, target.logits(target(within).hidden), atol=1e-5)
    assert not torch.allclose(target.model(ids).logits, target.logits(target(ids).hidden), atol=1e-4)
    engine = SpeculativeEngine(target, random_drafter(target))
    prompt = ids[0, :20]
    assert engine.generate(prompt, GenerationConfig(max_new_tokens=12)).tokens == reference_greedy(
        target, prompt, 12
    )
    with pytest.raises(ValueError, match="must stay within 32"):
        engine.generate(prompt, GenerationConfig(max_new_tokens=13))


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
