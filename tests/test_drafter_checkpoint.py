"""Drafter save/load: block-only safetensors + config.json with a target fingerprint; mismatches refused."""

import json

import pytest
import torch
from safetensors.torch import load_file

from longspec.drafter import Drafter, DrafterConfig
from longspec.fingerprint import fingerprint_mismatches, target_fingerprint, tokenizer_hash
from longspec.testing import build_byte_tokenizer, make_tiny_target


def _drafter(target, tokenizer=None, window=8):
    config = DrafterConfig.from_target_config(target.config, window=window, tokenizer=tokenizer)
    return Drafter(config, target.embed_tokens, target.lm_head)


def test_round_trip(tmp_path):
    target = make_tiny_target("qwen2")
    drafter = _drafter(target)
    drafter.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    saved = load_file(tmp_path / "model.safetensors")
    assert set(saved) == set(drafter.state_dict())  # the block only: no embedding / LM head
    loaded = Drafter.from_pretrained(tmp_path, target)
    assert loaded.config == drafter.config
    assert loaded.shared_storage_ok(target)
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    ids = torch.randint(0, 300, (1, 12))
    pos = torch.arange(12)[None]
    out = target(ids, pos)
    with torch.no_grad():
        assert torch.equal(
            loaded(ids, pos, out.last_k, out.last_v, lag=1), drafter(ids, pos, out.last_k, out.last_v, lag=1)
        )


def test_config_json_holds_the_fingerprint(tmp_path):
    target = make_tiny_target("llama3")
    _drafter(target, tokenizer=build_byte_tokenizer()).save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    fp = data["target_fingerprint"]
    assert fp["model_type"] == "llama" and fp["vocab_size"] == 300 and fp["head_dim"] == 16
    assert (fp["hidden_size"], fp["num_attention_heads"], fp["num_key_value_heads"]) == (64, 4, 2)
    assert fp["rope_parameters"]["rope_type"] == "llama3" and fp["rope_parameters"]["factor"] == 8.0
    assert fp["tokenizer_sha256"] == tokenizer_hash(build_byte_tokenizer())
    assert data["window"] == 8


def test_mismatched_target_is_refused_naming_each_field(tmp_path):
    _drafter(make_tiny_target("llama")).save_pretrained(tmp_path)
    other = make_tiny_target(
        "llama", vocab_size=320, rope_parameters={"rope_type": "default", "rope_theta": 5e5}
    )
    with pytest.raises(ValueError) as err:
        Drafter.from_pretrained(tmp_path, other)
    message = str(err.value)
    assert "vocab_size: drafter was trained for 300, target has 320" in message
    assert "rope_parameters" in message
    assert "hidden_size" not in message  # only the differing fields are named


def test_other_family_is_refused(tmp_path):
    _drafter(make_tiny_target("llama")).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="model_type: drafter was trained for 'llama', target has 'mistral'"):
        Drafter.from_pretrained(tmp_path, make_tiny_target("mistral"))


def test_tokenizer_hash_is_checked(tmp_path):
    target = make_tiny_target("llama")
    tokenizer = build_byte_tokenizer()
    _drafter(target, tokenizer=tokenizer).save_pretrained(tmp_path)
    Drafter.from_pretrained(tmp_path, target, tokenizer=build_byte_tokenizer())  # same vocab: accepted
    Drafter.from_pretrained(tmp_path, target)  # no tokenizer given: not compared
    changed = build_byte_tokenizer()
    changed.add_special_tokens({"additional_special_tokens": ["<|tool|>"]})
    with pytest.raises(ValueError, match="tokenizer_sha256"):
        Drafter.from_pretrained(tmp_path, target, tokenizer=changed)


def test_tokenizer_hash_survives_save_and_load(tmp_path):
    from transformers import AutoTokenizer

    tokenizer = build_byte_tokenizer()
    tokenizer.save_pretrained(tmp_path)
    assert tokenizer_hash(AutoTokenizer.from_pretrained(tmp_path)) == tokenizer_hash(tokenizer)


def test_fingerprint_mismatches_ignores_fields_missing_on_one_side():
    cfg = make_tiny_target("llama").config
    with_tok = target_fingerprint(cfg, build_byte_tokenizer())
    assert fingerprint_mismatches(with_tok, target_fingerprint(cfg)) == []
    assert fingerprint_mismatches(target_fingerprint(cfg), target_fingerprint(cfg)) == []


def test_missing_files(tmp_path):
    target = make_tiny_target("llama")
    with pytest.raises(FileNotFoundError, match="config.json"):
        Drafter.from_pretrained(tmp_path, target)
    _drafter(target).save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        Drafter.from_pretrained(tmp_path, target)


def test_load_with_dtype(tmp_path):
    target = make_tiny_target("llama")
    _drafter(target).save_pretrained(tmp_path)
    loaded = Drafter.from_pretrained(tmp_path, target, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in loaded.parameters())
    assert loaded.embed_tokens.weight.dtype == torch.float32  # the target's modules are left alone


def test_load_arguments_are_checked_naming_each(tmp_path, monkeypatch):
    # dtype="bfloat16" (as TargetModel.from_pretrained takes it) was a TypeError from nn.Module.to, device="cuda"
    # without CUDA an AssertionError deep in torch, a path string as the target an AttributeError, "~" and a
    # path to config.json itself were "config.json not found".
    target = make_tiny_target("llama")
    _drafter(target).to(torch.bfloat16).save_pretrained(tmp_path / "d")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert next(Drafter.from_pretrained("~/d", target, dtype="float16").parameters()).dtype == torch.float16
    assert (
        next(Drafter.from_pretrained(tmp_path / "d", target, dtype="auto").parameters()).dtype
        == torch.bfloat16
    )
    with pytest.raises(ValueError, match="unknown dtype 'bogus'"):
        Drafter.from_pretrained(tmp_path / "d", target, dtype="bogus")
    with pytest.raises(ValueError, match="not a floating-point dtype"):
        Drafter.from_pretrained(tmp_path / "d", target, dtype=torch.int8)
    with pytest.raises(TypeError, match="target must be the loaded TargetModel"):
        Drafter.from_pretrained(tmp_path / "d", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="is a file: give the drafter's directory"):
        Drafter.from_pretrained(tmp_path / "d" / "config.json", target)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device 'cuda:0'.*use device='cpu'"):
            Drafter.from_pretrained(tmp_path / "d", target, device="cuda:0")
    else:  # the target is on the CPU: a drafter on the GPU could not use its embedding / LM head
        with pytest.raises(ValueError, match="the target's weights are on 'cpu'"):
            Drafter.from_pretrained(tmp_path / "d", target, device="cuda")


@pytest.mark.parametrize(
    "damage, match",
    [
        (lambda d: (d / "config.json").write_text("{not json"), "config.json is not valid JSON"),
        (lambda d: (d / "config.json").write_text("[1, 2]"), "config.json holds a JSON list"),
        (
            lambda d: _edit_config(d, hidden_size=None),
            "config.json is not a valid drafter config.*hidden_size",
        ),
        (lambda d: _edit_config(d, target_fingerprint=None), "config.json is not a valid drafter config"),
        (
            lambda d: _edit_config(d, intermediate_size=64),
            "model.safetensors does not hold the block.*size mismatch",
        ),
        (
            lambda d: (d / "model.safetensors").write_bytes(b"\0" * 40),
            "model.safetensors is not a readable safetensors",
        ),
        (lambda d: _truncate(d / "model.safetensors"), "model.safetensors is not a readable safetensors"),
    ],
    ids=["not-json", "json-list", "bad-field", "null-fingerprint", "shape-mismatch", "garbage", "truncated"],
)
def test_damaged_directory_is_one_value_error_naming_the_file(tmp_path, damage, match):
    # Each was a JSONDecodeError / TypeError / AttributeError / SafetensorError / RuntimeError naming no file.
    target = make_tiny_target("llama")
    _drafter(target).save_pretrained(tmp_path)
    damage(tmp_path)
    with pytest.raises(ValueError, match=match):
        Drafter.from_pretrained(tmp_path, target)


def _edit_config(directory, **changes):
    data = json.loads((directory / "config.json").read_text())
    data.update(changes)
    (directory / "config.json").write_text(json.dumps(data))


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])


def _vocab(vocab_size: int, size: int):
    from longspec.drafter.vocab import DraftVocab

    return DraftVocab(torch.randperm(vocab_size, generator=torch.Generator().manual_seed(1))[:size].sort().values,
                      vocab_size)  # fmt: skip


def test_a_draft_vocabulary_round_trips_with_the_drafter(tmp_path):
    """config.json names the map's size and hash; draft_vocab.safetensors holds it; the loaded drafter drafts over
    the same ids through the same head rows."""
    target = make_tiny_target("llama")
    drafter = _drafter(target)
    drafter.use_draft_vocab(_vocab(target.config.vocab_size, 40))
    drafter.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "config.json",
        "draft_vocab.safetensors",
        "model.safetensors",
    ]
    config = json.loads((tmp_path / "config.json").read_text())
    assert (
        config["draft_vocab_size"] == 40 and config["draft_vocab_sha256"] == drafter.draft_vocab.fingerprint()
    )
    loaded = Drafter.from_pretrained(tmp_path, target)
    assert torch.equal(loaded.draft_vocab.ids, drafter.draft_vocab.ids)
    hidden = torch.randn(3, drafter.config.hidden_size)
    assert torch.equal(loaded.logits(hidden), target.lm_head(hidden)[:, drafter.draft_vocab.ids])
    assert loaded.draft_vocab_size == 40 and loaded.shared_storage_ok(target)


def test_a_missing_or_foreign_draft_vocabulary_is_one_error(tmp_path):
    target = make_tiny_target("llama")
    drafter = _drafter(target)
    drafter.use_draft_vocab(_vocab(target.config.vocab_size, 40))
    drafter.save_pretrained(tmp_path)
    vocab_file = tmp_path / "draft_vocab.safetensors"
    other = _vocab(target.config.vocab_size, 40)
    other = type(other)(torch.arange(40), target.config.vocab_size)
    kept = vocab_file.read_bytes()
    other.save(tmp_path)  # another map, whole and self-consistent, but not the one config.json names
    with pytest.raises(ValueError, match="not the draft vocabulary this drafter was trained with"):
        Drafter.from_pretrained(tmp_path, target)
    vocab_file.unlink()
    with pytest.raises(FileNotFoundError, match="trained over a draft vocabulary of 40 ids"):
        Drafter.from_pretrained(tmp_path, target)
    vocab_file.write_bytes(kept)
    _edit_config(tmp_path, draft_vocab_size=None, draft_vocab_sha256=None)
    with pytest.raises(ValueError, match="is not announced by the drafter's config.json"):
        Drafter.from_pretrained(tmp_path, target)
    _edit_config(tmp_path, draft_vocab_size=40, draft_vocab_sha256=None)
    with pytest.raises(ValueError, match="come together"):
        Drafter.from_pretrained(tmp_path, target)
