"""The tokenizer content hash: the same tokenizer in another serialization matches, one changed merge, token,
special token, normalizer or pre-tokenizer does not. The target fingerprint's layer count and tokenizer vocab size,
and how a fingerprint from an older longspec is reported."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from longspec.drafter import Drafter, DrafterConfig
from longspec.fingerprint import fingerprint_mismatches, target_fingerprint, tokenizer_hash
from longspec.testing import build_byte_tokenizer, build_tiny_bpe_tokenizer, make_tiny_target


def _saved(tokenizer, directory, edit=None):
    """Save, optionally edit tokenizer.json (a dict -> None), and load back."""
    tokenizer.save_pretrained(directory)
    if edit is not None:
        path = directory / "tokenizer.json"
        data = json.loads(path.read_text())
        edit(data)
        path.write_text(json.dumps(data))
    return AutoTokenizer.from_pretrained(directory)


def _legacy_serialization(data):
    """Another writer: merges as "a b" strings (tokenizers < 0.20), other key order, and trim_offsets flipped
    (it moves offsets only, never ids)."""
    model = data["model"]
    model["merges"] = [" ".join(pair) for pair in model["merges"]]
    data["model"] = dict(reversed(list(model.items())))
    data["pre_tokenizer"]["trim_offsets"] = not data["pre_tokenizer"]["trim_offsets"]


@pytest.mark.parametrize("build", [build_tiny_bpe_tokenizer, build_byte_tokenizer])
def test_same_tokenizer_two_serializations_same_hash(tmp_path, build):
    tokenizer = build()
    reloaded = _saved(tokenizer, tmp_path / "a")
    legacy = _saved(tokenizer, tmp_path / "b", _legacy_serialization)
    assert tokenizer_hash(reloaded) == tokenizer_hash(tokenizer) == tokenizer_hash(legacy)


def _unknown_token_options(data):
    """What transformers 5.17 writes for a GGUF's byte-level BPE (5.24 does not): options about unknown pieces,
    which a byte-level tokenizer never produces."""
    data["model"].update(byte_fallback=True, fuse_unk=True, unk_token="<|pad|>")


def test_unknown_piece_options_do_not_count_for_byte_level_bpe(tmp_path):
    tokenizer = build_tiny_bpe_tokenizer()
    assert tokenizer_hash(_saved(tokenizer, tmp_path / "a", _unknown_token_options)) == tokenizer_hash(
        tokenizer
    )


def _swap_merge(data):
    merges = data["model"]["merges"]
    merges[3], merges[4] = merges[4], merges[3]  # same merges, other ranks: other ids for some texts


def _rename_token(data):
    vocab = data["model"]["vocab"]
    vocab["zz"] = vocab.pop("z")  # a byte no merge uses


def _drop_merge(data):
    data["model"]["merges"].pop()


def _add_normalizer(data):
    data["normalizer"] = {"type": "NFC"}


def _no_regex(data):
    data["pre_tokenizer"]["use_regex"] = False


def _added_token_strips_left(data):
    data["added_tokens"][3]["lstrip"] = True  # <|endoftext|> now swallows the space before it


@pytest.mark.parametrize(
    "edit", [_swap_merge, _rename_token, _drop_merge, _add_normalizer, _no_regex, _added_token_strips_left]
)
def test_one_change_changes_the_hash(tmp_path, edit):
    tokenizer = build_tiny_bpe_tokenizer()
    assert tokenizer_hash(_saved(tokenizer, tmp_path / "x", edit)) != tokenizer_hash(tokenizer)


def test_special_token_roles_count(tmp_path):
    tokenizer = build_tiny_bpe_tokenizer()
    tokenizer.save_pretrained(tmp_path)
    other_eos = AutoTokenizer.from_pretrained(tmp_path, eos_token="<|pad|>")
    assert tokenizer_hash(other_eos) != tokenizer_hash(tokenizer)


def test_layer_count_is_checked(tmp_path):
    deep = make_tiny_target("llama", num_hidden_layers=6)
    shallow = make_tiny_target("llama", num_hidden_layers=2)
    tokenizer = build_tiny_bpe_tokenizer()
    config = DrafterConfig.from_target_config(deep.config, window=8, tokenizer=tokenizer)
    Drafter(config, deep.embed_tokens, deep.lm_head).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="num_hidden_layers: drafter was trained for 6, target has 2"):
        Drafter.from_pretrained(tmp_path, shallow, tokenizer)
    Drafter.from_pretrained(tmp_path, deep, tokenizer)  # its own target loads


def test_fingerprint_records_tokenizer_vocab_size():
    config = make_tiny_target("qwen2").config
    tokenizer = build_tiny_bpe_tokenizer()
    fp = target_fingerprint(config, tokenizer)
    assert (fp["num_hidden_layers"], fp["tokenizer_vocab_size"], fp["vocab_size"]) == (2, 300, 300)
    tokenizer.add_tokens(["<extra>"])
    problems = fingerprint_mismatches(fp, target_fingerprint(config, tokenizer))
    assert any(
        p.startswith("tokenizer_vocab_size: drafter was trained for 300, target has 301") for p in problems
    )


def test_older_fingerprint_is_reported_not_crashing():
    config = make_tiny_target("llama").config
    tokenizer = build_byte_tokenizer()
    current = target_fingerprint(config, tokenizer)
    v1 = {k: v for k, v in current.items() if k not in ("fingerprint_version", "num_hidden_layers")}
    v1.pop("tokenizer_vocab_size")
    v1["tokenizer_sha256"] = "0" * 64  # the old hash form
    problems = fingerprint_mismatches(v1, current)
    assert [p.split(":")[0] for p in problems] == [
        "num_hidden_layers",
        "tokenizer_sha256",
        "tokenizer_vocab_size",
    ]
    assert all("saved by an older longspec, fingerprint v1" in p for p in problems)
    # saved without a tokenizer: the tokenizer fields are not compared
    no_tokenizer = target_fingerprint(config)
    assert fingerprint_mismatches(no_tokenizer, current) == []
