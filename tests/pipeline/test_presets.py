"""Pipeline presets (longspec.pipeline.presets): YAML presets of one schema composed by Hydra, their overrides (the
positional Hydra overrides and the `--set` alias feed one list), and clear errors for mistakes."""

from __future__ import annotations

import re

import pytest

from longspec.pipeline import PipelineConfig, load_preset, plan, preset_names
from longspec.pipeline.__main__ import main
from longspec.pipeline.runner import run_note


def _dry_run(capsys, argv: list[str]) -> tuple[int, str, str]:
    status = main([*argv, "--dry-run"])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def _assert_prints_the_plan(out: str, steps) -> None:
    """The dry run names every step in order, with the exact command it runs."""
    lines = out.splitlines()[1:]  # after the header (which names the interpreter)
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
                "cpu", ["stage1.num_steps=5", "eval_max_samples=1", "tree_widths=[2,2]", "window=32"]
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
    """smollm2_long is smollm2 with longer stages (Hydra defaults), and its stage 1 saves every 250 steps so a
    time-limited job that stops it loses little; stages without save_every keep saving their last step only."""
    base, long = load_preset("smollm2"), load_preset("smollm2_long")
    assert (
        long.evals == base.evals
        and long.eval_suite == base.eval_suite
        and long.target_gguf == base.target_gguf
    )
    assert long.stage1.num_steps > base.stage1.num_steps and long.num_prompts > base.num_prompts
    steps = {s.name: s for s in plan(long, str(tmp_path), data=str(tmp_path))}
    assert "checkpoint.save_every=250" in steps["train_stage1"].cmd
    assert f"checkpoint.save_every={long.stage2.num_steps}" in steps["train_stage2"].cmd
    cpu = {s.name: s for s in plan(load_preset("cpu", ["stage1.save_every=7"]), str(tmp_path))}
    assert "checkpoint.save_every=7" in cpu["train_stage1"].cmd
    with pytest.raises(ValueError, match="save_every must be >= 1"):
        load_preset("cpu", ["stage1.save_every=0"])


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
    preset = load_preset("smollm2", ["evals.0.methods=[ar]", "stage2.extra=[]", "eval_suite=[suite/a.jsonl]"])
    assert preset.evals[0].methods == ["ar"] and preset.stage2.extra == []
    assert preset.eval_suite == ["suite/a.jsonl"]


def test_set_alias_equals_the_positional_override(capsys, tmp_path):
    base = ["--preset", "cpu", "--out", str(tmp_path)]
    _, positional, _ = _dry_run(capsys, [*base, "stage1.num_steps=5", "eval_max_samples=1"])
    _, aliased, _ = _dry_run(capsys, [*base, "--set", "stage1.num_steps=5", "--set", "eval_max_samples=1"])
    _, mixed, _ = _dry_run(capsys, [*base, "--set", "stage1.num_steps=5", "eval_max_samples=1"])
    _, unchanged, _ = _dry_run(capsys, base)
    assert positional == aliased == mixed != unchanged
    assert "max_steps=5" in positional


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["stage1.no_such_field=1"], r"invalid pipeline preset 'cpu': .*no_such_field"),
        (["no_such_field=1"], r"invalid pipeline preset 'cpu': .*no_such_field"),
        (["stage1.num_steps=abc"], r"stage1.num_steps"),
        (["tree_widths=2,2"], r"key=\[value1,value2\]"),  # a list is written [2,2], as in train / eval
        (["stage1.global_batch_size=3"], r"stage1.global_batch_size \(3\) must be a multiple"),
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
    preset = load_preset("cpu", ["stage1.global_batch_size=2", "stage1.micro_batch_size=1"])
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
        assert {f"stage={stage.config}", f"max_steps={stage.num_steps}", f"optim.lr={stage.lr}",
                f"drafter.window={preset.window}", f"loss.distill_weight={preset.distill_weight}",
                *stage.extra} <= set(train)  # fmt: skip
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
