"""The qwen25_coder_long preset (issue 45): the three stages as the issue asks them (anchor offsets to the 32K target's
MAX_LEN, long documents, the target's own answers, flash noisy training), every step resumable, and one evaluation
run per context bucket reading only that bucket's files."""

from __future__ import annotations

import pytest

from longspec.eval.config import load_eval_config
from longspec.pipeline import load_preset, plan
from longspec.train.config import load_config

BUCKETS = ("8k", "16k", "32k")


@pytest.fixture()
def steps(tmp_path):
    preset = load_preset("qwen25_coder_long", [f"target_path={tmp_path / 'qwen_hf'}"])
    return preset, {s.name: s for s in plan(preset, str(tmp_path / "out"), data=str(tmp_path / "data"))}


def test_the_stages_train_long_with_flash_noise_and_resume(steps, tmp_path):
    preset, by_name = steps
    assert (
        "convert_target" not in by_name and "corpus" not in by_name
    )  # a converted target, a prepared bundle
    for index in (1, 2):
        (tmp_path / "out" / "runs" / f"stage{index}" / "export").mkdir(parents=True)  # init_from of the next
    for index in (1, 2, 3):
        cmd = by_name[f"train_stage{index}"].cmd
        assert "checkpoint.resume=auto" in cmd  # a stopped stage continues from its latest checkpoint
        cfg = load_config(cmd[cmd.index("longspec.train") + 1 :])
        assert cfg.target.name == "qwen_hf" and cfg.target.path == str(tmp_path / "qwen_hf")
        assert cfg.stage.flash_noisy and cfg.deepspeed.zero_stage == 1
        assert cfg.checkpoint.save_every < cfg.max_steps
        if index == 1:
            assert cfg.stage.position_ids == "anchor_offset"
            assert cfg.stage.resolve_anchor_max_len(32768) == 30000  # positions reach the paper's 32K MAX_LEN
        else:
            assert cfg.stage.position_ids == "plain" and cfg.stage.seq_len == 32768
    stage2 = by_name["data_stage2"].cmd
    assert stage2[stage2.index("--min-tokens") + 1] == "16384"  # long documents of 16K-32K tokens
    regenerate = by_name["stage3_regenerate"].cmd
    assert regenerate[regenerate.index("--source") + 1] == str(tmp_path / "data" / "stage3_prompts.jsonl")
    assert "--keep-unfinished" in by_name["data_stage3"].cmd


def test_one_evaluation_per_bucket_over_its_own_files(steps, tmp_path):
    preset, by_name = steps
    evals = {name: s for name, s in by_name.items() if name.startswith("eval_")}
    assert {ev.temperature for ev in preset.evals} == {0.0, 1.0}
    (tmp_path / "out" / "runs" / "stage3" / "export").mkdir(parents=True)  # the drafter evaluated
    seen = set()
    for ev in preset.evals:
        cmd = evals[f"eval_{ev.name}"].cmd
        (names,) = [a for a in cmd if a.startswith("data.name=[")]
        files = names[len("data.name=[") : -1].split(",")
        bucket = ev.name.rsplit("_", 1)[1]
        assert bucket in BUCKETS and all(f.endswith(f"_{bucket}.jsonl") for f in files) and len(files) == 4
        seen.update(files)
        for path in files:
            (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / path).touch()
        cfg = load_eval_config(cmd[cmd.index("longspec.eval") + 1 :])
        assert cfg.data.context_len == 32768 and cfg.generation.max_new_tokens == preset.eval_max_new_tokens
    assert seen == {str(tmp_path / "data" / name) for name in preset.eval_suite}
    for bucket in BUCKETS:  # T=0 with every method, and T=1, at every bucket
        assert {"longspec", "ar", "vanilla_fa", "pld"} <= set(preset_eval(preset, f"t0_{bucket}").methods)
        assert preset_eval(preset, f"t1_{bucket}").temperature == 1.0


def preset_eval(preset, name):
    (found,) = [ev for ev in preset.evals if ev.name == name]
    return found


def test_an_eval_run_may_read_only_files_of_the_suite():
    with pytest.raises(ValueError, match=r"suite file\(s\) \['suite/other.jsonl'\] are not in eval_suite"):
        load_preset("qwen25_coder_long", ["evals.0.suite=[suite/other.jsonl]"])
