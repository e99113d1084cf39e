"""The machine's own errors in plain words: a full disk (ENOSPC), a read-only folder (EROFS, or EACCES where chmod
stops this user) give one line `error: ...` naming the path, exit status 2, no temp file left; and a target whose
weights are pickles only is refused before anything loads them."""

from __future__ import annotations

import errno
import json
import os

import pytest
import torch
from fault_helpers import (
    FullDiskFile,
    assert_one_line_error,
    assert_only_changed,
    read_only,
    run_in_process,
    tree_checksums,
)

from data_prep import stage1
from longspec.cli import os_error_line, run_cli
from longspec.export import main as export_main

SAYS = {
    errno.ENOSPC: "no space left on the device",
    errno.EROFS: "read-only",
    errno.EACCES: "permission denied",
}


def _stage1_args(tmp_path, target_dir, out) -> list[str]:
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"text": f"row {i} " * 40}) + "\n" for i in range(20)))
    return ["--source", str(rows), "--tokenizer", target_dir, "--out", str(out), "--no-progress"]


def _no_temp_files(root) -> None:
    leftovers = [os.path.join(d, n) for d, dirs, files in os.walk(root) for n in dirs + files if ".tmp" in n]
    assert not leftovers, leftovers


# ---- data_prep ----------------------------------------------------------------------------------------------
def test_data_prep_on_a_full_disk_is_one_line_and_leaves_no_temp_file(
    tmp_path, target_dir, capsys, monkeypatch
):
    """The issue's case: `OSError: 20032 requested and 12288 written` and a `.tmp-PID` file left."""
    from longspec import atomic

    def shard_on_full_disk(path, *args, **kwargs):  # the shards' writes fail, the folder's marker goes in
        return (FullDiskFile if "shard_" in str(path) else open)(path, *args, **kwargs)

    monkeypatch.setattr(atomic, "open", shard_on_full_disk, raising=False)
    args = _stage1_args(tmp_path, target_dir, tmp_path / "out")
    before = tree_checksums(tmp_path)
    status, err = run_in_process(stage1.main, args, capsys)
    assert status == 2
    assert_one_line_error(err, r"no space left on the device at '.*/out/shard_00000\.tokens\.bin'")
    _no_temp_files(tmp_path)
    assert_only_changed(tmp_path, before, allowed=["out"])


def test_data_prep_into_a_read_only_folder_is_one_line(tmp_path, target_dir, capsys, monkeypatch):
    (tmp_path / "ro").mkdir()
    args = _stage1_args(tmp_path, target_dir, tmp_path / "ro" / "out")
    before = tree_checksums(tmp_path)
    with read_only(monkeypatch, tmp_path / "ro") as error:
        status, err = run_in_process(stage1.main, args, capsys)
    assert status == 2
    assert_one_line_error(err, SAYS[error] + r" at '.*/ro/out'")
    assert_only_changed(tmp_path, before)


# ---- export -------------------------------------------------------------------------------------------------
def test_export_on_a_full_disk_keeps_the_old_export_and_no_temp_dir(tmp_path, run_dir, capsys, monkeypatch):
    out = tmp_path / "export"
    assert run_in_process(export_main, [str(run_dir), str(out)], capsys)[0] == 0
    before = tree_checksums(tmp_path)

    def full(src, dst, *args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), dst)

    monkeypatch.setattr("longspec.export.shutil.copyfile", full)
    status, err = run_in_process(export_main, [str(run_dir), str(out), "--overwrite"], capsys)
    assert status == 2
    assert_one_line_error(err, r"no space left on the device at '.*/export\.tmp-\d+/config\.json'")
    assert_only_changed(tmp_path, before)  # the old export whole, no export.tmp-PID / export.old-PID


def test_export_into_a_read_only_folder_is_one_line(tmp_path, run_dir, capsys, monkeypatch):
    (tmp_path / "ro").mkdir()
    before = tree_checksums(tmp_path)
    with read_only(monkeypatch, tmp_path / "ro") as error:
        status, err = run_in_process(export_main, [str(run_dir), str(tmp_path / "ro" / "export")], capsys)
    assert status == 2
    assert_one_line_error(err, SAYS[error] + r" at '.*/ro/export\.tmp-\d+'")
    assert_only_changed(tmp_path, before)


def test_a_writer_that_hides_the_errno_is_probed(tmp_path, run_dir, capsys, monkeypatch):
    """safetensors' (and torch.save's) writers report a full disk without its errno: the folder is probed."""
    import builtins

    import safetensors.torch

    real_open = builtins.open

    def full_disk_open(file, mode="r", *args, **kwargs):
        if any(c in mode for c in "wax+"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.fspath(file))
        return real_open(file, mode, *args, **kwargs)

    def hidden(*args, **kwargs):
        monkeypatch.setattr(builtins, "open", full_disk_open)  # the disk is full from here on
        raise RuntimeError("Error while serializing: I/O error")

    monkeypatch.setattr(safetensors.torch, "save_file", hidden)
    before = tree_checksums(tmp_path)
    status, err = run_in_process(export_main, [str(run_dir), str(tmp_path / "export")], capsys)
    assert status == 2
    assert_one_line_error(err, rf"no space left on the device at '{tmp_path}'")
    assert_only_changed(tmp_path, before)  # no export.tmp-PID, no probe file


# ---- convert_gguf -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fault", ["full", "read_only"])
def test_convert_gguf_out_of_space_or_read_only_is_one_line(tmp_path, capsys, monkeypatch, fault):
    pytest.importorskip("gguf")
    from transformers import PreTrainedModel

    from longspec.convert_gguf import main as convert_main
    from longspec.testing import save_tiny_gguf

    save_tiny_gguf("llama", tmp_path / "tiny.gguf")
    (tmp_path / "ro").mkdir()
    before = tree_checksums(tmp_path)
    if fault == "full":

        def full(self, path, *args, **kwargs):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.path.join(path, "model.safetensors"))

        monkeypatch.setattr(PreTrainedModel, "save_pretrained", full)
        with pytest.raises(SystemExit) as exit_info:
            convert_main([str(tmp_path / "tiny.gguf"), str(tmp_path / "ro" / "hf")])
        pattern = r"no space left on the device at '.*/ro/hf\.tmp-\d+/model\.safetensors'"
    else:
        with read_only(monkeypatch, tmp_path / "ro") as error, pytest.raises(SystemExit) as exit_info:
            convert_main([str(tmp_path / "tiny.gguf"), str(tmp_path / "ro" / "hf")])
        pattern = SAYS[error] + r" at '.*/ro/hf\.tmp-\d+'"
    assert exit_info.value.code == 2
    assert_one_line_error(
        capsys.readouterr().err, pattern, exclusive=False
    )  # after the loader's progress bars
    assert_only_changed(tmp_path, before)


# ---- training checkpoints -----------------------------------------------------------------------------------
def test_a_checkpoint_save_on_a_full_disk_names_it_and_leaves_no_temp_dir(tmp_path, monkeypatch):
    """The issue's case: a traceback ending in `enforce fail at inline_container.cc`, and `.tmp-step` left."""
    import builtins

    from longspec.train.checkpoint import CheckpointManager

    manager = CheckpointManager(str(tmp_path / "run"), keep_last=2, rank=0)
    os.makedirs(manager.root)
    real_open = builtins.open

    def full_disk_open(file, mode="r", *args, **kwargs):
        if any(c in mode for c in "wax+"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.fspath(file))
        return real_open(file, mode, *args, **kwargs)

    class Engine:
        """torch.save's writer as it meets a full disk: half a file, then a RuntimeError without the errno."""

        def save_checkpoint(self, path, **kwargs):
            with open(os.path.join(path, "half.pt"), "wb") as f:
                f.write(b"x" * 100)
            monkeypatch.setattr(builtins, "open", full_disk_open)  # from here on the disk is full
            raise RuntimeError("[enforce fail at inline_container.cc:603] . unexpected pos 64 vs 12")

    with pytest.raises(OSError) as error:
        manager.save(1, Engine(), lambda d: None, {})
    assert error.value.errno == errno.ENOSPC
    assert os_error_line(error.value).startswith(f"no space left on the device at '{manager.root}'")
    assert os.listdir(manager.root) == []  # no .tmp-step_00000001, no probe file


# ---- eval, the pipeline, any CLI ----------------------------------------------------------------------------
def test_eval_into_a_read_only_folder_is_one_line(tmp_path, target_dir, capsys, monkeypatch):
    from longspec.eval.__main__ import main as eval_main

    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"_id": "r", "context": "def f(x):\n    return x\n" * 3, "input": ""}) + "\n")
    (tmp_path / "ro").mkdir()
    overrides = ["target=tiny_llama", f"target.path={target_dir}", f"data.path={data}", "method=ar",
                 "data.min_prompt_tokens=0", "max_new_tokens=2", "warmup=false",
                 f"output_dir={tmp_path / 'ro' / 'out'}"]  # fmt: skip
    before = tree_checksums(tmp_path)
    with read_only(monkeypatch, tmp_path / "ro") as error:
        status, err = run_in_process(eval_main, overrides, capsys)
    assert status == 2
    assert_one_line_error(err, SAYS[error] + r" at '.*/ro/out", exclusive=False)
    assert_only_changed(tmp_path, before)


def test_pipeline_into_a_read_only_folder_is_one_line(tmp_path, capsys, monkeypatch):
    from longspec.pipeline.__main__ import main as pipeline_main

    (tmp_path / "ro").mkdir()
    before = tree_checksums(tmp_path)
    with read_only(monkeypatch, tmp_path / "ro") as error:
        status, err = run_in_process(
            pipeline_main, ["--preset", "cpu", "--out", str(tmp_path / "ro" / "e2e")], capsys
        )
    assert status == 2
    assert_one_line_error(err, SAYS[error] + r" at '.*/ro/e2e'")
    assert_only_changed(tmp_path, before)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES])
def test_every_cli_says_the_machines_error_in_one_line(capsys, code):
    def command(argv):
        raise OSError(code, os.strerror(code), "/data/out/shard_00000.tokens.bin")

    assert run_cli(command, []) == 2
    line = capsys.readouterr().err
    assert (
        line.count("\n") == 1 and line.startswith("error: ") and "'/data/out/shard_00000.tokens.bin'" in line
    )


def test_another_os_error_keeps_its_traceback():
    def command(argv):
        raise OSError(errno.EIO, "Input/output error")

    with pytest.raises(OSError, match="Input/output error"):
        run_cli(command, [])


# ---- targets only from safe formats -------------------------------------------------------------------------
@pytest.fixture
def pickle_target(tmp_path, target_dir):
    """The tiny target with its weights as pytorch_model.bin only (no safetensors)."""
    import shutil

    from safetensors.torch import load_file

    folder = tmp_path / "pickle_target"
    shutil.copytree(target_dir, folder)
    torch.save(load_file(folder / "model.safetensors"), folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    return folder


def _no_unpickling(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("torch.load was called on a pickle target")

    monkeypatch.setattr(torch, "load", refuse)


def test_eval_refuses_a_pickle_target_before_loading_it(tmp_path, pickle_target, capsys, monkeypatch):
    from longspec.eval.__main__ import main as eval_main

    _no_unpickling(monkeypatch)
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"_id": "r", "context": "def f(x):\n    return x\n" * 3, "input": ""}) + "\n")
    overrides = ["target=tiny_llama", f"target.path={pickle_target}", f"data.path={data}", "method=ar",
                 "data.min_prompt_tokens=0", "max_new_tokens=2", "warmup=false", f"output_dir={tmp_path / 'out'}"]  # fmt: skip
    before = tree_checksums(tmp_path)
    status, err = run_in_process(eval_main, overrides, capsys)
    assert status == 2
    assert_one_line_error(
        err,
        r"holds only pickle weights \(pytorch_model\.bin\).*save_pretrained\(DIR, safe_serialization=True\)",
        exclusive=False,
    )
    assert_only_changed(tmp_path, before, allowed=["out"])


def test_a_sharded_pickle_target_is_refused_too(pickle_target, monkeypatch):
    from longspec.target import TargetModel

    _no_unpickling(monkeypatch)
    (pickle_target / "pytorch_model.bin").rename(pickle_target / "pytorch_model-00001-of-00001.bin")
    (pickle_target / "pytorch_model.bin.index.json").write_text('{"weight_map": {}}')
    with pytest.raises(ValueError, match=r"holds only pickle weights \(pytorch_model-00001-of-00001\.bin"):
        TargetModel.from_pretrained(str(pickle_target), dtype=torch.float32)
