"""The pipeline's plan (longspec.pipeline.plan): the steps each preset runs and the overrides they pass."""

from __future__ import annotations

import os

import pytest

from longspec.pipeline import Step, load_preset, plan
from longspec.pipeline.plan import eval_runs_command

CPU = load_preset("cpu")


def _cmd(step: Step) -> list[str]:
    assert step.cmd is not None, step.name
    return step.cmd


def test_cpu_plan_chains_the_three_stages(tmp_path):
    steps = plan(CPU, str(tmp_path))
    names = [s.name for s in steps]
    assert names == [
        "corpus", "data_stage1", "data_stage2", "stage3_prompts", "stage3_regenerate", "data_stage3",
        "train_stage1", "export_stage1", "train_stage2", "export_stage2", "train_stage3", "export_stage3", "eval",
    ]  # fmt: skip
    by_name = {s.name: s for s in steps}
    for index in (1, 2, 3):
        train = _cmd(by_name[f"train_stage{index}"])
        assert train[1:3] == ["-m", "torch.distributed.run"] and "longspec.train" in train
        assert f"stage=tiny_stage{index}" in train
        assert by_name[f"train_stage{index}"].env == {"DS_ACCELERATOR": "cpu"}
        init = [a for a in train if a.startswith("init_from=")]
        # each stage starts from the previous stage's export; stage 1 from scratch
        assert init == ([] if index == 1 else [f"init_from={tmp_path}/runs/stage{index - 1}/export"])
    assert "--keep-unfinished" in _cmd(by_name["data_stage3"])
    assert f"drafter.path={tmp_path}/runs/stage3/export" in _cmd(by_name["eval"])
    # the regenerated continuations are what stage 3 trains on
    assert _cmd(by_name["data_stage3"])[_cmd(by_name["data_stage3"]).index("--source") + 1] == str(
        tmp_path / "data" / "stage3_regenerated.jsonl"
    )


def test_plan_overrides_validate_against_the_train_and_eval_schemas(tmp_path):
    """The Hydra overrides the plan writes compose into valid TrainConfig / EvalConfig objects."""
    from longspec.eval.config import load_eval_config
    from longspec.train.config import load_config

    steps = {s.name: s for s in plan(CPU, str(tmp_path))}
    for index in (1, 2, 3):
        os.makedirs(tmp_path / "runs" / f"stage{index}" / "export")
    for index in (1, 2, 3):
        train = _cmd(steps[f"train_stage{index}"])
        cfg = load_config(train[train.index("longspec.train") + 1 :])
        assert cfg.stage.name == f"tiny_stage{index}"
        assert cfg.drafter.window == CPU.window
        assert cfg.stage.position_ids == ("anchor_offset" if index == 1 else "plain")
        assert cfg.stage.flash_noisy
        assert cfg.max_steps == getattr(CPU, f"stage{index}").train["max_steps"]
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "heldout_lcc.jsonl").write_text("")
    ev = _cmd(steps["eval"])
    cfg = load_eval_config(ev[ev.index("longspec.eval") + 1 :])
    assert cfg.methods == list(CPU.evals[0].methods)
    assert cfg.generation.temperature == 0 and cfg.generation.max_new_tokens == CPU.eval_max_new_tokens


def test_smollm2_plan_converts_the_gguf_and_evaluates_the_suite(tmp_path):
    data = tmp_path / "data_in"
    gguf = str(tmp_path / "model.gguf")
    preset = load_preset("smollm2", [f"target_gguf={gguf}"])
    steps = {s.name: s for s in plan(preset, str(tmp_path / "out"), data=str(data))}
    assert "corpus" not in steps and "stage3_prompts" not in steps  # prepared elsewhere and carried
    convert = _cmd(steps["convert_target"])
    assert convert[convert.index("longspec.convert_gguf") + 1] == gguf
    target = convert[convert.index("longspec.convert_gguf") + 2]
    # stage 1-2 data are tokenized with the GGUF's own tokenizer while the target converts (joined at its end)
    order = list(steps)
    for name in ("data_stage1", "data_stage2"):
        assert f"--tokenizer {gguf}" in " ".join(_cmd(steps[name])) and steps[name].background
        assert order.index(name) < order.index("convert_target")
    assert not steps["convert_target"].background and target.endswith("model")
    assert str(data / "corpus" / "long_docs.jsonl") in _cmd(steps["data_stage2"])
    regenerate = _cmd(steps["stage3_regenerate"])
    assert regenerate[regenerate.index("--template") + 1] == "chat"
    assert regenerate[regenerate.index("--source") + 1] == str(data / "stage3_prompts.jsonl")
    assert steps["train_stage1"].env == {}  # DeepSpeed on the GPU
    for name in ("eval_t0_graphs", "eval_t1_graphs"):
        cmd = _cmd(steps[name])
        assert any(a.startswith("data.name=[") and "qmsum_8k.jsonl" in a for a in cmd)
        assert "cuda_graphs=true" in cmd and not any(a.startswith("tree_widths=") for a in cmd)  # tree=auto
    assert "temperature=1.0" in _cmd(steps["eval_t1_graphs"])
    # the evaluations run in one process: each step's own overrides become one --run of longspec.eval.runs
    evals = [s for name, s in steps.items() if name.startswith("eval_")]
    assert len(evals) == len(preset.evals) and all(s.joint is eval_runs_command for s in evals)
    joint = eval_runs_command(evals, "/tmp/events.jsonl")
    assert joint[1:5] == ["-m", "longspec.eval.runs", "--events", "/tmp/events.jsonl"]
    runs = " ".join(joint[5:]).split("--run ")[1:]
    assert [r.strip() for r in runs] == [" ".join(s.cmd[3:]) for s in evals]
    # the GPU runs the target's stage-3 responses while stage 1 trains, and tokenizes stage 3 while stage 2 trains
    assert steps["stage3_regenerate"].background and steps["data_stage3"].background
    assert order.index("stage3_regenerate") + 1 == order.index("train_stage1")
    assert order.index("data_stage3") + 1 == order.index("train_stage2")
    with pytest.raises(ValueError, match="--data"):
        plan(preset, str(tmp_path / "out"))


def test_paper_preset_takes_everything_from_the_stage_and_target_yamls(tmp_path):
    """launch/pipeline.sh: the paper's stages for a target YAML, the numbers of the stage YAMLs, the user's data."""
    from longspec.train.config import load_config

    with pytest.raises(ValueError, match=r"stage2_sources\[0\]"):  # required: no default data for stage 2
        load_preset("paper", ["stage3_source=sft.jsonl"])
    with pytest.raises(ValueError, match="stage3_source"):
        load_preset("paper", ["stage2_sources=[long.jsonl]"])
    preset = load_preset(
        "paper", ["target_config=vicuna_7b_16k", "num_procs=4", "stage2_sources=[/d/a.jsonl,/d/b.jsonl]",
                  "stage3_source=/d/sft.jsonl"],
    )  # fmt: skip
    steps = {s.name: s for s in plan(preset, str(tmp_path))}
    assert (
        "corpus" not in steps
        and "stage3_regenerate" not in steps
        and not any(n.startswith("eval") for n in steps)
    )
    target = load_config(["target=vicuna_7b_16k", "data.path=x"]).target
    for index, name in enumerate(("stage1_slimpajama", "stage2_prolong", "stage3_sft"), 1):
        stage = load_config([f"stage={name}", "data.path=x"]).stage
        data = _cmd(steps[f"data_stage{index}"])
        assert data[data.index("--tokenizer") + 1] == target.path
        assert data[data.index("--max-len" if index == 3 else "--seq-len") + 1] == str(stage.seq_len)
        train = _cmd(steps[f"train_stage{index}"])
        assert train[train.index("longspec.train") + 1 :][:2] == ["target=vicuna_7b_16k", f"stage={name}"]
        assert not any(
            a.startswith(("max_steps=", "stage.seq_len=", "optim.lr=")) for a in train
        )  # the YAML's
        assert steps[f"train_stage{index}"].outputs == [
            str(tmp_path / "runs" / f"stage{index}" / "checkpoints")
        ]
    assert _cmd(steps["data_stage2"]).count("--source") == 2
    assert "--keep-unfinished" not in _cmd(steps["data_stage3"])  # the user's rows are complete answers


def test_demo_preset_chains_three_stages_with_one_under_zero3(tmp_path):
    """launch/demo_tiny.sh: the chaining lives in the plan; stage 2 shows ZeRO-3 working."""
    from longspec.train.config import load_config

    steps = {s.name: s for s in plan(load_preset("demo_tiny"), str(tmp_path))}
    for index in (1, 2, 3):
        os.makedirs(tmp_path / "runs" / f"stage{index}" / "export")
    zero = {}
    for index in (1, 2, 3):
        train = _cmd(steps[f"train_stage{index}"])
        cfg = load_config(train[train.index("longspec.train") + 1 :])
        zero[index] = cfg.deepspeed.zero_stage
        assert cfg.init_from == (
            None if index == 1 else str(tmp_path / "runs" / f"stage{index - 1}" / "export")
        )
    assert zero == {1: 1, 2: 3, 3: 1}
    assert "eval" in steps


def _complete_checkpoint(run_dir, step: int) -> None:
    from longspec.train.checkpoint import done_marker

    os.makedirs(os.path.dirname(done_marker(str(run_dir), step)))
    open(done_marker(str(run_dir), step), "w").write("{}")


def test_a_stage_that_saves_as_it_goes_resumes_only_its_own_run(tmp_path):
    """train.checkpoint.save_every: a rerun of the same command keeps the half-finished run dir
    (checkpoint.resume=auto: the trainer continues from its latest checkpoint); a changed command, or a run stopped
    before its first checkpoint, starts from scratch. Without save_every every rerun starts from scratch
    (resume=never)."""
    run_dir = tmp_path / "runs" / "stage1"

    def train_step(overrides):
        step = {s.name: s for s in plan(load_preset("cpu", overrides), str(tmp_path))}["train_stage1"]
        return step

    step = train_step(["stage1.train.checkpoint.save_every=2"])
    assert "checkpoint.resume=auto" in _cmd(step)
    step.fn()  # a fresh dir, marked with the command
    _complete_checkpoint(run_dir, 2)
    (run_dir / "metrics.jsonl").write_text("{}\n")
    step.fn()  # the same command again: kept
    assert (run_dir / "metrics.jsonl").exists()
    other = ["stage1.train.checkpoint.save_every=2", "stage1.train.optim.lr=0.5"]
    train_step(other).fn()  # another command: from scratch
    assert not (run_dir / "metrics.jsonl").exists() and not (run_dir / "checkpoints").exists()
    (run_dir / "metrics.jsonl").write_text("{}\n")
    train_step(other).fn()  # same command, but no checkpoint yet
    assert not (run_dir / "metrics.jsonl").exists()

    plain = train_step([])
    assert "checkpoint.resume=never" in _cmd(plain)
    plain.fn()
    _complete_checkpoint(run_dir, 2)
    plain.fn()  # not resumable: always from scratch
    assert not (run_dir / "checkpoints").exists()


def test_the_target_answers_continue_only_under_the_same_command(tmp_path):
    """stage3_regenerate appends to its output and skips answered prompts: a rerun of the same command keeps the
    partial file, a changed command (other num_prompts, ...) removes it so that old rows do not mix in."""
    out = tmp_path / "data" / "stage3_regenerated.jsonl"

    def regenerate(overrides):
        return {s.name: s for s in plan(load_preset("cpu", overrides), str(tmp_path))}["stage3_regenerate"]

    regenerate([]).fn()
    out.write_text('{"id": "a"}\n')
    regenerate([]).fn()
    assert out.read_text() == '{"id": "a"}\n'
    regenerate(["num_prompts=7"]).fn()
    assert not out.exists()


def test_a_given_drafter_is_evaluated_without_data_or_training(tmp_path):
    """drafter_path= evaluates an exported drafter through the preset's evaluations: the target is still
    converted (and the corpus built where the evaluation reads it), nothing is tokenized or trained, and
    --keep-going falls back to the baselines alone. A path without an exported drafter is one error."""
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text("{}")
    gguf = str(tmp_path / "model.gguf")
    preset = load_preset("smollm2", [f"target_gguf={gguf}", f"drafter_path={drafter}"])
    steps = plan(preset, str(tmp_path / "out"), data=str(tmp_path / "data_in"))
    assert [s.name for s in steps] == ["convert_target", *(f"eval_{ev.name}" for ev in preset.evals)]
    for step in steps[1:]:  # the fallback: the same evaluation's baselines, where it has any
        assert f"drafter.path={drafter}" in _cmd(step) and len(step.alternatives) <= 1
        assert not any(a.startswith("drafter.path=") for alt in step.alternatives for a in alt.cmd)
    assert len(steps[1].alternatives) == 1  # eval_t0_graphs: ar, vanilla_fa and pld alone
    cpu = plan(load_preset("cpu", [f"drafter_path={drafter}"]), str(tmp_path / "cpu"))
    assert [s.name for s in cpu] == ["corpus", "eval"] and f"drafter.path={drafter}" in _cmd(cpu[1])
    with pytest.raises(ValueError, match="no exported drafter there"):
        load_preset("cpu", [f"drafter_path={tmp_path / 'missing'}"])


@pytest.mark.parametrize("preset_name", ["cpu", "smollm2"])
def test_a_draft_vocabulary_is_chosen_in_stage_1_from_stage_1_and_3_data(tmp_path, preset_name):
    """draft_vocab_size=K: stage 1 chooses the K ids from the stage-1 and stage-3 data (prepared before it, also on
    a GPU preset that otherwise overlaps them), stages 2 and 3 keep init_from's map."""
    from dataclasses import replace

    preset = replace(load_preset(preset_name), draft_vocab_size=8192)
    data = tmp_path / "suite" if preset.eval_suite else None
    if data is not None:
        data.mkdir()
    steps = plan(preset, str(tmp_path / "out"), **({"data": str(data)} if data is not None else {}))
    names = [s.name for s in steps]
    assert names.index("data_stage3") < names.index("train_stage1")
    by_name = {s.name: s for s in steps}
    stage1 = _cmd(by_name["train_stage1"])
    out = tmp_path / "out" / "data"
    assert "drafter.draft_vocab_size=8192" in stage1
    assert f"drafter.draft_vocab_data=[{out}/stage1,{out}/stage3]" in stage1
    for index in (2, 3):
        assert not any(a.startswith("drafter.draft_vocab") for a in _cmd(by_name[f"train_stage{index}"]))
    if preset_name == "cpu":  # the preflight stands in for data the plan has yet to prepare, lists included
        from longspec.pipeline.preflight import check_step_configs

        check_step_configs(steps)
    default = plan(load_preset(preset_name), str(tmp_path / "again"), **({"data": str(data)} if data else {}))
    assert not any(a.startswith("drafter.draft_vocab") for s in default if s.cmd for a in s.cmd)
