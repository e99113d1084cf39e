"""TargetModel parity with the HF models it wraps (fp32, tiny random configs of every supported family)."""

import json

import pytest
import torch
from transformers import AutoConfig

from longspec.modules.attention import math_attention, visibility_mask
from longspec.positions import anchor_offset_position_ids
from longspec.target import SUPPORTED_MODEL_TYPES, TargetModel
from longspec.testing import TINY_VARIANTS, make_tiny_hf_model, make_tiny_target, save_tiny_target

B, T = 2, 40  # T > the tiny Mistral window (16), so sliding-window masking is exercised


def _hf_reference(hf, ids, pos):
    # An explicit all-ones attention mask stops HF from reading non-contiguous position ids as packed sequences.
    return hf(input_ids=ids, position_ids=pos, attention_mask=torch.ones_like(ids), use_cache=True)


@pytest.fixture(scope="module")
def anchor_ids():
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 300, (B, T), generator=gen)
    pos = anchor_offset_position_ids(B, T, max_len=3000, generator=gen)
    assert (pos[:, 4:] > 4).any(), "the offset should make the ids non-contiguous"
    return ids, pos


@pytest.mark.parametrize("packed", [False, True], ids=["modules", "packed"])
@pytest.mark.parametrize("variant", TINY_VARIANTS)
def test_logits_and_last_kv_match_hf(variant, packed, anchor_ids):
    ids, pos = anchor_ids
    hf = make_tiny_hf_model(variant)
    ref = _hf_reference(hf, ids, pos)  # before packing: the HF model as loaded
    target = TargetModel(hf)
    if packed:
        assert target.pack_weights()
    out = target(ids, pos)
    torch.testing.assert_close(target.logits(out.hidden), ref.logits, atol=1e-5, rtol=1e-5)
    # A sliding-window cache layer keeps only its last window-1 tokens: compare those.
    cache = ref.cache if hasattr(ref, "cache") else ref.past_key_values  # renamed in transformers 5.2x
    ref_k, ref_v = cache.layers[-1].keys, cache.layers[-1].values
    n = ref_k.shape[2]
    assert out.last_k.shape == (B, target.num_kv_heads, T, target.head_dim)
    torch.testing.assert_close(out.last_k[:, :, T - n :], ref_k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.last_v[:, :, T - n :], ref_v, atol=1e-5, rtol=1e-5)


def test_mistral_window_is_applied(anchor_ids):
    ids, pos = anchor_ids
    target = make_tiny_target("mistral")
    assert target.layer_windows == [15, 15]  # HF window 16 = the token + 15 previous
    windowed = target(ids, pos).hidden
    target.layer_windows = [None, None]
    full = target(ids, pos).hidden
    # no token yet has anything outside the window (the two run different kernels: the windowed layers the math
    # path, the full ones the CPU flash kernel, so equal up to float32 rounding)
    torch.testing.assert_close(windowed[:, :16], full[:, :16])
    assert not torch.allclose(windowed[:, 16:], full[:, 16:])


def test_qwen2_per_layer_sliding_window_matches_hf(anchor_ids):
    ids, pos = anchor_ids
    # Qwen2 slides only in layers >= max_window_layers.
    hf = make_tiny_hf_model("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=1)
    target = TargetModel(hf)
    assert target.layer_windows == [None, 7]
    torch.testing.assert_close(
        target.logits(target(ids, pos).hidden), _hf_reference(hf, ids, pos).logits, atol=1e-5, rtol=1e-5
    )


def test_default_positions_are_arange():
    target = make_tiny_target("llama")
    ids = torch.randint(0, 300, (B, 9))
    a = target(ids)
    b = target(ids, torch.arange(9).expand(B, 9))
    assert torch.equal(a.hidden, b.hidden) and torch.equal(a.last_k, b.last_k)


@pytest.mark.parametrize("variant", ["llama", "mistral"])
def test_attn_fn_math_gives_same_result(variant, anchor_ids):
    ids, pos = anchor_ids
    target = make_tiny_target(variant)
    seen = []

    def attn_fn(layer_idx, q, k, v):
        seen.append((layer_idx, q.shape, k.shape))
        window = target.layer_windows[layer_idx]
        mask = visibility_mask(q.shape[2], k.shape[2], causal=True, window=window)
        return math_attention(q, k, v, mask)[0]

    ref = target(ids, pos)
    out = target(ids, pos, attn_fn=attn_fn)
    torch.testing.assert_close(out.hidden, ref.hidden, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out.last_k, ref.last_k)
    H, Hkv, D = target.num_heads, target.num_kv_heads, target.head_dim
    assert seen == [(i, (B, H, T, D), (B, Hkv, T, D)) for i in range(target.num_layers)]


def test_attn_fn_output_is_used():
    target = make_tiny_target("llama")
    ids = torch.randint(0, 300, (1, 7))
    zero = target(ids, attn_fn=lambda i, q, k, v: torch.zeros_like(q))
    assert not torch.allclose(zero.hidden, target(ids).hidden)


def test_frozen_and_no_grad():
    target = make_tiny_target("qwen2")
    target.train()  # a frozen target stays in eval mode whatever its parent asks
    assert not target.training and not target.model.training
    assert all(not p.requires_grad for p in target.parameters())
    out = target(torch.randint(0, 300, (1, 5)))
    assert out.hidden.grad_fn is None and out.last_k.grad_fn is None


def test_attributes_and_shared_modules():
    target = make_tiny_target("qwen2-tied")
    cfg = target.config
    assert (target.family, target.num_layers, target.hidden_size) == ("qwen2", 2, 64)
    assert (target.num_heads, target.num_kv_heads, target.head_dim, target.vocab_size) == (4, 2, 16, 300)
    assert target.embed_tokens is target.model.model.embed_tokens
    assert target.lm_head.weight.data_ptr() == target.embed_tokens.weight.data_ptr()  # tied
    assert cfg.tie_word_embeddings
    untied = make_tiny_target("qwen2")
    assert untied.lm_head.weight.data_ptr() != untied.embed_tokens.weight.data_ptr()
    assert untied.model.model.layers[0].self_attn.q_proj.bias is not None  # Qwen2 q/k/v bias
    assert make_tiny_target("mistral").sliding_window == 16


def test_from_pretrained_local_dir(tmp_path):
    path = save_tiny_target("llama3", tmp_path / "t")
    loaded = TargetModel.from_pretrained(path)
    ref = make_tiny_target("llama3")
    ids = torch.randint(0, 300, (1, 11))
    assert torch.equal(loaded(ids).hidden, ref(ids).hidden)
    assert all(not p.requires_grad for p in loaded.parameters())
    bf16 = TargetModel.from_pretrained(path, dtype="bfloat16", device="cpu")
    assert bf16.embed_tokens.weight.dtype == torch.bfloat16
    assert bf16(ids).hidden.dtype == torch.bfloat16


def test_from_pretrained_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        TargetModel.from_pretrained(tmp_path / "missing")
    path = save_tiny_target("llama", tmp_path / "llama")
    with pytest.raises(ValueError, match="unknown dtype 'bf16'"):
        TargetModel.from_pretrained(path, dtype="bf16")
    AutoConfig.for_model("gpt2", n_layer=1, n_embd=8, n_head=2).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(ValueError, match="unsupported target model_type 'gpt2'") as err:
        TargetModel.from_pretrained(tmp_path / "gpt2")
    for model_type in SUPPORTED_MODEL_TYPES:
        assert model_type in str(err.value)
    # A model_type transformers does not know either was its "does not recognize this architecture", with no
    # word of what longspec supports.
    config = json.loads((tmp_path / "llama" / "config.json").read_text())
    (tmp_path / "foo").mkdir()
    (tmp_path / "foo" / "config.json").write_text(json.dumps({**config, "model_type": "foo_bar"}))
    with pytest.raises(ValueError, match="unsupported target model_type 'foo_bar'; longspec supports: llama"):
        TargetModel.from_pretrained(tmp_path / "foo")


def test_wrapping_unsupported_model_raises():
    from transformers import AutoModelForCausalLM

    gpt2 = AutoModelForCausalLM.from_config(
        AutoConfig.for_model("gpt2", n_layer=1, n_embd=8, n_head=2, vocab_size=10)
    )
    with pytest.raises(ValueError, match="supports: llama, qwen2, mistral, qwen3"):
        TargetModel(gpt2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", TINY_VARIANTS)
def test_packed_forward_is_the_module_forward(variant, dtype, anchor_ids):
    # Off CUDA the fused steps are the references with the HF arithmetic: bit-identical, in bf16 too.
    ids, pos = anchor_ids
    target = make_tiny_target(variant).to(dtype)
    before = target(ids, pos)
    assert target.pack_weights() and target.pack_weights()  # idempotent
    after = target(ids, pos)
    for name in ("hidden", "last_k", "last_v"):
        assert torch.equal(getattr(before, name), getattr(after, name)), name


def test_packing_shares_storage_and_keeps_the_hf_model_working(anchor_ids):
    ids, pos = anchor_ids
    target = make_tiny_target("qwen2")  # q/k/v biases
    hf_before = target.model(ids, position_ids=pos).logits
    params_before = sum(p.numel() for p in target.parameters())
    target.pack_weights()
    attn, mlp, packed = target.layers[0].self_attn, target.layers[0].mlp, target.packed[0]
    assert attn.k_proj.weight.untyped_storage().data_ptr() == packed.qkv_weight.untyped_storage().data_ptr()
    assert attn.v_proj.bias.untyped_storage().data_ptr() == packed.qkv_bias.untyped_storage().data_ptr()
    assert (
        mlp.up_proj.weight.untyped_storage().data_ptr() == packed.gate_up_weight.untyped_storage().data_ptr()
    )
    assert sum(p.numel() for p in target.parameters()) == params_before
    assert not any(name.startswith("packed") for name in target.state_dict())  # checkpoints keep HF names
    torch.testing.assert_close(target.model(ids, position_ids=pos).logits, hf_before, atol=0, rtol=0)


def test_packing_refuses_trainable_weights():
    target = make_tiny_target("llama")
    target.layers[0].mlp.up_proj.weight.requires_grad_(True)
    assert target.pack_weights() is False and target.packed is None


def test_from_pretrained_refuses_a_bad_dtype_or_device_naming_the_argument(tmp_path):
    # These reached transformers' loader and failed deep inside it: device="cuda" on a machine without CUDA as
    # an AssertionError, an integer dtype / a non-string as its own ValueError, a malformed device as RuntimeError.
    path = save_tiny_target("llama", tmp_path / "t")
    with pytest.raises(ValueError, match="dtype torch.int8 is not a floating-point dtype"):
        TargetModel.from_pretrained(path, dtype="int8")
    with pytest.raises(TypeError, match="dtype must be a torch.dtype or its name"):
        TargetModel.from_pretrained(path, dtype=5)
    with pytest.raises(ValueError, match="device 'bogus' is not a device"):
        TargetModel.from_pretrained(path, device="bogus")
    if not torch.cuda.is_available():
        for device in ("cuda", "cuda:0", torch.device("cuda")):
            with pytest.raises(ValueError, match="device .*cuda.*use device='cpu'"):
                TargetModel.from_pretrained(path, device=device)
    half = TargetModel.from_pretrained(path, dtype="float16", device=torch.device("cpu"))
    assert half.embed_tokens.weight.dtype == torch.float16
    assert half.embed_tokens.weight.device.type == "cpu"


def test_from_pretrained_local_directory_mistakes_name_the_file(tmp_path):
    # A file for the directory was "directory ... does not exist"; no config.json transformers' "Unrecognized model
    # ... Should have a `model_type` key"; a damaged .safetensors a SafetensorError naming no file; no tokenizer
    # files "Couldn't instantiate the backend tokenizer".
    from longspec.target_source import load_tokenizer

    path = save_tiny_target("llama", tmp_path / "t")
    with pytest.raises(FileNotFoundError, match="is a file, not a model directory"):
        TargetModel.from_pretrained(tmp_path / "t" / "config.json")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="empty/config.json not found"):
        TargetModel.from_pretrained(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="holds no tokenizer"):
        load_tokenizer(tmp_path / "empty")
    weights = tmp_path / "t" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-64])
    with pytest.raises(ValueError, match="cannot read the weights of .*/t'.*truncated or damaged"):
        TargetModel.from_pretrained(path)


def test_sharded_and_pickled_checkpoints(tmp_path):
    # Sharded safetensors (model.safetensors.index.json) load; a folder of pytorch_model.bin alone is refused
    # before anything unpickles it (safetensors or GGUF only), with how to convert it.
    hf = make_tiny_hf_model("llama")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    sharded = TargetModel.from_pretrained(tmp_path / "sharded", dtype="bfloat16")
    assert torch.equal(sharded.embed_tokens.weight, hf.get_input_embeddings().weight.bfloat16())

    hf.config.save_pretrained(tmp_path / "bin")
    marker = tmp_path / "ran"

    class RunsCode:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    torch.save({"model.embed_tokens.weight": RunsCode()}, tmp_path / "bin" / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"only pickle weights .*safe_serialization=True"):
        TargetModel.from_pretrained(tmp_path / "bin")
    assert not marker.exists()


def test_hub_id_not_in_the_cache_is_one_error_naming_it():
    # Offline (tests set HF_HUB_OFFLINE=1), transformers' error named neither the id nor what was loaded.
    from longspec.target_source import load_tokenizer

    hub_id = "longspec-tests/no-such-model"
    with pytest.raises(FileNotFoundError, match=f"cannot load the config of '{hub_id}'"):
        TargetModel.from_pretrained(hub_id)
    with pytest.raises(FileNotFoundError, match=f"cannot load the tokenizer of '{hub_id}'"):
        load_tokenizer(hub_id)
