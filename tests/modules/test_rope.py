"""RotaryEmbedding vs the HF models' own rotary embedding, at large and non-contiguous positions."""

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from longspec.modules.rope import RotaryEmbedding, apply_rotary, rope_config
from longspec.testing import TINY_VARIANTS, make_tiny_hf_model

POSITIONS = torch.tensor([[0, 1, 2, 3, 16261, 16262, 30000, 40000], [5, 6, 7, 8, 9, 100, 2047, 4095]])

EXTRA_ROPES = {
    "yarn": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 1024,
        "rope_theta": 10000.0,
    },
    "dynamic": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
}


def _hf_models():
    for variant in TINY_VARIANTS:
        yield variant, make_tiny_hf_model(variant)
    for name, params in EXTRA_ROPES.items():
        yield name, make_tiny_hf_model("llama", rope_parameters=params)


@pytest.mark.parametrize("name, hf", list(_hf_models()), ids=lambda x: x if isinstance(x, str) else "")
def test_cos_sin_match_hf_rotary_emb(name, hf):
    rotary = RotaryEmbedding.from_config(hf.config)
    x = torch.zeros(1, dtype=torch.float32)
    # Dynamic NTK is static below max_position_embeddings (4096): HF rescales only past it, and we never do.
    positions = POSITIONS[1:] if name == "dynamic" else POSITIONS
    ref_cos, ref_sin = hf.model.rotary_emb(x, positions)
    cos, sin = rotary.cos_sin(positions)
    rotary_dim = int(16 * hf.config.rope_parameters.get("partial_rotary_factor", 1.0))  # phi4-mini: 12 of 16
    assert cos.shape == (positions.shape[0], 8, rotary_dim) == ref_cos.shape
    # Same formula, same fp32 ops: exact, even at position 40000.
    assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)


def test_yarn_attention_scaling_is_applied():
    hf = make_tiny_hf_model("llama", rope_parameters=EXTRA_ROPES["yarn"])
    rotary = RotaryEmbedding.from_config(hf.config)
    assert rotary.attention_scaling > 1.0
    cos, sin = rotary.cos_sin(torch.tensor([[0]]))
    torch.testing.assert_close(cos, torch.full_like(cos, rotary.attention_scaling))


def test_apply_rotary_matches_hf():
    rotary = RotaryEmbedding.from_config(make_tiny_hf_model("llama3").config)
    q, k = torch.randn(2, 4, 8, 16), torch.randn(2, 2, 8, 16)
    cos, sin = rotary.cos_sin(POSITIONS)
    ref_q, ref_k = apply_rotary_pos_emb(q, k, cos, sin)
    assert torch.equal(apply_rotary(q, cos, sin), ref_q) and torch.equal(apply_rotary(k, cos, sin), ref_k)


def test_scores_depend_only_on_relative_position():
    rotary = RotaryEmbedding.from_config(make_tiny_hf_model("llama").config)
    q, k = torch.randn(1, 1, 1, 16, dtype=torch.float64), torch.randn(1, 1, 1, 16, dtype=torch.float64)

    def score(pq, pk):
        cq, sq = rotary.cos_sin(torch.tensor([[pq]]), dtype=torch.float64)
        ck, sk = rotary.cos_sin(torch.tensor([[pk]]), dtype=torch.float64)
        return (apply_rotary(q, cq, sq) * apply_rotary(k, ck, sk)).sum()

    torch.testing.assert_close(score(10, 7), score(20010, 20007), atol=1e-4, rtol=1e-4)


def test_one_dim_positions_and_dtype():
    rotary = RotaryEmbedding.from_config(make_tiny_hf_model("qwen2").config)
    cos, sin = rotary.cos_sin(torch.arange(5), dtype=torch.bfloat16)
    assert cos.shape == (1, 5, 16) and cos.dtype == torch.bfloat16


def test_inv_freq_is_not_saved():
    rotary = RotaryEmbedding.from_config(make_tiny_hf_model("llama").config)
    assert rotary.state_dict() == {} and rotary.rotary_dim == 16


def test_rope_config_rebuilds_the_same_rotary():
    cfg = make_tiny_hf_model("llama3").config
    rebuilt = rope_config(
        rope_parameters=cfg.rope_parameters,
        head_dim=16,
        hidden_size=64,
        num_heads=4,
        max_position_embeddings=cfg.max_position_embeddings,
    )
    assert torch.equal(
        RotaryEmbedding.from_config(rebuilt).inv_freq, RotaryEmbedding.from_config(cfg).inv_freq
    )


def test_unknown_rope_type_raises():
    cfg = make_tiny_hf_model("llama").config
    cfg.rope_parameters = {"rope_type": "mystery", "rope_theta": 10000.0}
    with pytest.raises(ValueError, match="unknown rope_type 'mystery'"):
        RotaryEmbedding.from_config(cfg)
