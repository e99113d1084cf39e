"""Pipeline presets (longspec.pipeline.presets): YAML presets of one schema composed by Hydra, their overrides (the
positional Hydra overrides and the `--set` alias feed one list), and clear errors for mistakes."""

from __future__ import annotations

import dataclasses
import os
import re
import shutil

import pytest

from longspec.config import config_root
from longspec.pipeline import PipelineConfig, load_preset, plan, preset_names
from longspec.pipeline.__main__ import main
from longspec.pipeline.runner import run_note
from longspec.train.checkpoint import done_marker
from longspec.train.config import load_config


def _dry_run(capsys, argv: list[str]) -> tuple[int, str, str]:
    status = main([*argv, "--dry-run"])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def _assert_prints_the_plan(out: str, steps) -> None:
    """The dry run names every step in order, with the exact command it runs (then, where the machine lacks
    the plan's target, a note that a run would stop)."""
    lines = out.split("\n\nnote: ")[0].splitlines()[1:]  # after the header (which names the interpreter)
    assert len(lines) == 2 * len(steps)
    for index, step in enumerate(steps):
        assert lines[2 * index : 2 * index + 2] == [
            f"[{index + 1}/{len(steps)}] {step.name}{run_note(step)}",
            f"  $ {step.command}",
        ]


# The inputs a preset leaves to its user (launch/pipeline.sh passes them for `paper`).
REQUIRED = {"paper": ["stage2_sources=[long.jsonl]", "stage3_source=sft.jsonl"]}


def test_the_shipped_presets():
    assert {"cpu", "smollm2", "demo_tiny", "paper"} <= set(preset_names())
    for name in preset_names():
        preset = load_preset(name, REQUIRED.get(name, []))
        assert isinstance(preset, PipelineConfig) and preset.name == name


def test_a_hydra_override_changes_the_plan(tmp_path):
    base = {s.name: s for s in plan(load_preset("cpu"), str(tmp_path))}
    changed = {
        s.name: s
        for s in plan(
            load_preset(
                "cpu", ["stage1.train.max_steps=5", "eval_max_samples=1", "tree_widths=[2,2]", "window=32"]
            ),
            str(tmp_path),
        )
    }
    assert list(changed) == list(base)
    train1 = changed["train_stage1"].cmd
    assert "max_steps=5" in train1 and "checkpoint.save_every=5" in train1 and "drafter.window=32" in train1
    assert "max_steps=5" not in base["train_stage1"].cmd
    assert "max_samples=1" in changed["eval"].cmd and "tree_widths=[2,2]" in changed["eval"].cmd
    # the other stages keep the preset's values
    assert [a for a in changed["train_stage3"].cmd if a.startswith("max_steps=")] == [
        a for a in base["train_stage3"].cmd if a.startswith("max_steps=")
    ]


def test_a_longer_preset_inherits_and_checkpoints_as_it_goes(tmp_path):
    """smollm2_long is smollm2 with longer stages (Hydra defaults, merged into each stage's `train` key by key),
    and its stage 1 saves every 250 steps so a time-limited job that stops it loses little; stages without
    checkpoint.save_every keep saving their last step only."""
    base, long = load_preset("smollm2"), load_preset("smollm2_long")
    assert (
        long.evals == base.evals
        and long.eval_suite == base.eval_suite
        and long.target_gguf == base.target_gguf
    )
    assert long.stage1.max_steps > base.stage1.max_steps and long.num_prompts > base.num_prompts
    # the rest of smollm2's stage-1 settings are kept
    assert (
        long.stage1.train["stage"] == base.stage1.train["stage"] and long.stage1.setting("optim.lr") == 1e-3
    )
    steps = {s.name: s for s in plan(long, str(tmp_path), data=str(tmp_path))}
    assert "checkpoint.save_every=250" in steps["train_stage1"].cmd
    assert f"checkpoint.save_every={long.stage2.max_steps}" in steps["train_stage2"].cmd
    cpu = {
        s.name: s for s in plan(load_preset("cpu", ["stage1.train.checkpoint.save_every=7"]), str(tmp_path))
    }
    assert "checkpoint.save_every=7" in cpu["train_stage1"].cmd
    with pytest.raises(ValueError, match="checkpoint.save_every must be >= 1"):  # the trainer's own rule
        load_preset("cpu", ["stage1.train.checkpoint.save_every=0"])


def test_an_eval_plan_may_take_more_samples_than_the_preset(tmp_path):
    """smollm2 reads τ on the fixed tree from all 4 prepared samples per dataset; the timed runs keep 2."""
    steps = {s.name: s for s in plan(load_preset("smollm2"), str(tmp_path), data=str(tmp_path))}
    assert (
        "max_samples=4" in steps["eval_t0_full_tree"].cmd
        and "max_samples=4" in steps["eval_t1_full_tree"].cmd
    )
    assert (
        "max_samples=2" in steps["eval_t0_graphs"].cmd and "max_samples=4" not in steps["eval_t0_graphs"].cmd
    )
    with pytest.raises(ValueError, match="max_samples must be >= 1"):
        load_preset("smollm2", ["evals.0.max_samples=0"])


def test_list_fields_and_eval_plans_are_overridable(tmp_path):
    # `~stageN.train.KEY`: the stage YAML's value again
    preset = load_preset(
        "smollm2", ["evals.0.methods=[ar]", "~stage2.train.deepspeed", "eval_suite=[suite/a.jsonl]"]
    )
    assert preset.evals[0].methods == ["ar"] and "deepspeed" not in preset.stage2.train
    assert preset.eval_suite == ["suite/a.jsonl"]


def test_set_alias_equals_the_positional_override(capsys, tmp_path):
    base = ["--preset", "cpu", "--out", str(tmp_path)]
    _, positional, _ = _dry_run(capsys, [*base, "stage1.train.max_steps=5", "eval_max_samples=1"])
    _, aliased, _ = _dry_run(
        capsys, [*base, "--set", "stage1.train.max_steps=5", "--set", "eval_max_samples=1"]
    )
    _, mixed, _ = _dry_run(capsys, [*base, "--set", "stage1.train.max_steps=5", "eval_max_samples=1"])
    _, unchanged, _ = _dry_run(capsys, base)
    assert positional == aliased == mixed != unchanged
    assert "max_steps=5" in positional


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["stage1.no_such_field=1"], r"invalid pipeline preset 'cpu': .*no_such_field"),
        (["no_such_field=1"], r"invalid pipeline preset 'cpu': .*no_such_field"),
        (["stage1.train.max_steps=abc"], r"stage1.train.max_steps: Value 'abc'"),
        (["tree_widths=2,2"], r"key=\[value1,value2\]"),  # a list is written [2,2], as in train / eval
        (
            ["stage1.train.stage.global_batch_size=12"],
            r"stage1.train: stage.global_batch_size \(12\) must be a multiple",
        ),
        (["stage1.train.stage.micro_batch_size=16"], r"x num_procs \(16 x 2\)"),
        (["evals.0.methods=[nope]"], r"unknown method"),
        (["target_gguf=model.gguf"], r"one of target_path= .* and target_gguf="),
        # names the steps compose: refused here, not after the corpus and data preps
        (["stage2.config=nope"], r"config='nope' is not a stage config; choose from .*tiny_stage2"),
        (["target_config=nope"], r"target_config='nope' is not a target config; choose from .*tiny_llama"),
        (["window"], r"window"),
    ],
)
def test_a_mistake_is_one_clear_error(capsys, tmp_path, overrides, match):
    status, out, err = _dry_run(capsys, ["--preset", "cpu", "--out", str(tmp_path), *overrides])
    assert status == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: ")
    assert re.search(match, err), err
    with pytest.raises(ValueError):
        load_preset("cpu", overrides)


def test_validation_sees_the_final_preset(tmp_path):
    # batch and micro-batch changed together: no intermediate state is validated
    preset = load_preset(
        "cpu", ["stage1.train.stage.global_batch_size=2", "stage1.train.stage.micro_batch_size=1"]
    )
    assert plan(preset, str(tmp_path))
    with pytest.raises(ValueError, match="unknown pipeline preset 'nope'"):
        load_preset("nope")


def test_cpu_dry_run(capsys, tmp_path):
    """The dry run prints every step of the plan, in order, with the exact command it runs."""
    preset = load_preset("cpu")
    steps = plan(preset, str(tmp_path))
    status, out, _ = _dry_run(capsys, ["--preset", "cpu", "--out", str(tmp_path)])
    assert status == 0 and f"preset cpu: {len(steps)} steps" in out.splitlines()[0]
    _assert_prints_the_plan(out, steps)
    by_name = {s.name: s.cmd for s in steps}
    for index, stage in enumerate((preset.stage1, preset.stage2, preset.stage3), 1):
        train = by_name[f"train_stage{index}"]
        assert train[train.index("--nproc_per_node") + 1] == str(preset.num_procs)
        assert {f"stage={stage.config}", f"max_steps={stage.max_steps}", f"optim.lr={stage.setting('optim.lr')}",
                f"drafter.window={preset.window}", f"loss.distill_weight={preset.distill_weight}"} <= set(train)  # fmt: skip
    assert f"max_samples={preset.eval_max_samples}" in by_name["eval"]
    assert f"method=[{','.join(preset.evals[0].methods)}]" in by_name["eval"]


def test_smollm2_dry_run(capsys, tmp_path):
    data = tmp_path / "data"
    (data / "corpus").mkdir(parents=True)
    preset = load_preset("smollm2")
    steps = plan(preset, str(tmp_path / "out"), data=str(data))
    status, out, _ = _dry_run(
        capsys, ["--preset", "smollm2", "--out", str(tmp_path / "out"), "--data", str(data)]
    )
    assert status == 0
    _assert_prints_the_plan(out, steps)
    assert "note: a run of this plan here would stop before its first step: " in out  # no data bundle here
    names = [s.name for s in steps]
    # stage 1-2 data are tokenized (from the GGUF) while the target converts; the corpus comes with --data
    assert names[:3] == ["data_stage1", "data_stage2", "convert_target"] and "corpus" not in names
    assert names[-len(preset.evals) :] == [f"eval_{ev.name}" for ev in preset.evals]
    for ev, step in zip(preset.evals, steps[-len(preset.evals) :], strict=True):
        assert step.required == ev.required and set(ev.extra) <= set(step.cmd)
        assert f"temperature={ev.temperature}" in step.cmd
    assert all(s.env == {} for s in steps)  # DeepSpeed on the GPU
    assert [s.name for s in steps if s.background] == [
        "data_stage1",
        "data_stage2",
        "stage3_regenerate",
        "data_stage3",
    ]


def _train_config(step, made: list[str]):
    """The TrainConfig a training step composes from its own command (`made`: the directories earlier steps
    write, created here so that init_from and the draft vocabulary's data exist)."""
    for path in made:
        os.makedirs(path, exist_ok=True)
    return load_config(step.cmd[step.cmd.index("longspec.train") + 1 :])


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        out.update(_flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return out


@pytest.mark.parametrize("name", ["cpu", "demo_tiny", "smollm2", "smollm2_long", "qwen25_coder_long"])
def test_every_train_setting_of_a_preset_reaches_its_steps_config(tmp_path, name):
    """Each key of a stage's `train` tree is that value in the TrainConfig its step composes, and a stage with a
    fixed step count and no checkpoint.save_every saves its last step only (and restarts on a rerun)."""
    preset = load_preset(name)
    out = tmp_path / "out"
    steps = {s.name: s for s in plan(preset, str(out), data=str(tmp_path))}
    exports = [str(out / "runs" / f"stage{i}" / "export") for i in (1, 2)]
    data = [str(out / "data" / f"stage{i}") for i in (1, 3)]
    for index, stage in enumerate((preset.stage1, preset.stage2, preset.stage3), 1):
        cfg = _train_config(steps[f"train_stage{index}"], exports + data)
        composed = _flat(dataclasses.asdict(cfg))
        assert cfg.stage.name == stage.config and _flat(stage.train).items() <= composed.items()
        if "checkpoint" not in stage.train:
            assert (cfg.checkpoint.save_every, cfg.checkpoint.resume) == (cfg.max_steps, "never")
        else:
            assert cfg.checkpoint.resume == "auto"


def test_a_train_override_on_the_command_line_reaches_the_steps_config(capsys, tmp_path):
    """`stageN.train.KEY=VALUE` sets a training setting whether or not the preset's tree has it yet (smollm2's
    stage 2 sets no weight decay and no logging group)."""
    overrides = [
        "stage1.train.max_steps=200",
        "stage2.train.optim.weight_decay=0.05",
        "stage3.train.logging.log_every=5",
    ]
    preset = load_preset("smollm2", overrides)
    # merged into the preset's own optim group
    assert preset.stage2.train["optim"] == {"lr": 3e-4, "weight_decay": 0.05}
    out = tmp_path / "out"
    steps = {s.name: s for s in plan(preset, str(out), data=str(tmp_path))}
    made = [str(out / "runs" / f"stage{i}" / "export") for i in (1, 2)]
    assert _train_config(steps["train_stage1"], made).max_steps == 200
    assert steps["train_stage1"].outputs == [done_marker(str(out / "runs" / "stage1"), 200)]
    assert _train_config(steps["train_stage2"], made).optim.weight_decay == 0.05
    assert _train_config(steps["train_stage3"], made).logging.log_every == 5
    # the CLI: the same override on python -m longspec.pipeline
    status, printed, _ = _dry_run(
        capsys, ["--preset", "cpu", "--out", str(tmp_path / "cli"), "stage1.train.max_steps=9"]
    )
    assert status == 0 and "max_steps=9 " in printed and "checkpoint.save_every=9 " in printed


@pytest.mark.parametrize(
    "override, message",
    [
        ("stage1.train.optim.lrr=1", "stage1.train.optim.lrr is not a training setting"),
        ("stage2.train.no_such_setting=1", "stage2.train.no_such_setting is not a training setting"),
        ("stage1.train.optim=3", r"stage1.train.optim: .*OptimConfig"),  # a value where a group belongs
        ("stage1.train.stage.seq_len=long", r"stage1.train.stage.seq_len: Value 'long'"),
        # a setting the pipeline fills in for every stage: refused, naming the preset field that sets it
        (
            "stage1.train.drafter.window=32",
            r"stage1.train.drafter.window is set by the pipeline .*: use window=",
        ),
        ("stage2.train.data.path=/d", r"stage2.train.data.path is set by the pipeline .*stage2_sources"),
        ("stage3.train.target.path=/t", r"stage3.train.target.path is set by the pipeline .*target_path"),
        ("stage1.train.checkpoint.resume=auto", r"checkpoint.resume is set by the pipeline .*save_every"),
    ],
)
def test_a_bad_train_key_is_one_error_naming_it(capsys, tmp_path, override, message):
    with pytest.raises(ValueError, match=message):
        load_preset("cpu", [override])
    status, out, err = _dry_run(capsys, ["--preset", "cpu", "--out", str(tmp_path), override])
    assert status == 2 and out == "" and len(err.strip().splitlines()) == 1 and re.search(message, err)


@pytest.mark.parametrize(
    "override, message",
    [
        ("stage1.num_steps=5", "stage1.num_steps is stage1.train.max_steps"),
        ("stage2.lr=0.1", "stage2.lr is stage2.train.optim.lr"),
        ("stage3.seq_len=64", "stage3.seq_len is stage3.train.stage.seq_len"),
        ("+stage1.global_batch_size=4", "stage1.global_batch_size is stage1.train.stage.global_batch_size"),
        ("stage1.micro_batch_size=4", "stage1.micro_batch_size is stage1.train.stage.micro_batch_size"),
        ("stage1.save_every=5", "stage1.save_every is stage1.train.checkpoint.save_every"),
        (
            "stage2.extra=[deepspeed.zero_stage=3]",
            r"stage2.extra: each training override is a key of stage2.train",
        ),
    ],
)
def test_an_old_stage_field_names_its_new_path(capsys, tmp_path, override, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        load_preset("cpu", [override])
    status, _, err = _dry_run(capsys, ["--preset", "cpu", "--out", str(tmp_path), override])
    assert status == 2 and len(err.strip().splitlines()) == 1 and message in err


def test_an_old_stage_field_in_a_preset_file_names_its_new_path(tmp_path):
    """A preset YAML of your own that still spells a stage setting the old way: the same one line."""
    (tmp_path / "pipeline").mkdir()
    (tmp_path / "pipeline" / "mine.yaml").write_text(
        "# @package _global_\ndefaults:\n  - cpu\n  - _self_\nname: mine\nstage1:\n  num_steps: 5\n"
    )
    shutil.copy(os.path.join(config_root(), "pipeline", "cpu.yaml"), tmp_path / "pipeline" / "cpu.yaml")
    with pytest.raises(ValueError, match=r"stage1.num_steps is stage1.train.max_steps \(a config file sets"):
        load_preset("mine", config_dir=str(tmp_path))


def test_a_draft_vocabulary_larger_than_the_targets_is_refused_before_any_step(capsys, tmp_path):
    message = (
        "draft_vocab_size=8193 is larger than the target's vocabulary of 8192 ids: give at most 8192 (or leave it "
        "unset to draft over the whole vocabulary)"
    )
    out = tmp_path / "out"
    assert main(["--preset", "cpu", "--out", str(out), "draft_vocab_size=8193"]) == 2
    assert capsys.readouterr().err.strip() == f"error: {message}"
    assert not (out / "logs").exists()  # no step ran
    # a dry run prints the plan, then what a run would refuse
    status, printed, _ = _dry_run(capsys, ["--preset", "cpu", "--out", str(out), "draft_vocab_size=8193"])
    assert status == 0 and printed.rstrip().endswith(f"would stop before its first step: {message}")
    status, printed, _ = _dry_run(capsys, ["--preset", "cpu", "--out", str(out), "draft_vocab_size=8192"])
    assert status == 0 and "drafter.draft_vocab_size=8192" in printed and "would stop" not in printed
