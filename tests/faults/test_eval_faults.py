"""Faults of `python -m longspec.eval`: bad bytes and lone surrogates in rows, sources with nothing to evaluate,
bad config fields (caught before the target loads), and generation past the target's positions."""

from __future__ import annotations

import json
from unittest import mock

import pytest
from fault_helpers import assert_one_line_error, assert_only_changed, run_in_process, tree_checksums

from longspec.eval.__main__ import main
from longspec.testing import save_tiny_target


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_tiny_target("llama", tmp_path_factory.mktemp("tiny_llama"))  # max_position_embeddings 4096


def _row(i: int, context: str = "def f(x):\n    return x\n") -> bytes:
    return (
        json.dumps({"_id": f"r{i}", "context": context * 3, "input": "", "dataset": "lcc"}).encode() + b"\n"
    )


def _overrides(target_dir, data, out, *extra) -> list[str]:
    return [
        "target=tiny_llama",
        f"target.path={target_dir}",
        f"data.path={data}",
        "data.min_prompt_tokens=0",
        "method=ar",
        "max_new_tokens=2",
        "warmup=false",
        f"output_dir={out}",
        *extra,
    ]


def test_bad_bytes_and_lone_surrogates_are_skipped_with_their_line(tmp_path, target_dir, capsys):
    data = tmp_path / "rows.jsonl"
    data.write_bytes(
        _row(0)
        + b'{"_id": "latin1", "context": "caf\xe9", "input": ""}\n'  # one non-UTF-8 byte
        + json.dumps({"_id": "sur", "context": "x\ud800y", "input": ""}).encode()  # "\ud800" escape
        + b"\n"
        + _row(3)
    )
    before = tree_checksums(tmp_path)
    status, _ = run_in_process(main, _overrides(target_dir, data, tmp_path / "out"), capsys)
    assert status == 0
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    (report,) = results["data"]
    assert report["num_kept"] == 2
    assert [(m["line"], m["reason"].split(" (")[0]) for m in report["malformed"]] == [
        (2, "not UTF-8"),
        (3, "not valid Unicode text"),
    ]
    assert [s["id"] for s in results["methods"]["ar"]["rows"]] == ["r0", "r3"]
    assert_only_changed(tmp_path, before, allowed=["out"])


@pytest.mark.parametrize(
    "content, extra, pattern",
    [
        (b"", [], r"0 rows: 0 malformed, 0 outside .*; the source is empty"),
        (b"{x\n[1]\n\xff\n", [], r"3 rows: 3 malformed, 0 outside .*every row is malformed \(first: line 1"),
        # A user JSONL of short prompts under the default min_prompt_tokens (1200).
        (
            _row(0) + _row(1),
            ["data.min_prompt_tokens=null"],
            r"2 rows: 0 malformed, 2 outside .*1200 < tokens.*every prompt is too short: lower data.min_prompt",
        ),
        # Prompts longer than the room left: lowering data.min_prompt_tokens (once the only advice) cannot help.
        (
            _row(0) + _row(1),
            ["data.context_margin=4086"],
            r"2 rows: 0 malformed, 2 outside .*0 < tokens <= 10\); every prompt is longer than 10 tokens: lower "
            r"data.context_margin",
        ),
    ],
    ids=["empty", "all_malformed", "all_filtered", "all_too_long"],
)
def test_source_with_nothing_to_evaluate_is_one_error(tmp_path, target_dir, capsys, content, extra, pattern):
    data = tmp_path / "rows.jsonl"
    data.write_bytes(content)
    before = tree_checksums(tmp_path)
    with mock.patch("longspec.target.TargetModel.from_pretrained") as load:
        status, err = run_in_process(main, _overrides(target_dir, data, tmp_path / "out", *extra), capsys)
    assert status == 2 and not load.called  # refused before any model is loaded
    assert_one_line_error(
        err, r"data source '.*rows\.jsonl' has no sample to evaluate \(" + pattern, exclusive=False
    )
    assert_only_changed(tmp_path, before)  # no empty results.json


@pytest.mark.parametrize(
    "extra, pattern",
    [
        (["tree_widths=[4,0]"], r"tree widths must be positive"),
        (["temperature=0.5", "top_p=1.5"], r"top_p must be in \(0, 1\]"),
        (["top_k=0"], r"top_k must be >= 1"),
        (["prefill_chunk=0"], r"prefill_chunk.* must be >= 1"),
        (["data.context_len=2000", "data.context_margin=2000"], r"context_margin=2000 must be smaller"),
        (["data.context_margin=5000"], r"context_margin=5000 leaves no room for a prompt in a 4096-token"),
        (["data.context_len=8192"], r"context_len=8192 exceeds the target's max_position_embeddings=4096"),
        (
            ["max_new_tokens=5000", "data.context_margin=0"],
            r"= 5128 tokens, past .*max_position_embeddings=4096",
        ),
        (
            ["target.anchor_max_len=2048"],
            r"training-only and now stage.anchor_max_len .* evaluation does not take it",
        ),
    ],
    ids=[
        "tree_widths",
        "top_p",
        "top_k",
        "prefill_chunk",
        "margin_vs_len",
        "margin_vs_model",
        "len",
        "positions",
        "training_only",
    ],
)
def test_config_errors_come_before_the_target_loads(tmp_path, target_dir, capsys, extra, pattern):
    data = tmp_path / "rows.jsonl"
    data.write_bytes(_row(0))
    before = tree_checksums(tmp_path)
    with mock.patch("longspec.target.TargetModel.from_pretrained") as load:
        status, err = run_in_process(main, _overrides(target_dir, data, tmp_path / "out", *extra), capsys)
    assert status == 2 and not load.called
    assert_one_line_error(err, pattern, exclusive=False)  # eval logs its progress to stderr too
    assert_only_changed(tmp_path, before)


def test_a_window_that_contradicts_the_loaded_drafter_is_an_error(tmp_path, target_dir, capsys):
    """drafter.window with drafter.path: the loaded drafter keeps the window it was trained with, so a different
    value is a conflict, reported before the target loads (it used to be ignored without a word)."""
    data = tmp_path / "rows.jsonl"
    data.write_bytes(_row(0))
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text(json.dumps({"window": 64}))
    before = tree_checksums(tmp_path)
    extra = ["drafter.init=pretrained", f"drafter.path={drafter}", "drafter.window=512", "method=[longspec]"]
    with mock.patch("longspec.target.TargetModel.from_pretrained") as load:
        status, err = run_in_process(main, _overrides(target_dir, data, tmp_path / "out", *extra), capsys)
    assert status == 2 and not load.called
    assert_one_line_error(
        err, r"drafter.window=512 but the drafter at .* was trained with window 64", exclusive=False
    )
    assert_only_changed(tmp_path, before)


def test_an_output_dir_that_cannot_be_written_is_refused_before_the_target_loads(
    tmp_path, target_dir, capsys
):
    """output_dir below a file: it was first written after the target had loaded and warmed up, and the error
    was a bare "[Errno 20] Not a directory" that did not name the option."""
    data = tmp_path / "rows.jsonl"
    data.write_bytes(_row(0))
    before = tree_checksums(tmp_path)
    with mock.patch("longspec.target.TargetModel.from_pretrained") as load:
        status, err = run_in_process(main, _overrides(target_dir, data, data / "out"), capsys)
    assert status == 2 and not load.called
    assert_one_line_error(
        err,
        r"output_dir='.*rows\.jsonl/out' cannot be created: .*rows\.jsonl is not a directory",
        exclusive=False,
    )
    assert_only_changed(tmp_path, before)


# ---- a stopped eval resumes only on the same inputs --------------------------------------------------------------
def _save_drafter(target_dir, out, *, seed: int, nan: bool = False) -> str:
    """A drafter for the tiny target (its tokenizer in the fingerprint, as eval compares it), seeded weights."""
    import torch
    from transformers import AutoTokenizer

    from longspec.drafter import Drafter, DrafterConfig
    from longspec.target import TargetModel

    target = TargetModel.from_pretrained(str(target_dir), dtype=torch.float32, device="cpu")
    config = DrafterConfig.from_target_config(
        target.config, window=8, tokenizer=AutoTokenizer.from_pretrained(str(target_dir))
    )
    torch.manual_seed(seed)
    drafter = Drafter(config, target.embed_tokens, target.lm_head)
    drafter.reset_parameters()
    if nan:
        with torch.no_grad():
            next(iter(drafter.parameters())).view(-1)[0] = float("nan")
    drafter.save_pretrained(out)
    return str(out)


def _change_data(tmp_path, target, drafter):
    (tmp_path / "rows.jsonl").write_bytes(_row(5, "x = 1\n") + _row(6, "y = 2\n"))


def _change_target(tmp_path, target, drafter):
    save_tiny_target("llama", target, seed=1)  # the same shapes and tokenizer, other weights


def _change_drafter(tmp_path, target, drafter):
    _save_drafter(target, drafter, seed=1)  # re-exported over the same directory


@pytest.mark.parametrize(
    "change", [None, _change_data, _change_target, _change_drafter], ids=["same", "data", "target", "drafter"]
)
def test_a_stopped_eval_reads_back_its_chunks_only_on_the_same_inputs(
    tmp_path, target_dir, capsys, caplog, change
):
    """A stopped run's finished chunks (results.partial.jsonl) are keyed by the samples' content, the target and
    the drafter as well as the config: a changed data file's old chunk was mixed into the new results.json."""
    import shutil

    from longspec.eval.progress import PARTIAL_NAME

    target = tmp_path / "target"
    shutil.copytree(target_dir, target)
    drafter = _save_drafter(target, tmp_path / "drafter", seed=0)
    (tmp_path / "rows.jsonl").write_bytes(_row(0) + _row(1))
    args = _overrides(target, tmp_path / "rows.jsonl", tmp_path / "out", "method=[longspec]",
                      "drafter.init=pretrained", f"drafter.path={drafter}")  # fmt: skip
    with mock.patch("longspec.eval.progress.EvalProgress.finish"):  # stopped: its chunks stay on disk
        assert run_in_process(main, args, capsys)[0] == 0
    assert (tmp_path / "out" / PARTIAL_NAME).exists()
    if change is not None:
        change(tmp_path, target, drafter)
    status, _ = run_in_process(main, args, capsys)
    assert status == 0
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    rows = [s["id"] for s in results["methods"]["longspec"]["rows"]]
    if change is None:
        assert results["resumed"] == {"rows": 2} and rows == ["r0", "r1"]
    else:
        assert "resumed" not in results and "written for another configuration, data, target" in caplog.text
        assert rows == (["r5", "r6"] if change is _change_data else ["r0", "r1"])


def test_a_nan_drafter_is_refused_at_load(tmp_path, target_dir, capsys):
    drafter = _save_drafter(target_dir, tmp_path / "drafter", seed=0, nan=True)
    data = tmp_path / "rows.jsonl"
    data.write_bytes(_row(0))
    before = tree_checksums(tmp_path)
    args = _overrides(target_dir, data, tmp_path / "out", "method=[longspec]", "drafter.init=pretrained",
                      f"drafter.path={drafter}")  # fmt: skip
    status, err = run_in_process(main, args, capsys)
    assert status == 2  # loaded silently, and decoded at τ 1.00
    assert_one_line_error(
        err,
        r"drafter/model\.safetensors: tensor '.*' holds 1 NaN/inf value\(s\) of \d+: refusing to load",
        exclusive=False,
    )
    assert_only_changed(tmp_path, before)
