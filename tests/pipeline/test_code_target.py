"""The code target of issue 5 (longspec.pipeline.code_target): BPE tokenizer, pretraining recipe, and the shipped
checkpoint."""

import json
import math
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from data_prep.stdlib_corpus import split_of
from data_prep.train_tokenizer import SPECIAL_TOKENS, round_trip_failures, train_tokenizer
from longspec.pipeline.code_target import data, evaluate, presets, trainer

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / "longspec" / "assets" / "code_target"
STDLIB = Path(sysconfig.get_paths()["stdlib"])


def _stdlib_texts(names):
    return [(STDLIB / name).read_text(encoding="utf-8") for name in names]


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory):
    """A few real stdlib modules as train.jsonl / heldout.jsonl."""
    out = tmp_path_factory.mktemp("corpus")
    train = ["textwrap.py", "shlex.py", "fnmatch.py", "glob.py", "bisect.py", "heapq.py", "colorsys.py"]
    heldout = ["keyword.py", "this.py"]
    for split, names in (("train", train), ("heldout", heldout)):
        with open(out / f"{split}.jsonl", "w", encoding="utf-8") as f:
            for name, text in zip(names, _stdlib_texts(names), strict=True):
                f.write(json.dumps({"text": text, "path": name}) + "\n")
    return out


@pytest.fixture(scope="module")
def small_tokenizer(small_corpus):
    return train_tokenizer(small_corpus / "train.jsonl", vocab_size=512)


def test_tokenizer_round_trip_and_specials(small_tokenizer, tmp_path):
    texts = _stdlib_texts(["keyword.py", "this.py", "string.py"]) + [
        "def f(x):\r\n\treturn x  # tabs, CRLF\r\n",
        "s = 'naïve café — 東京 🐍'\n",
        "    \n\n  trailing spaces   \n",
    ]
    assert round_trip_failures(small_tokenizer, texts) == []
    small_tokenizer.save_pretrained(tmp_path / "tok")
    reloaded = data.load_tokenizer(tmp_path / "tok")
    assert round_trip_failures(reloaded, texts) == []
    assert [reloaded.convert_ids_to_tokens(i) for i in range(4)] == SPECIAL_TOKENS
    assert (reloaded.bos_token, reloaded.eos_token, reloaded.pad_token, reloaded.unk_token) == tuple(
        SPECIAL_TOKENS
    )
    ids = reloaded("x = 1\n")["input_ids"]
    assert ids[0] == reloaded.bos_token_id and reloaded.bos_token_id not in ids[1:]  # <s> prepended once
    chat = reloaded.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<s>### user\nhi\n### assistant\n"
    assert len(small_tokenizer) == 512


def test_tokenizer_rejects_bad_arguments(small_corpus):
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(small_corpus / "train.jsonl", vocab_size=100)
    with pytest.raises(FileNotFoundError, match="stdlib_corpus"):
        train_tokenizer(small_corpus / "missing.jsonl", vocab_size=512)


def test_token_cache_layout_and_staleness(small_corpus, small_tokenizer, tmp_path):
    train_ids, heldout_ids = data.load_token_cache(tmp_path / "tok", small_tokenizer, small_corpus)
    assert train_ids.dtype == np.uint16
    bos, eos = small_tokenizer.bos_token_id, small_tokenizer.eos_token_id
    num_files = 2
    assert (heldout_ids == bos).sum() == num_files == (heldout_ids == eos).sum()
    first_doc = heldout_ids[1 : int(np.argmax(heldout_ids == eos))]
    assert small_tokenizer.decode(first_doc.tolist()) == _stdlib_texts(["keyword.py"])[0]
    other = train_tokenizer(small_corpus / "train.jsonl", vocab_size=400)
    with pytest.raises(ValueError, match="another tokenizer"):
        data.load_token_cache(tmp_path / "tok", other)


def test_packed_stream_windows_are_shifted_slices():
    ids = torch.arange(1000)
    stream = data.PackedStream(ids, seq_len=16, batch_size=5, generator=torch.Generator().manual_seed(0))
    seen = set()
    for _ in range(stream.windows_per_epoch // 5):
        inputs, labels = stream.next_batch()
        assert inputs.shape == labels.shape == (5, 16)
        assert torch.equal(labels[:, :-1], inputs[:, 1:]) and torch.equal(labels[:, -1], inputs[:, -1] + 1)
        seen.update(inputs[:, 0].tolist())
    assert stream.epoch == 0 and len(seen) == 5 * (stream.windows_per_epoch // 5)  # no window twice per epoch
    stream.next_batch()
    assert stream.epoch == 1


def test_degeneracy_statistic():
    assert evaluate.degeneracy([7, 7, 7, 7]) == {"distinct_ratio": 0.25, "longest_run": 4}
    assert evaluate.degeneracy([1, 2, 2, 3, 2]) == {"distinct_ratio": 0.6, "longest_run": 2}


def test_recipe_loss_falls_and_checkpoint_round_trips(small_corpus, small_tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM

    train_ids, heldout_ids = data.load_token_cache(tmp_path / "tok", small_tokenizer, small_corpus)
    cfg = presets.PretrainConfig(
        tokenizer=tmp_path / "unused", tokens_dir=tmp_path / "tok", preset="smoke", seq_len=32, batch_size=4,
        lr=3e-2, warmup_steps=0, max_steps=3, log_every=1, eval_every=3, device="cpu",
        model_overrides=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1),
    )  # fmt: skip
    model, summary = trainer.train(cfg, train_ids, heldout_ids, small_tokenizer)
    losses = [h["train_loss"] for h in summary["history"] if "train_loss" in h]
    assert len(losses) == 3 and losses[-1] < losses[0], losses
    assert summary["heldout"]["loss"] < math.log(len(small_tokenizer))  # better than uniform after 3 steps
    assert summary["steps"] == 3 and summary["num_parameters"] == sum(p.numel() for p in model.parameters())

    weights = trainer.save_checkpoint(model, small_tokenizer, tmp_path / "ckpt", summary)
    assert weights.is_file() and not (tmp_path / "ckpt.tmp").exists()
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "ckpt"), dtype=torch.float32)
    with safe_open(weights, framework="pt") as f:
        assert {f.get_slice(name).get_dtype() for name in f.keys()} == {"BF16"}
    x = torch.from_numpy(heldout_ids[:40].astype(np.int64))[None]
    with torch.no_grad():
        ref = model.to(torch.bfloat16).float()(input_ids=x).logits  # the weights as saved (bf16)
        got = reloaded(input_ids=x).logits
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-4)


def test_wall_clock_budget_stops_and_still_evaluates(small_corpus, small_tokenizer, tmp_path):
    train_ids, heldout_ids = data.load_token_cache(tmp_path / "tok", small_tokenizer, small_corpus)
    cfg = presets.PretrainConfig(
        tokenizer=tmp_path / "unused", tokens_dir=tmp_path / "tok", preset="smoke", seq_len=32, batch_size=2,
        max_steps=10_000, max_minutes=1e-9, eval_every=10_000, device="cpu",
        model_overrides=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1),
    )  # fmt: skip
    _, summary = trainer.train(cfg, train_ids, heldout_ids, small_tokenizer)
    assert summary["steps"] < 10_000 and summary["best_step"] == summary["steps"]
    assert math.isfinite(summary["heldout"]["loss"])


def test_config_validation():
    with pytest.raises(ValueError, match="preset"):
        presets.PretrainConfig(tokenizer=Path("t"), tokens_dir=Path("d"), preset="huge")
    with pytest.raises(ValueError, match="max_minutes"):
        presets.PretrainConfig(tokenizer=Path("t"), tokens_dir=Path("d"), max_minutes=0)


def test_presets_fit_their_budgets():
    from transformers import LlamaForCausalLM

    tiny = presets.build_model_config("tiny", 8192)
    # The shipped checkpoint travels back from the GPU machine: bf16 weights must stay under 16 MiB.
    assert 2 * presets.num_parameters(tiny) < 16 * 2**20
    assert tiny.num_attention_heads // tiny.num_key_value_heads == 4 and not tiny.tie_word_embeddings
    gpu = presets.build_model_config("gpu100m", 8192)
    assert 80e6 < presets.num_parameters(gpu) < 120e6
    with torch.device("meta"):
        assert sum(p.numel() for p in LlamaForCausalLM(gpu).parameters()) == presets.num_parameters(gpu)


# ------------------------------------------------------------------------------------- the shipped checkpoint

needs_shipped = pytest.mark.skipif(
    not (SHIPPED / "model.safetensors").is_file(), reason="no shipped checkpoint"
)


def _heldout_stdlib_text(min_chars: int = 4000) -> str:
    """The first held-out stdlib module (same path-hash rule as the corpus) long enough for a prefix + continuation."""
    for path in sorted(STDLIB.glob("*.py")):
        if split_of(path.relative_to(STDLIB).as_posix(), 0.05) == "heldout":
            text = path.read_text(encoding="utf-8")
            if len(text) >= min_chars:
                return text
    pytest.skip("no held-out stdlib module on this Python")


@needs_shipped
def test_shipped_checkpoint_loads_and_continues_held_out_code():
    from transformers import AutoModelForCausalLM

    assert (SHIPPED / "model.safetensors").stat().st_size <= 16 * 2**20
    tokenizer = data.load_tokenizer(SHIPPED)
    model = AutoModelForCausalLM.from_pretrained(str(SHIPPED), dtype=torch.float32)
    assert model.config.model_type == "llama" and model.config.vocab_size == len(tokenizer)
    ids = torch.tensor(tokenizer(_heldout_stdlib_text())["input_ids"][:384])
    prefix, truth = ids[:256], ids[256:]

    # It has learned held-out code: its loss is far below uniform guessing (log V nats per token).
    with torch.no_grad():
        logits = model(input_ids=ids[None]).logits[0, :-1]
    loss = torch.nn.functional.cross_entropy(logits, ids[1:]).item()
    assert loss < 0.5 * math.log(len(tokenizer)), loss

    continuation = evaluate.greedy_continue(model, prefix, 48)
    stats = evaluate.degeneracy(continuation)
    assert len(set(continuation)) > 1 and stats["longest_run"] < len(continuation) // 4, stats
    assert len(truth) == 128  # the prefix is followed by real held-out code (sanity of the slice)


@needs_shipped
def test_shipped_checkpoint_behind_the_target_adapter():
    target_mod = pytest.importorskip("longspec.target", reason="longspec/target.py not there yet")
    from transformers import AutoModelForCausalLM

    target = target_mod.TargetModel.from_pretrained(SHIPPED, dtype=torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(str(SHIPPED), dtype=torch.float32)
    assert (target.family, target.num_kv_heads, target.vocab_size) == ("llama", 2, 8192)
    ids = torch.tensor(data.load_tokenizer(SHIPPED)(_heldout_stdlib_text()[:800])["input_ids"])[None]
    out = target(ids)
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
    torch.testing.assert_close(target.logits(out.hidden), ref, rtol=1e-4, atol=1e-4)


def test_cli_user_error_is_one_line(tmp_path, capsys):
    from longspec.pipeline.code_target.__main__ import main

    assert main(["--tokenizer", str(tmp_path / "no_tokenizer"), "--tokens-dir", str(tmp_path / "tok")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no tokenizer.json in") and err.count("\n") == 1, err
    assert main(["--preset", "huge"]) == 2
    assert "invalid choice" in capsys.readouterr().err
