"""`python -m longspec.convert_gguf`: the HF directory it writes is the same target (logits, tokenizer ids and
fingerprint) as the GGUF; it never overwrites by accident, never writes into the source's directory, and a bad
file is one line on stderr."""

from __future__ import annotations

import json

import pytest
import torch

from longspec.convert_gguf import convert_gguf, main
from longspec.data.manifest import tokenizer_fingerprint
from longspec.fingerprint import target_fingerprint
from longspec.target import TargetModel
from longspec.target_source import load_tokenizer


@pytest.mark.parametrize("family", ["llama", "qwen2-tied"])
def test_round_trip_is_the_same_target(tiny_gguf, tmp_path, family):
    path, _ = tiny_gguf(family)
    out = tmp_path / "hf"
    convert_gguf(str(path), str(out), dtype="float32")
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    assert not list(tmp_path.glob("hf.tmp-*"))
    from_gguf, from_dir = TargetModel.from_pretrained(path), TargetModel.from_pretrained(out)
    ids = torch.randint(0, 300, (1, 16), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(
        from_dir.logits(from_dir(ids).hidden), from_gguf.logits(from_gguf(ids).hidden), atol=0, rtol=0
    )
    tok_gguf, tok_dir = load_tokenizer(path), load_tokenizer(out)
    text = "the self (x) = 'é'\n"
    assert tok_dir(text)["input_ids"] == tok_gguf(text)["input_ids"]
    assert target_fingerprint(from_dir.config, tok_dir) == target_fingerprint(from_gguf.config, tok_gguf)
    # data tokenized from the GGUF (the GPU pipeline does, while the target converts) is the converted dir's
    assert tokenizer_fingerprint(tok_gguf) == tokenizer_fingerprint(tok_dir)


def test_dtype_and_refusals(tiny_gguf, tmp_path):
    path, _ = tiny_gguf("qwen2")
    out = tmp_path / "hf"
    convert_gguf(str(path), str(out))  # default bfloat16
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    with pytest.raises(FileExistsError, match="--overwrite"):
        convert_gguf(str(path), str(out))
    convert_gguf(str(path), str(out), dtype="float16", overwrite=True)
    assert json.loads((out / "config.json").read_text())["dtype"] == "float16"
    with pytest.raises(ValueError, match="is the directory that holds"):
        convert_gguf(str(path), str(path.parent), overwrite=True)
    assert path.is_file()
    with pytest.raises(ValueError, match="--dtype"):
        convert_gguf(str(path), str(tmp_path / "x"), dtype="int8")


def test_cli_error_is_one_line_naming_the_file(tmp_path, capsys):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(100))
    with pytest.raises(SystemExit) as excinfo:
        main([str(bad), str(tmp_path / "out")])
    assert excinfo.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and str(bad) in err and "\n" not in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("family", ["llama", "qwen2-tied"])
def test_every_control_token_of_the_gguf_is_a_special_token(tiny_gguf, family):
    # transformers versions register different subsets (5.17 missed a Qwen2 file's <|bos|>, giving the GGUF and
    # its converted directory two tokenizer fingerprints); longspec registers the file's whole control set.
    from gguf import GGUFReader

    path, _ = tiny_gguf(family)
    reader = GGUFReader(str(path))
    tokens = reader.get_field("tokenizer.ggml.tokens").contents()
    types = reader.get_field("tokenizer.ggml.token_type").contents()
    control = {t for t, kind in zip(tokens, types, strict=True) if int(kind) == 3}
    assert control, "the tiny GGUF writer marks its special tokens as control tokens"
    tokenizer = load_tokenizer(path)
    assert control <= set(tokenizer.get_added_vocab())
    for token in control:  # matched whole in text
        assert tokenizer(f"a{token}b", add_special_tokens=False)["input_ids"][
            1
        ] == tokenizer.convert_tokens_to_ids(token)


def test_usage_error_is_one_line(tmp_path, capsys):
    for argv in ([], [str(tmp_path / "a.gguf"), str(tmp_path / "out"), "--dtype", "int3"]):
        with pytest.raises(SystemExit) as excinfo:
            main(argv)
        assert excinfo.value.code == 2
        err = capsys.readouterr().err  # was argparse's usage block
        assert err.startswith("error: python -m longspec.convert_gguf: ") and err.count("\n") == 1, err
