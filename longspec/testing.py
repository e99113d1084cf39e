"""Tiny random targets and a byte-level tokenizer, built in code, for everyone's CPU tests.

Nothing here downloads anything: configs are tiny HF configs of each supported family, weights are random
(seeded), and the tokenizer is a fixed byte-level vocabulary (256 bytes + 3 specials) assembled with HF `tokenizers`.
"""

from __future__ import annotations

import os
from typing import Any

import torch

__all__ = [
    "FAMILY_VARIANTS",
    "TINY_VARIANTS",
    "longrope_overrides",
    "TINY_VOCAB_SIZE",
    "BOS_TOKEN",
    "EOS_TOKEN",
    "PAD_TOKEN",
    "tiny_hf_config",
    "make_tiny_hf_model",
    "make_tiny_target",
    "save_tiny_target",
    "build_byte_tokenizer",
    "build_tiny_bpe_tokenizer",
    "save_tiny_gguf",
]

TINY_VOCAB_SIZE = 300  # > 256 bytes + 3 specials; not a power of two, so chunked losses see ragged edges
BOS_TOKEN, EOS_TOKEN, PAD_TOKEN = "<|bos|>", "<|eos|>", "<|pad|>"
BOS_ID, EOS_ID, PAD_ID = 256, 257, 258

_COMMON = dict(
    vocab_size=TINY_VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
    pad_token_id=PAD_ID,
)


def longrope_overrides(partial_rotary_factor: float = 1.0, **overrides) -> dict:
    """Config overrides of a tiny LongRoPE model (head_dim 16): context 128 with an original context of 32, so a
    test crosses it; short factors 1, long factors 4, over the rotated dims (all 16, or the partial share)."""
    half = int(16 * partial_rotary_factor) // 2
    rope = {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * half, "long_factor": [4.0] * half,
            "original_max_position_embeddings": 32}  # fmt: skip
    if partial_rotary_factor != 1.0:
        rope["partial_rotary_factor"] = partial_rotary_factor
    return dict(
        max_position_embeddings=128, original_max_position_embeddings=32, rope_parameters=rope, **overrides
    )


# variant name -> (HF model_type, config kwargs). Each variant exercises one thing the adapter must get right.
_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", dict(tie_word_embeddings=False)),
    # Vicuna / LongChat style linear position interpolation.
    "llama-linear": (
        "llama",
        dict(rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}),
    ),
    # Llama-3.x frequency-dependent scaling; original length small so every band is exercised at tiny positions.
    "llama3": (
        "llama",
        dict(
            rope_parameters={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
                "rope_theta": 500000.0,
            }
        ),
    ),
    # Qwen2 always has q/k/v bias.
    "qwen2": (
        "qwen2",
        dict(tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    ),
    "qwen2-tied": ("qwen2", dict(tie_word_embeddings=True)),
    # Small window so tests with a few dozen tokens exceed it.
    "mistral": ("mistral", dict(sliding_window=16, tie_word_embeddings=False)),
    # q/k RMSNorm over the head dim.
    "qwen3": ("qwen3", dict(tie_word_embeddings=False)),
    # Mixture-of-experts MLPs (2 of 4 experts per token); Mixtral with Mistral's window.
    "mixtral": (
        "mixtral",
        dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=16, tie_word_embeddings=False),
    ),
    # Phi-3: fused qkv_proj and gate_up_proj, a sliding window on every layer.
    "phi3": ("phi3", dict(sliding_window=16, tie_word_embeddings=False)),
    # Phi-3.5 / Phi-3-128K: LongRoPE, an original context of 32 so tests cross it.
    "phi3-longrope": ("phi3", longrope_overrides(tie_word_embeddings=False)),
    # Phi-4-mini: Phi-3's layout with a partial rope (3/4 of each head rotates) and LongRoPE over those dims.
    "phi4-mini": ("phi3", longrope_overrides(0.75, tie_word_embeddings=True)),
    # Qwen2-MoE: q/k/v biases, routed experts plus a gated shared expert.
    "qwen2-moe": (
        "qwen2_moe",
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            tie_word_embeddings=False,
        ),
    ),  # fmt: skip
    # Qwen3-MoE with one dense layer (mlp_only_layers) beside a sparse one, as the family allows.
    "qwen3-moe": (
        "qwen3_moe",
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            mlp_only_layers=[1],
            decoder_sparse_step=1,
            tie_word_embeddings=False,
        ),
    ),  # fmt: skip
}
TINY_VARIANTS: tuple[str, ...] = tuple(_VARIANTS)
# One variant per decoder layout the engine must get right (the rope-scaling variants of Llama / Qwen2 aside):
# what the engine- and policy-level lossless tests run on.
FAMILY_VARIANTS: tuple[str, ...] = (
    "llama", "qwen2", "mistral", "qwen3", "phi3", "phi3-longrope", "phi4-mini", "mixtral", "qwen2-moe", "qwen3-moe",
)  # fmt: skip


def tiny_hf_config(family: str, **overrides):
    """A tiny HF config (hidden 64, 4 q heads / 2 kv heads, head_dim 16, 2 layers, vocab 300) of one variant:
    llama | llama-linear | llama3 | qwen2 | qwen2-tied | mistral | qwen3 | phi3 | phi3-longrope | phi4-mini | mixtral |
    qwen2-moe | qwen3-moe."""
    from transformers import AutoConfig

    if family not in _VARIANTS:
        raise ValueError(f"unknown tiny variant {family!r}; choose one of {', '.join(TINY_VARIANTS)}")
    model_type, kwargs = _VARIANTS[family]
    kwargs = {**_COMMON, **kwargs, **overrides}
    return AutoConfig.for_model(model_type, **kwargs)


def make_tiny_hf_model(family: str, *, seed: int = 0, **overrides):
    """A random-init fp32 HF causal LM of the variant, in eval mode. Seeded: same seed, same weights."""
    from transformers import AutoModelForCausalLM

    config = tiny_hf_config(family, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.eval()


def make_tiny_target(family: str, *, seed: int = 0, **overrides):
    """A `TargetModel` around a tiny random HF model of the variant."""
    from longspec.target import TargetModel

    return TargetModel(make_tiny_hf_model(family, seed=seed, **overrides))


def save_tiny_target(family: str, out_dir: str | os.PathLike, *, seed: int = 0, **overrides) -> str:
    """Save a tiny HF model + the byte tokenizer to `out_dir` (loadable by `TargetModel.from_pretrained`)."""
    out_dir = os.fspath(out_dir)
    model = make_tiny_hf_model(family, seed=seed, **overrides)
    model.save_pretrained(out_dir)
    build_byte_tokenizer().save_pretrained(out_dir)
    return out_dir


_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '### ' + message['role'] + ':\n' + message['content'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '### assistant:\n' }}{% endif %}"
)


def build_byte_tokenizer():
    """Deterministic byte-level `PreTrainedTokenizerFast`: id b (0..255) is byte b, then <|bos|>=256,
    <|eos|>=257, <|pad|>=258. Encoding prepends <|bos|>; decoding is lossless for any UTF-8 text.
    Has a simple chat template ("### role:\\ncontent\\n", eos after assistant turns)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    # GPT-2's byte -> printable-unicode map, which the ByteLevel pre-tokenizer/decoder use.
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    byte_to_char, extra = {}, 0
    for b in range(256):
        if b in printable:
            byte_to_char[b] = chr(b)
        else:
            byte_to_char[b] = chr(256 + extra)
            extra += 1
    vocab = {byte_to_char[b]: b for b in range(256)}
    vocab.update({BOS_TOKEN: BOS_ID, EOS_TOKEN: EOS_ID, PAD_TOKEN: PAD_ID})

    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([BOS_TOKEN, EOS_TOKEN, PAD_TOKEN])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B", special_tokens=[(BOS_TOKEN, BOS_ID)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        chat_template=_CHAT_TEMPLATE,
        model_max_length=1 << 20,
    )


# 40 byte-level BPE merges (GPT-2's alphabet, "Ġ" = space): with the 256 bytes and 4 specials, 300 tokens, the tiny
# configs' vocab. Each merge joins two tokens that exist by then, so the list is a valid merge table.
_TINY_MERGES = (
    "h e",
    "i n",
    "e r",
    "a n",
    "r e",
    "o n",
    "Ġ t",
    "Ġt he",
    "Ġ a",
    "e n",
    "a t",
    "o r",
    "e s",
    "Ġ s",
    "Ġ w",
    "i s",
    "i t",
    "Ġ c",
    "Ġ f",
    "e d",
    "a r",
    "Ġ p",
    "a l",
    "i c",
    "Ġ m",
    "l e",
    "Ġ in",
    "o u",
    "Ġ d",
    "s t",
    "Ġ (",
    "d e",
    "r o",
    "Ġ =",
    "Ġ re",
    "Ġt o",
    "Ġ an",
    "s e",
    "l f",
    "se lf",
)
# transformers' GGUF byte-level tokenizer adds <|endoftext|> when the vocabulary lacks it (GPT-2's default
# special token), which would make it one token longer than the model's embedding: the tiny vocabulary has it.
_ENDOFTEXT, _ENDOFTEXT_ID = "<|endoftext|>", 299


def build_tiny_bpe_tokenizer():
    """A byte-level BPE `PreTrainedTokenizerFast` with real merges (GPT-2 style), 300 tokens: bytes 0..255 as in
    `build_byte_tokenizer`, <|bos|>=256, <|eos|>=257, <|pad|>=258, the 40 merged tokens, <|endoftext|>=299. What a GGUF of a
    tiny target carries (`save_tiny_gguf`), so merges and pre-tokenizer metadata are exercised."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = dict(build_byte_tokenizer().get_vocab())
    merges = [tuple(m.split(" ")) for m in _TINY_MERGES]
    for left, right in merges:
        assert left in vocab and right in vocab, (left, right)
        vocab[left + right] = len(vocab)
    vocab[_ENDOFTEXT] = _ENDOFTEXT_ID
    assert len(vocab) == TINY_VOCAB_SIZE
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [AddedToken(t, normalized=False, special=True) for t in (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, _ENDOFTEXT)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=PAD_TOKEN,  # what the GGUF states (tokenizer.ggml.unknown_token_id), so both load alike
        chat_template=_CHAT_TEMPLATE,
        model_max_length=1 << 20,
    )


def save_tiny_gguf(
    family: str, path: str | os.PathLike, *, seed: int = 0, dtype: str = "float32", **overrides
):
    """Write a tiny random HF model of `family` (llama | qwen2 | qwen2-tied | mistral | qwen3) and the tiny BPE
    tokenizer as one GGUF file, the way llama.cpp's converter lays it out; returns the HF model it came from.

    Weights are F32 or F16 (`dtype`; norms and biases stay F32, as llama.cpp writes them). Tensor names come from
    gguf-py's own HF -> GGUF name map (the map transformers' loader inverts); Llama's q/k rows are permuted into
    llama.cpp's rotary layout, which the loader undoes. A Mistral file is a "llama" file whose name says mistral
    (that is how transformers tells them apart)."""
    import gguf
    import numpy as np

    model = make_tiny_hf_model(family, seed=seed, **overrides)
    config = model.config
    arch = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}[config.model_type]
    tokenizer = build_tiny_bpe_tokenizer()
    writer = gguf.GGUFWriter(os.fspath(path), arch)
    writer.add_name(f"tiny-{config.model_type}")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_key_length(config.head_dim)  # llama.cpp writes both when the config states a head_dim
    writer.add_value_length(config.head_dim)
    writer.add_vocab_size(config.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    tokens = [t for t, _ in sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])]
    writer.add_token_list(tokens)
    special = {BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, _ENDOFTEXT}
    writer.add_token_types(
        [gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens]
    )
    writer.add_token_merges(list(_TINY_MERGES))
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_pad_token_id(PAD_ID)
    writer.add_unk_token_id(PAD_ID)  # without one, transformers' GGUF tokenizer adds a 301st token as <unk>
    writer.add_add_bos_token(False)
    writer.add_chat_template(_CHAT_TEMPLATE)

    names = gguf.get_tensor_name_map(
        next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), config.num_hidden_layers
    )
    half = {"float32": np.float32, "float16": np.float16}[dtype]
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # a tied model has no output tensor: the loader ties it again
        base, suffix = hf_name.rsplit(".", 1)
        gguf_name = names.get_name(base)
        assert gguf_name is not None, hf_name
        data = tensor.float().numpy()
        if arch == "llama" and base.endswith(("q_proj", "k_proj")):
            heads = config.num_attention_heads if base.endswith("q_proj") else config.num_key_value_heads
            # llama.cpp's permute: HF's half-split rotary layout -> interleaved pairs
            data = (
                data.reshape(heads, 2, data.shape[0] // heads // 2, *data.shape[1:])
                .swapaxes(1, 2)
                .reshape(data.shape)
            )
        writer.add_tensor(f"{gguf_name}.{suffix}", data.astype(half if data.ndim > 1 else np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model
