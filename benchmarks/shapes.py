"""Real models' shapes with random weights, for benchmarks: the cost of a forward does not depend on the weights,
so no download is needed. Imported by the benchmark scripts beside it (their directory is on sys.path) and by the
tests that check those shapes.
"""

from __future__ import annotations

import torch

__all__ = ["SHAPES", "llama31_8b_config", "qwen25_coder_05b_config", "random_target", "smollm2_135m_config"]


def llama31_8b_config(attn_implementation: str | None = None):
    """Llama-3.1-8B's config (meta-llama/Llama-3.1-8B config.json) for benchmarks with random weights: the cost
    of a forward does not depend on the weights, so no 16 GB download is needed."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_theta": 500000.0,
        },
    )
    if attn_implementation is not None:
        config._attn_implementation = attn_implementation
    return config


def smollm2_135m_config(attn_implementation: str | None = None):
    """SmolLM2-135M-Instruct's architecture (Llama: 30 layers, width 576, 9 query / 3 key-value heads, tied
    embeddings, rope theta 1e5) for benchmarks with random weights at its shape."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
    )
    if attn_implementation is not None:
        config._attn_implementation = attn_implementation
    return config


def qwen25_coder_05b_config(attn_implementation: str | None = None):
    """Qwen2.5-Coder-0.5B-Instruct's architecture (Qwen2: 24 layers, width 896, 14 query / 2 key-value heads, q/k/v
    biases, tied embeddings, a 151,936-token vocabulary, rope theta 1e6, 32K context) with random weights."""
    from transformers import Qwen2Config

    config = Qwen2Config(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    )
    if attn_implementation is not None:
        config._attn_implementation = attn_implementation
    return config


# --shape name -> config builder, for every script that takes one
SHAPES = {
    "8b": llama31_8b_config,
    "smollm2": smollm2_135m_config,
    "qwen25_coder_05b": qwen25_coder_05b_config,
}


def random_target(hf_config, device: torch.device | str, dtype: torch.dtype):
    """A TargetModel of `hf_config` built on the meta device (no host copy of the weights), materialised on
    `device` and filled with seeded random values (RMSNorm weights 1, matrices N(0, 0.02))."""
    from transformers import AutoModelForCausalLM

    from longspec.target import TargetModel

    device = torch.device(device)
    with torch.device("meta"):
        hf_model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    hf_model.to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for param in hf_model.parameters():
            if param.dim() == 1:
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=generator)
        # to_empty left the HF rotary buffers uninitialised: rebuild them (the HF baselines use them; the
        # adapter computes its own tables).
        rotary = hf_model.model.rotary_emb
        hf_model.model.rotary_emb = type(rotary)(config=hf_config).to(device)
    # .to(device) also moves the adapter's own rotary buffers, which CUDA-graph capture needs on the device.
    return TargetModel(hf_model.eval()).to(device)
