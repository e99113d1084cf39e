"""Ownership before deletion (longspec.ownership): every command that removes or replaces an output removes only
what this project wrote there, proven by its `.longspec` marker; a user's folder is refused with one line,
`--overwrite` or not, and nothing is removed through a symlink."""

from __future__ import annotations

import json
import os

import pytest
from fault_helpers import (
    REPO_ROOT,
    assert_one_line_error,
    assert_only_changed,
    run_in_process,
    run_module,
    tree_checksums,
)

from data_prep import stage1
from longspec.convert_gguf import main as convert_main
from longspec.export import main as export_main
from longspec.ownership import MARKER_NAME, NotOursError, read_marker, write_marker
from longspec.pipeline.__main__ import main as pipeline_main
from longspec.pipeline.plan import COMMAND_MARKER, _prepare_partial_output, _prepare_run_dir
from longspec.train.checkpoint import RUN_KIND

NOT_OURS = r"is not empty and was not written by longspec \(no \.longspec marker\)"


def _user_folder(path, files=("README.md",)):
    """A user's folder: their files, no marker."""
    path.mkdir(parents=True, exist_ok=True)
    for name in files:
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(f"the user's {name}\n")
    return path


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    pytest.importorskip("gguf")
    from longspec.testing import save_tiny_gguf

    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    save_tiny_gguf("llama", path)
    return path


def _rows(tmp_path) -> str:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"text": f"row {i} " * 40}) + "\n" for i in range(20)))
    return str(path)


# ---- export -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["README.md", "config.json"])
@pytest.mark.parametrize("overwrite", [False, True])
def test_export_never_replaces_a_users_folder(tmp_path, run_dir, capsys, name, overwrite):
    """The issue's case: OUT holding only a user's README.md (or config.json) was deleted by --overwrite."""
    home = _user_folder(tmp_path / "home", [name])
    before = tree_checksums(tmp_path)
    status, err = run_in_process(export_main, [str(run_dir), str(home), *["--overwrite"] * overwrite], capsys)
    assert status == 2
    assert_one_line_error(err, NOT_OURS)
    assert_only_changed(tmp_path, before)


def test_export_keeps_a_file_the_user_put_in_an_earlier_export(tmp_path, run_dir, capsys):
    out = tmp_path / "export"
    assert run_in_process(export_main, [str(run_dir), str(out)], capsys)[0] == 0
    (out / "notes.txt").write_text("mine\n")
    before = tree_checksums(tmp_path)
    status, err = run_in_process(export_main, [str(run_dir), str(out), "--overwrite"], capsys)
    assert status == 2
    assert_one_line_error(err, r"also holds \['notes\.txt'\], which longspec did not write there")
    assert_only_changed(tmp_path, before)


def test_export_onto_another_kind_of_output_is_refused(tmp_path, run_dir, capsys):
    data = _user_folder(tmp_path / "data", ["manifest.json"])
    write_marker(data, "data")
    before = tree_checksums(tmp_path)
    status, err = run_in_process(export_main, [str(run_dir), str(data), "--overwrite"], capsys)
    assert status == 2
    assert_one_line_error(err, r"holds another longspec output \(data, not export\)")
    assert_only_changed(tmp_path, before)


def test_export_onto_a_symlink_replaces_its_target_and_keeps_the_link(tmp_path, run_dir, capsys):
    """The issue's case: the link was replaced by a folder and a stray OUT.old-PID link was left."""
    real = tmp_path / "store" / "export"
    real.parent.mkdir()
    assert run_in_process(export_main, [str(run_dir), str(real)], capsys)[0] == 0
    link = tmp_path / "export"
    link.symlink_to(real)
    first = (real / "model.safetensors").read_bytes()
    status, _ = run_in_process(
        export_main, [str(run_dir), str(link), "--overwrite", "--dtype", "float16"], capsys
    )
    assert status == 0
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert (real / "model.safetensors").read_bytes() != first  # the new export, in the link's target
    assert sorted(os.listdir(tmp_path)) == ["export", "store"]  # no export.old-PID, no export.tmp-PID
    assert sorted(os.listdir(real.parent)) == ["export"]


# ---- convert_gguf -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overwrite", [False, True])
def test_convert_gguf_never_replaces_a_users_folder(tmp_path, gguf_file, capsys, overwrite):
    """The issue's case: `convert_gguf SRC DIR --overwrite` deleted any existing DIR whole."""
    home = _user_folder(tmp_path / "project", ["main.py", "src/lib.py"])
    before = tree_checksums(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        convert_main([str(gguf_file), str(home), *["--overwrite"] * overwrite])
    assert exit_info.value.code == 2
    assert_one_line_error(capsys.readouterr().err, NOT_OURS)
    assert_only_changed(tmp_path, before)


def test_convert_gguf_replaces_its_own_output_through_a_symlink(tmp_path, gguf_file, capsys):
    real = tmp_path / "store" / "hf"
    real.parent.mkdir()
    convert_main([str(gguf_file), str(real)])
    assert read_marker(real)["kind"] == "converted target"
    link = tmp_path / "hf"
    link.symlink_to(real)
    convert_main([str(gguf_file), str(link), "--overwrite", "--dtype", "float16"])
    assert link.is_symlink() and json.loads((real / "config.json").read_text())["dtype"] == "float16"
    assert sorted(os.listdir(tmp_path)) == ["hf", "store"] and sorted(os.listdir(real.parent)) == ["hf"]
    (real / "notes.txt").write_text(
        "mine\n"
    )  # a user's file added to the conversion: no longer replaced whole
    before = tree_checksums(tmp_path)
    capsys.readouterr()
    with pytest.raises(SystemExit):
        convert_main([str(gguf_file), str(link), "--overwrite"])
    assert_one_line_error(capsys.readouterr().err, r"also holds \['notes\.txt'\]")
    assert_only_changed(tmp_path, before)


def test_convert_gguf_onto_another_kind_of_output_is_refused(tmp_path, gguf_file, capsys):
    run = _user_folder(tmp_path / "run", ["train.log", "checkpoints/step_00000001/trainer_state.json"])
    write_marker(run, RUN_KIND)
    before = tree_checksums(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        convert_main([str(gguf_file), str(run), "--overwrite"])
    assert exit_info.value.code == 2
    assert_one_line_error(
        capsys.readouterr().err, r"holds another longspec output \(training run, not converted"
    )
    assert_only_changed(tmp_path, before)


def test_code_target_training_never_replaces_a_users_folder(tmp_path, capsys):
    """`python -m longspec.pipeline.code_target --out CKPT` replaced CKPT whole after training: now refused first."""
    from longspec.pipeline.code_target.__main__ import main as code_target_main

    home = _user_folder(tmp_path / "ckpt", ["config.json", "notes.md"])
    argv = [
        "--tokenizer",
        str(tmp_path / "tok"),
        "--tokens-dir",
        str(tmp_path / "tokens"),
        "--out",
        str(home),
    ]
    before = tree_checksums(tmp_path)
    status, err = run_in_process(code_target_main, argv, capsys)
    assert status == 2
    assert_one_line_error(err, "--out .*" + NOT_OURS)
    assert_only_changed(tmp_path, before)


# ---- data_prep ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overwrite", [False, True])
def test_stage1_never_deletes_a_users_shards_temps_or_manifest(tmp_path, target_dir, capsys, overwrite):
    """The issue's case: without --overwrite, every shard_*, *.tmp-* and an unparsable manifest.json went."""
    out = _user_folder(tmp_path / "mine", ["shard_a.txt", "shard_dir/x.py", "notes.tmp-1", "manifest.json"])
    args = ["--source", _rows(tmp_path), "--tokenizer", target_dir, "--out", str(out), "--no-progress"]
    before = tree_checksums(tmp_path)
    status, err = run_in_process(stage1.main, [*args, *["--overwrite"] * overwrite], capsys)
    assert status == 2
    assert_one_line_error(err, NOT_OURS)
    assert_only_changed(tmp_path, before)


def test_stage1_rerun_removes_only_its_own_files(tmp_path, target_dir, capsys):
    """In its own folder a rerun replaces its shards and manifest; a user's file there and the file a shard-named
    symlink points to stay as they are."""
    out = tmp_path / "out"
    args = ["--source", _rows(tmp_path), "--tokenizer", target_dir, "--out", str(out), "--no-progress"]
    assert run_in_process(stage1.main, args, capsys)[0] == 0
    (out / "notes.txt").write_text("mine\n")
    outside = _user_folder(tmp_path / "elsewhere", ["keep.bin"])
    (out / "shard_00007.tokens.bin").symlink_to(outside / "keep.bin")
    before = tree_checksums(tmp_path)
    assert run_in_process(stage1.main, [*args, "--overwrite"], capsys)[0] == 0
    assert not (out / "shard_00007.tokens.bin").is_symlink()  # the link went, not its target
    assert_only_changed(tmp_path, before, allowed=["out/manifest.json", "out/shard_00007.tokens.bin"])


def test_a_data_prep_into_another_outputs_folder_is_refused(tmp_path, target_dir, capsys):
    corpus = _user_folder(tmp_path / "corpus", ["train.jsonl"])
    write_marker(corpus, "corpus")
    args = ["--source", _rows(tmp_path), "--tokenizer", target_dir, "--out", str(corpus), "--no-progress"]
    before = tree_checksums(tmp_path)
    status, err = run_in_process(stage1.main, [*args, "--overwrite"], capsys)
    assert status == 2
    assert_one_line_error(err, r"holds another longspec output \(corpus, not data\)")
    assert_only_changed(tmp_path, before)


def test_stdlib_corpus_never_writes_into_a_users_folder(tmp_path, capsys):
    from data_prep import stdlib_corpus
    from longspec.cli import run_cli

    root = _user_folder(tmp_path / "src", ["a.py"])
    out = _user_folder(tmp_path / "mine", ["train.jsonl", "manifest.json"])
    before = tree_checksums(tmp_path)
    argv = ["--root", str(root), "--out", str(out)]
    status, err = run_in_process(
        lambda a: run_cli(stdlib_corpus.main, a), argv, capsys
    )  # as its __main__ does
    assert status == 2
    assert_one_line_error(err, NOT_OURS)
    assert_only_changed(tmp_path, before)


# ---- the trainer and eval ------------------------------------------------------------------------------------
def test_the_trainer_never_writes_into_a_users_folder(tmp_path, target_dir, capsys):
    from data_prep.common import load_tokenizer
    from data_prep.stage1 import prepare_stage1

    prepare_stage1(source=_rows(tmp_path), tokenizer=load_tokenizer(target_dir), out=str(tmp_path / "d1"),
                   seq_len=64, progress=False)  # fmt: skip
    home = _user_folder(tmp_path / "home", ["checkpoints/step_00000001/notes.txt", "metrics.jsonl"])
    before = tree_checksums(tmp_path)
    result = run_module(
        "longspec.train", "stage=tiny_stage1", "target=tiny_llama", f"target.path={target_dir}",
        f"data.path={tmp_path / 'd1'}", f"output_dir={home}", "max_steps=1",
        env={"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}, timeout=300,
    )  # fmt: skip
    assert result.returncode == 2
    assert_one_line_error(result.stderr, "output_dir .*" + NOT_OURS)
    assert_only_changed(tmp_path, before)


def test_eval_never_writes_into_a_users_folder(tmp_path, target_dir, capsys):
    from longspec.eval.__main__ import main as eval_main

    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"_id": "r", "context": "def f(x):\n    return x\n" * 3, "input": ""}) + "\n")
    home = _user_folder(tmp_path / "home", ["results.json", "report.md"])
    before = tree_checksums(tmp_path)
    overrides = ["target=tiny_llama", f"target.path={target_dir}", f"data.path={data}", "method=ar",
                 "max_new_tokens=2", "warmup=false", f"output_dir={home}"]  # fmt: skip
    status, err = run_in_process(eval_main, overrides, capsys)
    assert status == 2
    assert_one_line_error(err, "output_dir .*" + NOT_OURS, exclusive=False)
    assert_only_changed(tmp_path, before)


# ---- the pipeline -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "layout", ["runs/stage1/model.bin", "data/stage1/shard_00000.tokens.bin", "report.md"]
)
def test_pipeline_never_runs_in_a_users_folder(tmp_path, capsys, layout):
    """The issue's case: a user's DIR/runs/stage1/..., DIR/data/stage1/... were deleted, report.md overwritten."""
    home = _user_folder(tmp_path / "home", [layout, "eval/results.json", "manifest.json"])
    before = tree_checksums(tmp_path)
    status, err = run_in_process(pipeline_main, ["--preset", "cpu", "--out", str(home)], capsys)
    assert status == 2
    assert_one_line_error(err, "--out .*" + NOT_OURS)
    assert_only_changed(tmp_path, before)


def test_pipeline_refuses_an_output_of_another_kind(tmp_path, capsys):
    export = _user_folder(tmp_path / "export", ["config.json"])
    write_marker(export, "export")
    before = tree_checksums(tmp_path)
    status, err = run_in_process(
        pipeline_main, ["--preset", "cpu", "--out", str(export), "--dry-run"], capsys
    )
    assert status == 2
    assert_one_line_error(err, r"holds another longspec output \(export, not pipeline\)")
    assert_only_changed(tmp_path, before)


def test_pipeline_run_dir_reached_through_a_symlink_is_never_removed(tmp_path):
    """The issue's case: with DIR/runs a symlink to the user's data, the files were deleted through the link."""
    out = tmp_path / "out"
    write_marker(_user_folder(out, []), "pipeline")
    data = _user_folder(tmp_path / "userdata", ["stage1/train.log", "stage1/checkpoints/x.pt"])
    write_marker(data / "stage1", RUN_KIND)  # even a folder marked as a run: not through a link
    (out / "runs").symlink_to(data)
    before = tree_checksums(tmp_path)
    with pytest.raises(NotOursError, match="is reached through a symlink"):
        _prepare_run_dir(str(out / "runs" / "stage1"), "cmd", False, [])()
    assert_only_changed(tmp_path, before)


def test_pipeline_run_dir_without_a_marker_is_never_removed(tmp_path):
    out = tmp_path / "out"
    write_marker(_user_folder(out, []), "pipeline")
    _user_folder(out / "runs" / "stage1", ["checkpoints/step_00000001/notes.txt"])
    before = tree_checksums(tmp_path)
    with pytest.raises(NotOursError, match=NOT_OURS):
        _prepare_run_dir(str(out / "runs" / "stage1"), "cmd", False, [])()
    assert_only_changed(tmp_path, before)
    marked = out / "runs" / "stage2"  # one the pipeline marked is restarted from scratch
    _user_folder(marked, ["train.log"])
    write_marker(marked, RUN_KIND)
    _prepare_run_dir(str(marked), "cmd2", False, [])()
    assert sorted(os.listdir(marked)) == sorted([MARKER_NAME, COMMAND_MARKER])


def test_pipeline_partial_output_it_did_not_write_is_kept(tmp_path):
    path = tmp_path / "data" / "stage3_regenerated.jsonl"
    _user_folder(path.parent, [path.name])
    before = tree_checksums(tmp_path)
    with pytest.raises(NotOursError, match="was not written by the pipeline"):
        _prepare_partial_output(str(path), "cmd")()
    assert_only_changed(tmp_path, before)


# ---- data_prep commands whose output is one file -------------------------------------------------------------
def _corpus(tmp_path):
    """A corpus folder as registry_corpus writes it: train.jsonl rows with source / kind / path / text."""
    rows = [{"text": f"def f{i}(x):\n    return x + {i}\n" * 60, "source": "pkg", "kind": "code",
             "path": f"pkg/m{i}.py", "licence": "MIT"} for i in range(6)]  # fmt: skip
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return corpus


def _one_file_commands(tmp_path, out):
    from data_prep import instruct_prompts, long_documents

    code_target = str(REPO_ROOT / "longspec" / "assets" / "code_target")  # a tokenizer with a chat template
    corpus = str(_corpus(tmp_path))
    return {
        "instruct_prompts": (instruct_prompts.main, ["--corpus", corpus, "--tokenizer", code_target,
                             "--out", str(out), "--min-prompt-tokens", "16", "--num-prompts", "2"]),
        "long_documents": (long_documents.main, ["--corpus", corpus, "--tokenizer", code_target,
                           "--out", str(out), "--min-tokens", "16", "--max-tokens", "400"]),
    }  # fmt: skip


@pytest.mark.parametrize("command", ["instruct_prompts", "long_documents"])
def test_a_one_file_output_never_replaces_a_users_file(tmp_path, capsys, command):
    """--out naming a user's existing file (or a symlink to one) is refused, the file and its target untouched;
    the command's own earlier output (its `.NAME.longspec` beside it) is replaced."""
    users = _user_folder(tmp_path / "mine", ["prompts.jsonl"]) / "prompts.jsonl"
    link = tmp_path / "link.jsonl"
    link.symlink_to(users)
    for out in (users, link):
        (tmp_path / "w" / out.name).mkdir(parents=True)
        main, args = _one_file_commands(tmp_path / "w" / out.name, out)[command]
        before = tree_checksums(tmp_path / "mine")
        status, err = run_in_process(main, args, capsys)
        assert status == 2
        assert_one_line_error(err, r"exists and was not written by this longspec command")
        assert tree_checksums(tmp_path / "mine") == before and os.path.islink(link)
    ours = tmp_path / "ours.jsonl"
    (tmp_path / "again").mkdir()
    main, args = _one_file_commands(tmp_path / "again", ours)[command]
    assert run_in_process(main, args, capsys)[0] == 0 and ours.stat().st_size > 0
    assert run_in_process(main, args, capsys)[0] == 0  # a rerun replaces its own output


def test_the_pipelines_prefix_prompts_never_replace_a_users_file(tmp_path):
    from data_prep.prefix_prompts import write_prefix_prompts

    train = tmp_path / "train.jsonl"
    train.write_text(
        "".join(json.dumps({"text": "x = 1\n" * 200, "path": f"m{i}.py"}) + "\n" for i in range(4))
    )
    users = _user_folder(tmp_path / "mine", ["prompts.jsonl"]) / "prompts.jsonl"
    before = tree_checksums(tmp_path)
    with pytest.raises(NotOursError, match="exists and was not written by this longspec command"):
        write_prefix_prompts(str(train), str(users), num_prompts=2, max_chars=400)
    assert tree_checksums(tmp_path) == before
    ours = tmp_path / "out" / "prompts.jsonl"
    assert write_prefix_prompts(str(train), str(ours), num_prompts=2, max_chars=400) == 2
    assert write_prefix_prompts(str(train), str(ours), num_prompts=2, max_chars=400) == 2
