"""Faults of the data_prep tools: foreign --out files, dead sources, bad rows, usage errors, SIGKILL mid-prep."""

from __future__ import annotations

import json
import os
import random
import signal
import time

import numpy as np
import pytest
from fault_helpers import (
    assert_one_line_error,
    assert_only_changed,
    run_in_process,
    run_module,
    tree_checksums,
)

from data_prep import stage1, stage2, stage3_regenerate
from data_prep.stage3_regenerate import regenerate
from longspec.data import ShardReader
from longspec.testing import build_byte_tokenizer, save_tiny_target


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    """A tiny target with the byte tokenizer (chat template included): regenerate's --target, prep's --tokenizer."""
    return save_tiny_target("llama", tmp_path_factory.mktemp("target"))


def _jsonl(path, rows, *, final_newline=True) -> str:
    text = "\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows)
    path.write_text(text + ("\n" if final_newline else ""))
    return str(path)


def _prompts(tmp_path, n=3, **kw) -> str:
    rows = [{"id": f"p{i}", "prompt": f"question {i}"} for i in range(n)]
    return _jsonl(tmp_path / "prompts.jsonl", rows, **kw)


def _regen_args(source, target_dir, out, *extra) -> list[str]:
    return [
        "--source",
        str(source),
        "--target",
        target_dir,
        "--out",
        str(out),
        "--max-new-tokens",
        "2",
        "--no-progress",
        *extra,
    ]


def test_regenerate_out_is_source_is_refused_untouched(tmp_path, target_dir, capsys):
    source = _prompts(tmp_path, final_newline=False)  # a hand-written file: no newline after its last row
    before = tree_checksums(tmp_path)
    status, err = run_in_process(stage3_regenerate.main, _regen_args(source, target_dir, source), capsys)
    assert status == 2
    assert_one_line_error(err, "is the --source file")
    assert_only_changed(tmp_path, before)


def test_regenerate_never_modifies_a_foreign_out_file(tmp_path, target_dir, capsys):
    """An existing user JSONL as --out: its rows are not regenerate's output, so it is refused, byte for byte."""
    source = _prompts(tmp_path)
    mine = _jsonl(tmp_path / "mine.jsonl", [{"id": "x", "text": "a"}, '{"id": "y", "te'], final_newline=False)
    before = tree_checksums(tmp_path)
    status, err = run_in_process(stage3_regenerate.main, _regen_args(source, target_dir, mine), capsys)
    assert status == 2
    assert_one_line_error(err, r"mine\.jsonl' line 1 is not a stage3_regenerate output row")
    assert_only_changed(tmp_path, before)


def test_regenerate_skips_a_non_string_system(tmp_path, target_dir, capsys):
    rows = [
        {"id": "ok", "prompt": "hello"},
        {"id": "bad", "prompt": "hello", "system": {"role": "nope"}},
        {"id": "list", "prompt": "hello", "system": ["a"]},
    ]
    source = _jsonl(tmp_path / "prompts.jsonl", rows)
    out = tmp_path / "out.jsonl"
    before = tree_checksums(tmp_path)
    status, _ = run_in_process(stage3_regenerate.main, _regen_args(source, target_dir, out), capsys)
    assert status == 0
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["ok"]
    assert_only_changed(tmp_path, before, allowed=["out.jsonl"])
    stats = regenerate(source=source, target=target_dir, out=str(out), max_new_tokens=2, progress=False)
    assert stats.rejected == {"wrong_type": 2, "already_done": 1}


def test_stage2_source_with_no_usable_row_is_named(tmp_path, target_dir, capsys):
    good = _jsonl(tmp_path / "good.jsonl", [{"text": "long document " * 20}] * 3)
    bad = _jsonl(tmp_path / "bad.jsonl", ["{broken", json.dumps({"text": 3}), json.dumps({"other": "x"})])
    args = ["--tokenizer", target_dir, "--out", str(tmp_path / "out"), "--seq-len", "64", "--min-tokens", "8"]
    before = tree_checksums(tmp_path)
    status, err = run_in_process(
        stage2.main, ["--source", good, "--source", bad, *args, "--no-progress"], capsys
    )
    assert status == 2
    assert_one_line_error(
        err, r"source '.*bad\.jsonl' has no usable row \(malformed_json: 1, missing_field: 1, wrong_type: 1\)"
    )
    assert_only_changed(tmp_path, before, allowed=["out"])


def test_stage1_all_malformed_source_is_one_line(tmp_path, target_dir, capsys):
    source = _jsonl(tmp_path / "bad.jsonl", ["{x", "[1, 2]", "\xff\xfe"])
    before = tree_checksums(tmp_path)
    args = ["--source", source, "--tokenizer", target_dir, "--out", str(tmp_path / "out"), "--no-progress"]
    status, err = run_in_process(stage1.main, args, capsys)
    assert status == 2
    assert_one_line_error(err, r"produced no valid rows: rows read 3, kept 0")
    assert_only_changed(tmp_path, before, allowed=["out"])


def test_usage_error_is_one_line_from_the_real_cli(tmp_path, target_dir):
    """A missing option and a missing source through `python -m` (the real entry point, no traceback)."""
    before = tree_checksums(tmp_path)
    result = run_module("data_prep.stage2", "--source", tmp_path / "x.jsonl", "--out", tmp_path / "o")
    assert result.returncode == 2
    assert_one_line_error(
        result.stderr, r"data_prep\.stage2: the following arguments are required: --tokenizer"
    )
    result = run_module(
        "data_prep.stage2",
        "--source",
        tmp_path / "x.jsonl",
        "--out",
        tmp_path / "o",
        "--tokenizer",
        target_dir,
    )
    assert result.returncode == 2
    assert_one_line_error(result.stderr, r"source '.*x\.jsonl' does not exist")
    assert_only_changed(tmp_path, before, allowed=["o"])


def test_a_tokenizer_that_is_no_directory_and_not_on_the_hub_is_one_line(tmp_path):
    (tmp_path / "x.jsonl").write_text('{"text": "abc"}\n')
    result = run_module(  # offline (tests/conftest.py): a hub id cannot be fetched; it was an OSError traceback
        "data_prep.stage1", "--source", tmp_path / "x.jsonl", "--out", tmp_path / "o", "--seq-len", "8",
        "--tokenizer", "no-such-org/no-such-tokenizer",
    )  # fmt: skip
    assert result.returncode == 2
    assert_one_line_error(
        result.stderr,
        r"cannot load the tokenizer of 'no-such-org/no-such-tokenizer': it is not a local directory",
    )
    (tmp_path / "empty").mkdir()  # a directory without tokenizer files: transformers' message named no path
    result = run_module(
        "data_prep.stage1", "--source", tmp_path / "x.jsonl", "--out", tmp_path / "o", "--seq-len", "8",
        "--tokenizer", tmp_path / "empty",
    )  # fmt: skip
    assert result.returncode == 2
    assert_one_line_error(result.stderr, rf"'{tmp_path / 'empty'}' holds no tokenizer")


def _kill_at_random_points(work, duration: float, kills: int, seed: int) -> None:
    """Fork `work()` `kills` times and SIGKILL it after a random fraction of `duration`."""
    rng = random.Random(seed)
    for _ in range(kills):
        pid = os.fork()
        if pid == 0:
            try:
                work()
            finally:
                os._exit(0)
        time.sleep(rng.uniform(0.05, 0.9) * duration)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def test_sigkill_mid_stage1_then_rerun_equals_an_uninterrupted_prep(tmp_path):
    tokenizer = build_byte_tokenizer()
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "def", "return", "(", ")", "\n"]
    docs = [{"text": " ".join(rng.choice(words, size=400))} for _ in range(600)]
    source = _jsonl(tmp_path / "docs.jsonl", docs)
    common = dict(source=source, tokenizer=tokenizer, seq_len=64, shard_tokens=4096, progress=False)
    start = time.perf_counter()
    reference = stage1.prepare_stage1(out=str(tmp_path / "reference"), **common)
    duration = time.perf_counter() - start
    out = tmp_path / "out"
    _kill_at_random_points(lambda: stage1.prepare_stage1(out=str(out), **common), duration, kills=3, seed=1)
    # A killed prep has no complete manifest: readers refuse it and the rerun restarts it. (Had the last kill come
    # after the commit point, the prep would be complete and the rerun refuse to redo it.)
    try:
        ShardReader(out)
    except (FileNotFoundError, ValueError):
        manifest = stage1.prepare_stage1(out=str(out), **common)
        assert manifest.num_rows == reference.num_rows and len(manifest.shards) > 3
    got, want = ShardReader(out), ShardReader(tmp_path / "reference")
    assert all(np.array_equal(got.row(i)[0], want.row(i)[0]) for i in range(len(want)))
    assert not [p for p in os.listdir(out) if ".tmp-" in p]


def test_sigkill_mid_regenerate_then_rerun_resumes(tmp_path, target_dir):
    source = _prompts(tmp_path, n=8)
    common = dict(source=source, target=target_dir, max_new_tokens=4, batch_size=1, progress=False)
    start = time.perf_counter()
    regenerate(out=str(tmp_path / "reference.jsonl"), **common)
    duration = time.perf_counter() - start
    out = tmp_path / "out.jsonl"
    _kill_at_random_points(lambda: regenerate(out=str(out), **common), duration, kills=3, seed=2)
    regenerate(out=str(out), **common)
    rows = [json.loads(line) for line in out.read_text().splitlines()]  # every line whole
    reference = [json.loads(line) for line in (tmp_path / "reference.jsonl").read_text().splitlines()]
    assert sorted(r["id"] for r in rows) == [f"p{i}" for i in range(8)]  # each prompt once
    assert {r["id"]: r["response"] for r in rows} == {r["id"]: r["response"] for r in reference}
