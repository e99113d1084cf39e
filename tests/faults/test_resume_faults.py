"""A training resume on inputs that changed, a run directory whose state is damaged, numbers that are not numbers.

One tiny run (2 steps, a checkpoint each) is trained on data and a target of its own, which the cases change in
place (and put back): a resume on other data, another target or another trained config field is refused with
one line naming the change, a damaged state file is refused naming the file, before anything is parsed that the
checksums did not vouch for, and a refused resume leaves every file as it was (metrics.jsonl and the checkpoints
byte for byte). The pipeline restarts such a stage instead, saying so. NaN drafters are refused before the target
loads; a diverging run stops after max_nonfinite_steps and never saves NaN weights.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import test_train_faults
import torch
from fault_helpers import assert_one_line_error, assert_only_changed, run_module, tree_checksums
from safetensors.torch import load_file, save_file

from longspec.ownership import MARKER_NAME
from longspec.train.checkpoint import write_checksums

pytestmark = [pytest.mark.slow]

world = test_train_faults.world  # the fixture of the tiny target and data (a module of their own here)
_env = test_train_faults._env

STEPS = 2


def _run_args(world: Path, out: str, *extra: str) -> list[str]:
    return [
        "stage=tiny_stage1",
        "target=tiny_llama",
        f"target.path={world / 'target_mut'}",
        f"data.path={world / 'd_mut'}",
        f"output_dir={world / out}",
        f"max_steps={STEPS}",
        "checkpoint.save_every=1",
        *extra,
    ]


def _train(world: Path, out: str, *extra: str):
    return run_module("longspec.train", *_run_args(world, out, *extra), env=_env(), timeout=300)


def _prep(world: Path, lines: list[str], out: str) -> None:
    from data_prep.common import load_tokenizer
    from data_prep.stage1 import prepare_stage1

    (world / "mut.jsonl").write_text("".join(lines))
    prepare_stage1(
        source=str(world / "mut.jsonl"),
        tokenizer=load_tokenizer(str(world / "tiny_llama")),
        out=str(world / out),
        seq_len=64,
        progress=False,
        overwrite=True,
    )


@pytest.fixture(scope="module")
def run(world) -> Path:
    """world/run_mut: 2 steps on world/d_mut and world/target_mut, which the cases change in place."""
    shutil.copytree(world / "tiny_llama", world / "target_mut")
    _prep(world, (world / "short.jsonl").read_text().splitlines(keepends=True), "d_mut")
    shutil.copytree(world / "d_mut", world / "d_mut_orig")
    result = _train(world, "run_mut")
    assert result.returncode == 0, result.stderr[-3000:]
    return world / "run_mut"


@pytest.fixture
def restore(world):
    """Puts the run's data and target back as they were after a case changed them."""
    target_config = (world / "target_mut" / "config.json").read_text()
    yield
    (world / "target_mut" / "config.json").write_text(target_config)
    if (world / "d_mut" / "manifest.json").read_bytes() != (
        world / "d_mut_orig" / "manifest.json"
    ).read_bytes():
        shutil.rmtree(world / "d_mut")
        shutil.copytree(world / "d_mut_orig", world / "d_mut")


def _copy(run: Path, name: str) -> Path:
    copy = run.parent / name
    if copy.exists():
        shutil.rmtree(copy)
    shutil.copytree(run, copy)
    return copy


def _assert_refused(world: Path, out: str, pattern: str, *extra: str) -> None:
    """A launch on `out` exits 2 with one line matching `pattern`, and not a byte of the world changed (the run's
    metrics.jsonl and checkpoints included)."""
    before = tree_checksums(world)
    result = _train(world, out, *extra)
    assert result.returncode == 2, result.stderr[-3000:]
    assert_one_line_error(result.stderr, pattern)
    assert_only_changed(world, before)


# ---- resume only on the same inputs -----------------------------------------------------------------------------
def _fewer_rows(world: Path) -> None:
    _prep(world, (world / "short.jsonl").read_text().splitlines(keepends=True)[:60], "d_mut")


def _other_content(world: Path) -> None:
    # The same documents in another order: as many tokens, so as many packed rows, other rows.
    _prep(world, (world / "short.jsonl").read_text().splitlines(keepends=True)[::-1], "d_mut")


def _other_rope(world: Path) -> None:
    path = world / "target_mut" / "config.json"
    config = json.loads(path.read_text())
    config["rope_theta"] = 1234.0
    config.get("rope_parameters", {})["rope_theta"] = 1234.0
    path.write_text(json.dumps(config))


@pytest.mark.parametrize(
    "change, pattern",
    [
        (
            _fewer_rows,
            r"holds another run \(step 2\): data.rows \d+ -> \d+; data.manifest_sha256 \w{12} -> \w{12};",
        ),
        (
            _other_content,
            r"holds another run \(step 2\): data.manifest_sha256 \w{12} -> \w{12}; pass resume.force",
        ),
        (_other_rope, r"target.rope_parameters \{.*\} -> \{.*1234.*\}; pass resume.force=true"),
    ],
    ids=["data_rows", "data_content", "target_config"],
)
def test_resume_on_changed_data_or_target_is_refused(world, run, restore, change, pattern):
    change(world)
    _assert_refused(world, run.name, pattern)


def _check_resume(world: Path, out: str, *extra: str):
    """What the trainer runs on rank 0 under the run's lock before anything loads (`Trainer._check_resume`), in this
    process: the launches above show its refusal is one line and exit status 2."""
    from longspec.train.config import load_config
    from longspec.train.trainer import Trainer

    cfg = load_config(_run_args(world, out, *extra))
    return Trainer._check_resume(SimpleNamespace(cfg=cfg, run_dir=str(world / out), world_size=1))


@pytest.mark.parametrize(
    "override, pattern",
    [
        ("stage.num_anchors=2", r"stage.num_anchors 4 -> 2"),
        ("stage.global_batch_size=4", r"stage.global_batch_size 8 -> 4"),
        ("data.shuffle=false", r"data.shuffle True -> False"),
        ("optim.lr=0.02", r"optim.lr 0.01 -> 0.02"),
        ("drafter.window=4", r"drafter.window \d+ -> 4"),
        ("loss.distill_weight=0.5", r"loss.distill_weight 0.0 -> 0.5"),
        ("deepspeed.zero_stage=2", r"deepspeed.zero_stage 1 -> 2"),
        ("seed=7", r"seed 0 -> 7"),
    ],
)
def test_resume_with_another_trained_config_field_is_refused(world, run, override, pattern):
    before = tree_checksums(world)
    with pytest.raises(ValueError, match=rf"holds another run \(step 2\): {pattern}; pass resume.force=true"):
        _check_resume(world, run.name, override)
    assert_only_changed(world, before)


def test_resume_extends_the_run_and_changes_its_logging(world, run):
    """The fields left out of the fingerprint: a longer schedule and another log interval resume as before."""
    copy = _copy(run, "run_extended")
    result = _train(world, copy.name, f"max_steps={STEPS + 1}", "logging.log_every=2", "loss.backend=torch")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resumed from {copy / 'checkpoints' / 'step_00000002'} at step 2" in result.stderr
    assert [json.loads(line)["step"] for line in (copy / "metrics.jsonl").read_text().splitlines()] == [
        1,
        2,
        3,
    ]


def test_the_pipeline_restarts_a_stage_whose_data_changed(world, run, restore, capsys):
    """A pipeline rerun whose prep re-prepared the data in place: the trainer would refuse the run directory, so
    the stage restarts from scratch with one line; with the same data the run directory is kept as it is."""
    from longspec.pipeline.plan import COMMAND_MARKER, _prepare_run_dir

    copy = _copy(run, "run_pipeline")
    overrides = _run_args(world, copy.name)
    (copy / COMMAND_MARKER).write_text("the command")
    prepare = _prepare_run_dir(str(copy), "the command", True, overrides)
    kept = tree_checksums(copy)
    prepare()
    assert tree_checksums(copy) == kept and "restarts" not in capsys.readouterr().out
    _fewer_rows(world)
    prepare()
    out = capsys.readouterr().out
    assert f"{copy}: trained on other inputs (data.rows " in out and "the stage restarts from scratch" in out
    assert sorted(os.listdir(copy)) == sorted([COMMAND_MARKER, MARKER_NAME])  # a fresh run dir, marked ours


# ---- state checked before it is trusted --------------------------------------------------------------------------
def _latest(copy: Path) -> Path:
    return copy / "checkpoints" / f"step_{STEPS:08d}"


def _state(text: str, *, resum: bool):
    def damage(copy: Path) -> None:
        (_latest(copy) / "trainer_state.json").write_text(text)
        if resum:  # the checksums rewritten to match: the state itself must be refused by name
            write_checksums(str(_latest(copy)))

    return damage


def _drop_bytes(copy: Path) -> None:
    path = _latest(copy) / "checksums.json"
    manifest = json.loads(path.read_text())
    del manifest["files"]["trainer_state.json"]["bytes"]
    path.write_text(json.dumps(manifest))


def _state_without(key: str):
    def damage(copy: Path) -> None:
        path = _latest(copy) / "trainer_state.json"
        state = json.loads(path.read_text())
        del state[key]
        path.write_text(json.dumps(state))
        write_checksums(str(_latest(copy)))

    return damage


def _no_state(*steps: int):
    def damage(copy: Path) -> None:
        for step in steps:
            (copy / "checkpoints" / f"step_{step:08d}" / "trainer_state.json").unlink()

    return damage


DAMAGES = {
    "garbage": (
        _state("garbage{", resum=True),
        r"step_00000002/trainer_state.json is not valid JSON \(Expecting",
    ),
    "list": (
        _state("[1, 2]", resum=True),
        r"step_00000002/trainer_state.json is not a JSON object; the checkpoint",
    ),
    "garbage_unsummed": (
        _state("garbage{", resum=False),
        r"step_00000002/trainer_state.json does not match its",
    ),
    "no_bytes": (
        _drop_bytes,
        r"step_00000002/checksums.json is not a valid checksum manifest \(the entry of ",
    ),
    "no_world_size": (
        _state_without("world_size"),
        r"trainer_state.json has no integer 'world_size'; the checkpoint",
    ),
    "no_inputs": (
        _state_without("inputs"),
        r"the checkpoint records no inputs \(written by an older longspec\); pass",
    ),
    "no_state_anywhere": (
        _no_state(1, 2),
        r"step_00000002/trainer_state.json is missing \(listed in checksums",
    ),
    "no_latest_state": (
        _no_state(2),
        r"step_00000002/trainer_state.json is missing \(listed in checksums.json\)",
    ),
}


@pytest.mark.parametrize("case", ["garbage_unsummed", "no_state_anywhere", "no_latest_state"])
def test_a_damaged_state_is_refused_by_name_and_nothing_changes(world, run, case):
    """Never parsed before its checksum matched, never a traceback, never a silent restart over the run's
    metrics (all checkpoints without a state) or a silent resume from an older checkpoint (the latest without
    one): metrics.jsonl and the checkpoints stay byte-identical."""
    damage, pattern = DAMAGES[case]
    copy = _copy(run, "run_damaged")
    damage(copy)
    _assert_refused(world, copy.name, pattern)


@pytest.mark.parametrize("case", ["garbage", "list", "no_bytes", "no_world_size", "no_inputs"])
def test_a_malformed_state_file_is_one_error_naming_it(world, run, case):
    damage, pattern = DAMAGES[case]
    copy = _copy(run, "run_malformed")
    damage(copy)
    before = tree_checksums(world)
    with pytest.raises(ValueError, match=pattern):  # CheckpointError: one line, exit status 2 at the CLI
        _check_resume(world, copy.name)
    assert_only_changed(world, before)


# ---- numbers that are not numbers --------------------------------------------------------------------------------
def test_init_from_a_nan_drafter_is_refused_before_the_target_loads(world, run):
    drafter = world / "drafter_nan"
    if drafter.exists():
        shutil.rmtree(drafter)
    shutil.copytree(_latest(run) / "drafter", drafter)
    weights = load_file(drafter / "model.safetensors")
    name = sorted(weights)[0]
    weights[name].view(-1)[0] = float("nan")
    save_file(weights, drafter / "model.safetensors", metadata={"format": "pt"})
    _assert_refused(
        world,
        "run_from_nan",
        rf"{drafter / 'model.safetensors'}: tensor '{name}' holds 1 NaN/inf value\(s\) of \d+: refusing to start from",
        f"init_from={drafter}",
    )


def test_a_diverging_run_stops_after_max_nonfinite_steps(world, run):
    """lr 1e30: the first update throws the weights to 1e30, every later loss is inf / nan. The run saves every
    step, but not one whose loss is not finite: it stops at the third such step, with one line, and its latest
    checkpoint is step 1's, from before it diverged."""
    out = world / "run_diverged"
    result = _train(world, out.name, "optim.lr=1e30", "max_steps=8")
    assert result.returncode == 2, result.stderr[-3000:]
    assert_one_line_error(
        result.stderr,
        r"training stopped at step 4: the loss or gradient norm was not finite for 3 consecutive steps .*the latest "
        r"checkpoint is step_00000001: lower optim.lr",
        exclusive=False,  # the run's own log lines come first
    )
    assert os.listdir(out / "checkpoints") == ["step_00000001"]
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 4  # every step it ran is logged


def test_nan_weights_are_never_checkpointed(world, run):
    """The check `Trainer.save` runs before a checkpoint is written, on a drafter with one NaN weight: the run stops
    with one line naming the tensor and the checkpoint it keeps."""
    from longspec.drafter import Drafter
    from longspec.target import TargetModel
    from longspec.train.trainer import Trainer, TrainingStopped

    target = TargetModel.from_pretrained(str(world / "tiny_llama"), dtype=torch.float32, device="cpu")
    drafter = Drafter.from_pretrained(str(_latest(run) / "drafter"), target)
    name, param = next(iter(drafter.named_parameters()))
    stub = SimpleNamespace(
        model=SimpleNamespace(drafter=drafter),
        device=torch.device("cpu"),
        zero3=False,
        world_size=1,
        step=5,
        checkpoints=SimpleNamespace(latest=lambda: str(_latest(run))),
    )
    stub._latest_name = lambda: Trainer._latest_name(stub)
    Trainer._check_weights_finite(stub)  # finite: saved
    with torch.no_grad():
        param.view(-1)[0] = float("inf")
    with pytest.raises(
        TrainingStopped,
        match=rf"step 5: the drafter's weights hold NaN/inf values \(tensor '{name}': 1\); not saved, the latest "
        r"checkpoint is step_00000002",
    ):
        Trainer._check_weights_finite(stub)
