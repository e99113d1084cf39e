"""Faults of `python -m longspec.export`: overlapping paths, bad flags, corrupt checkpoints, SIGKILL mid-export."""

from __future__ import annotations

import json
import os
import random
import signal
import time

import pytest
import torch
from fault_helpers import (
    assert_one_line_error,
    assert_only_changed,
    run_in_process,
    run_module,
    tree_checksums,
)
from safetensors.torch import load_file, save_file

from longspec.drafter import Drafter, DrafterConfig
from longspec.export import EXPORT_FILES, export_drafter, main
from longspec.ownership import MARKER_NAME, is_ours, remove_owned, write_marker
from longspec.testing import make_tiny_target
from longspec.train.checkpoint import write_checksums


def _write_checkpoint(run, step: int, *, big_numel: int = 0) -> dict:
    """RUN/checkpoints/step_N as the trainer writes it; `big_numel` adds a large tensor so an export takes long
    enough to be killed in the middle of its writes."""
    target = make_tiny_target("llama")
    ckpt = run / "checkpoints" / f"step_{step:08d}"
    torch.manual_seed(step)
    drafter = Drafter(
        DrafterConfig.from_target_config(target.config, window=8), target.embed_tokens, target.lm_head
    )
    drafter.save_pretrained(ckpt / "drafter")
    weights = {k: v.detach().clone() for k, v in drafter.state_dict().items()}
    if big_numel:
        weights["block.filler"] = torch.full((big_numel,), float(step))
        save_file(weights, ckpt / "drafter" / "model.safetensors", metadata={"format": "pt"})
    state = {"step": step, "total_steps": 4, "stage": "s1", "target": {"name": "tiny", "path": "/x"}}
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    (run / "config.yaml").write_text("stage: s1\n")
    return weights


@pytest.fixture
def runs(tmp_path):
    """tmp/runs/{stage1,stage2}: two run dirs side by side, as `python -m longspec.pipeline` lays them out."""
    root = tmp_path / "runs"
    for name in ("stage1", "stage2"):
        _write_checkpoint(root / name, 2)
    return root


@pytest.mark.parametrize("where", ["run_dir", "parent", "grandparent", "checkpoints"])
def test_out_overlapping_the_run_is_refused_untouched(tmp_path, runs, capsys, where):
    run = runs / "stage1"
    out = {
        "run_dir": run,
        "parent": runs,
        "grandparent": tmp_path,
        "checkpoints": run / "checkpoints" / "export",
    }[where]
    before = tree_checksums(tmp_path)
    status, err = run_in_process(main, [str(run), str(out), "--overwrite"], capsys)
    assert status == 2
    assert_one_line_error(err, "run directory|inside .*checkpoints")
    assert_only_changed(tmp_path, before)


def test_bad_dtype_leaves_nothing_behind(tmp_path, runs, capsys):
    before = tree_checksums(tmp_path)
    status, err = run_in_process(
        main, [str(runs / "stage1"), str(tmp_path / "out"), "--dtype", "foo"], capsys
    )
    assert status == 2
    assert_one_line_error(err, r"--dtype 'foo' is not one of")
    assert_only_changed(tmp_path, before)  # no out/, no out.tmp-PID/


def test_overwrite_replaces_only_a_previous_export(tmp_path, runs, capsys):
    home = tmp_path / "home"
    (home / "notes").mkdir(parents=True)
    (home / "notes" / "todo.txt").write_text("keep me")
    (home / "config.json").write_text("{}")
    before = tree_checksums(tmp_path)
    status, err = run_in_process(main, [str(runs / "stage1"), str(home), "--overwrite"], capsys)
    assert status == 2
    assert_one_line_error(err, r"home' is not empty and was not written by longspec \(no \.longspec marker\)")
    assert_only_changed(tmp_path, before)


def test_corrupt_checkpoint_weights_name_the_file(tmp_path, runs, capsys):
    weights = runs / "stage1" / "checkpoints" / "step_00000002" / "drafter" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # truncated by a full disk, say
    before = tree_checksums(tmp_path)
    status, err = run_in_process(main, [str(runs / "stage1"), str(tmp_path / "out")], capsys)
    assert status == 2
    assert_one_line_error(err, r"model\.safetensors is not a readable safetensors file")
    assert_only_changed(tmp_path, before)


def test_a_changed_byte_in_checksummed_weights_is_refused(tmp_path, runs, capsys):
    ckpt = runs / "stage1" / "checkpoints" / "step_00000002"
    write_checksums(str(ckpt))  # as the trainer does, last
    assert export_drafter(str(runs / "stage1"), str(tmp_path / "good")) == str(tmp_path / "good")
    weights = ckpt / "drafter" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0xFF  # one weight's byte flipped: the file still parses as safetensors
    weights.write_bytes(bytes(data))
    before = tree_checksums(tmp_path)
    status, err = run_in_process(main, [str(runs / "stage1"), str(tmp_path / "out")], capsys)
    assert status == 2  # was exported as if whole
    assert_one_line_error(
        err,
        r"drafter/model\.safetensors does not match its checksum in checksums\.json .* refusing to export",
    )
    assert_only_changed(tmp_path, before)


@pytest.mark.parametrize("name", ["drafter/config.json", "trainer_state.json"])
def test_checkpoint_json_that_is_not_an_object_is_one_line(tmp_path, runs, capsys, name):
    (runs / "stage1" / "checkpoints" / "step_00000002" / name).write_text(
        "[1]"
    )  # no checksums: not caught there
    before = tree_checksums(tmp_path)
    status, err = run_in_process(main, [str(runs / "stage1"), str(tmp_path / "out")], capsys)
    assert status == 2  # was an AttributeError traceback
    assert_one_line_error(err, r"is not a JSON object; the checkpoint is corrupt")
    assert_only_changed(tmp_path, before)


def test_real_cli_is_one_line_and_debug_gives_the_traceback(tmp_path, runs):
    """The installed entry point (a subprocess): exit status 2 and stderr the error line alone."""
    before = tree_checksums(tmp_path)
    result = run_module("longspec.export", runs / "stage1", runs, "--overwrite")
    assert result.returncode == 2
    assert_one_line_error(result.stderr, "is the run directory .* or contains it")
    result = run_module("longspec.export", runs / "stage1", runs, "--overwrite", "--debug")
    assert result.returncode == 1 and "Traceback" in result.stderr and "UserError" in result.stderr
    assert_only_changed(tmp_path, before)


def _export_is_whole(out) -> float:
    """OUT holds exactly a complete export; -> the step its filler tensor came from."""
    assert sorted(os.listdir(out)) == sorted(EXPORT_FILES | {MARKER_NAME})
    json.loads((out / "config.json").read_text())
    return float(load_file(out / "model.safetensors")["block.filler"][0])


def test_sigkill_mid_export_leaves_the_old_or_the_new_export(tmp_path):
    """Kill an `--overwrite` export at random instants (forked, so no interpreter start-up per kill): OUT_DIR is
    always the previous export or the new one, whole; the rerun completes and clears the killed runs' temps."""
    run = tmp_path / "run"
    _write_checkpoint(run, 2, big_numel=1 << 22)  # 16 MB: the writes take a while
    _write_checkpoint(run, 4, big_numel=1 << 22)
    out = tmp_path / "export"
    export_drafter(str(run), str(out), step=2)
    start = time.perf_counter()
    export_drafter(str(run), str(tmp_path / "timing"), step=4)
    duration = time.perf_counter() - start
    run_before = tree_checksums(run)
    rng = random.Random(0)
    for _ in range(5):
        pid = os.fork()
        if pid == 0:  # the child: one export, killed somewhere inside it
            try:
                export_drafter(str(run), str(out), step=4, overwrite=True)
            finally:
                os._exit(0)
        time.sleep(rng.uniform(0, duration))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        if _export_is_whole(out) == 4.0:  # the kill came after the swap: start from the old export again
            export_drafter(str(run), str(out), step=2, overwrite=True)
    export_drafter(str(run), str(out), step=4, overwrite=True)
    assert _export_is_whole(out) == 4.0
    leftovers = [p for p in os.listdir(tmp_path) if ".tmp-" in p or ".old-" in p]
    assert not leftovers, [(p, os.listdir(tmp_path / p)) for p in leftovers]
    assert_only_changed(run, run_before)  # the run itself was never written


def _dead_pid() -> int:
    """The pid of a process that has exited (a killed export's)."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


def test_a_removal_cut_short_leaves_a_directory_still_marked_ours(tmp_path, monkeypatch):
    """Removing an output takes the marker last: killed midway, what is left is still provably ours, and the next
    removal finishes it (a marker removed first left an unmarked folder that no later run may touch)."""
    folder = tmp_path / "export.tmp-1"
    (folder / "sub").mkdir(parents=True)
    write_marker(folder, "export")
    for name in ("a", "b", "sub/c"):
        (folder / name).write_text(name)
    real_remove, calls = os.remove, []

    def killed_on_the_second_file(path):
        calls.append(path)
        if len(calls) == 2:
            raise KeyboardInterrupt  # the kill
        real_remove(path)

    monkeypatch.setattr(os, "remove", killed_on_the_second_file)
    with pytest.raises(KeyboardInterrupt):
        remove_owned(folder, "export")
    monkeypatch.setattr(os, "remove", real_remove)
    assert is_ours(folder, "export")
    remove_owned(folder, "export")
    assert not folder.exists()


def test_an_export_killed_while_writing_its_marker_is_cleared_by_the_next(tmp_path):
    """An export killed between creating its temp folder and putting its marker in place leaves the marker's
    own temp file alone in it: the next export into the same OUT_DIR removes that folder; a folder of a dead
    pid that holds anything else without a marker is kept."""
    run = tmp_path / "run"
    _write_checkpoint(run, 2)
    out = tmp_path / "export"
    pid = _dead_pid()
    killed = tmp_path / f"export.tmp-{pid}"
    killed.mkdir()
    (killed / f"{MARKER_NAME}.tmp-{pid}").write_text('{"format": 1, "ki')
    users = tmp_path / f"export.old-{pid}"
    users.mkdir()
    (users / "notes.txt").write_text("the user's\n")
    export_drafter(str(run), str(out), step=2)
    assert sorted(os.listdir(out)) == sorted(EXPORT_FILES | {MARKER_NAME})
    assert not killed.exists()
    assert (users / "notes.txt").read_text() == "the user's\n"


@pytest.mark.parametrize(
    "value, extra", [(float("nan"), []), (1e10, ["--dtype", "float16"])], ids=["nan", "cast"]
)
def test_weights_that_are_not_numbers_are_not_exported(tmp_path, runs, capsys, value, extra):
    """A NaN in the checkpoint's weights, or a value the requested dtype turns into inf: one line naming the file
    and the tensor, no OUT_DIR (a NaN drafter loaded silently and proposed nothing, τ 1.00)."""
    weights_path = runs / "stage1" / "checkpoints" / "step_00000002" / "drafter" / "model.safetensors"
    weights = load_file(weights_path)
    name = sorted(weights)[0]
    weights[name].view(-1)[0] = value
    save_file(weights, weights_path, metadata={"format": "pt"})
    before = tree_checksums(tmp_path)
    status, err = run_in_process(main, [str(runs / "stage1"), str(tmp_path / "out"), *extra], capsys)
    assert status == 2
    cast = r" cast to float16" if extra else ""
    assert_one_line_error(
        err,
        rf"model\.safetensors{cast}: tensor '{name}' holds 1 NaN/inf value\(s\) of \d+: refusing to export",
    )
    assert_only_changed(tmp_path, before)
