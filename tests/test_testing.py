"""The tiny model / tokenizer factories everyone's tests use."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from longspec.testing import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    TINY_VARIANTS,
    build_byte_tokenizer,
    make_tiny_hf_model,
    save_tiny_target,
    tiny_hf_config,
)

EXPECTED_CLASS = {
    "llama": "LlamaForCausalLM",
    "llama-linear": "LlamaForCausalLM",
    "llama3": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen2-tied": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "phi3-longrope": "Phi3ForCausalLM",
    "phi4-mini": "Phi3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2-moe": "Qwen2MoeForCausalLM",
    "qwen3-moe": "Qwen3MoeForCausalLM",
}


@pytest.mark.parametrize("variant", TINY_VARIANTS)
def test_variant_shapes(variant):
    model = make_tiny_hf_model(variant)
    cfg = model.config
    assert type(model).__name__ == EXPECTED_CLASS[variant]
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.num_hidden_layers) == (
        64,
        4,
        2,
        2,
    )
    assert cfg.vocab_size == 300 and cfg.head_dim == 16
    assert next(model.parameters()).dtype == torch.float32 and not model.training


def test_variant_features():
    assert tiny_hf_config("llama-linear").rope_parameters["rope_type"] == "linear"
    assert tiny_hf_config("llama3").rope_parameters["rope_type"] == "llama3"
    assert tiny_hf_config("mistral").sliding_window == 16
    assert (
        tiny_hf_config("qwen2-tied").tie_word_embeddings and not tiny_hf_config("qwen2").tie_word_embeddings
    )
    assert hasattr(make_tiny_hf_model("qwen3").model.layers[0].self_attn, "q_norm")
    moe = make_tiny_hf_model("qwen3-moe").model.layers  # a sparse layer, then a dense one (mlp_only_layers)
    assert not hasattr(moe[0].mlp, "gate_proj") and hasattr(moe[1].mlp, "gate_proj")
    assert tiny_hf_config("llama", num_hidden_layers=3).num_hidden_layers == 3  # overrides apply
    with pytest.raises(ValueError, match="unknown tiny variant"):
        tiny_hf_config("gpt2")


def test_seeded_weights():
    a, b, c = make_tiny_hf_model("llama"), make_tiny_hf_model("llama"), make_tiny_hf_model("llama", seed=1)
    wa, wb, wc = (m.model.layers[0].self_attn.q_proj.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)


def test_byte_tokenizer_round_trip_and_specials():
    tok = build_byte_tokenizer()
    text = "héllo wörld 🙂\n\ttabs"
    ids = tok(text).input_ids
    assert ids[0] == BOS_ID and ids[1:] == list(text.encode("utf-8"))
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (BOS_ID, EOS_ID, PAD_ID)
    assert len(tok) == 259


def test_byte_tokenizer_chat_template():
    tok = build_byte_tokenizer()
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    text = tok.apply_chat_template(messages, tokenize=False)
    assert text == "<|bos|>### user:\nhi\n### assistant:\nyo\n<|eos|>"
    prompt = tok.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("### assistant:\n")


def test_save_tiny_target_is_loadable(tmp_path):
    path = save_tiny_target("qwen3", tmp_path / "m")
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert torch.equal(model.lm_head.weight, make_tiny_hf_model("qwen3").lm_head.weight)
    assert tok("ab").input_ids == [BOS_ID, 97, 98]
