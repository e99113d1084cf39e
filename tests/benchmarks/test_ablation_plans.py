"""The CPU ablations (benchmarks/ablations/) build their runs from the pipeline's public API: the steps they plan
compose into valid training configs that differ only in the switch under study."""

from __future__ import annotations

import os

import pytest

from longspec.cli import UserError
from longspec.train.config import load_config


class _Planned(Exception):
    """Raised in place of running the steps: the test only reads the plan."""


def _plan_of(module, argv: list[str], monkeypatch) -> dict:
    planned = {}

    def capture(steps, out, **kwargs):
        planned.update((s.name, s) for s in steps)
        raise _Planned

    monkeypatch.setattr(module, "run_pipeline", capture)
    with pytest.raises(_Planned):
        module.main(argv)
    return planned


def _train_config(step):
    return load_config(step.cmd[step.cmd.index("longspec.train") + 1 :])


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus"
    path.mkdir()
    (path / "train.jsonl").write_text('{"text": "x = 1\\n"}\n')
    return str(path)


def test_anchor_offset_ablation_differs_only_in_stage1_positions(
    tmp_path, corpus, monkeypatch, load_benchmark
):
    out = tmp_path / "out"
    steps = _plan_of(
        load_benchmark("ablations/anchor_offset"), ["--out", str(out), "--corpus", corpus], monkeypatch
    )
    assert "corpus" not in steps  # reused
    anchor, plain = _train_config(steps["train_stage1_anchor"]), _train_config(steps["train_stage1_plain"])
    assert (anchor.stage.position_ids, plain.stage.position_ids) == ("anchor_offset", "plain")
    for variant in ("anchor", "plain"):
        os.makedirs(out / "runs" / f"stage1_{variant}" / "export")  # made by the stage-1 export step
        stage2 = _train_config(steps[f"train_stage2_from_{variant}"])
        assert stage2.init_from == str(out / "runs" / f"stage1_{variant}" / "export")
        assert stage2.stage.position_ids == "plain" and stage2.loss.distill_weight == 0.0  # the paper's loss


def test_flash_noisy_ablation_differs_only_in_the_noisy_switch(tmp_path, corpus, monkeypatch, load_benchmark):
    steps = _plan_of(
        load_benchmark("ablations/flash_noisy"),
        ["--out", str(tmp_path / "out"), "--corpus", corpus],
        monkeypatch,
    )
    noisy, lag0 = _train_config(steps["train_noisy"]), _train_config(steps["train_lag0"])
    assert (noisy.stage.flash_noisy, lag0.stage.flash_noisy) == (True, False)
    assert noisy.drafter == lag0.drafter and noisy.max_steps == lag0.max_steps
    assert f"drafter.path={tmp_path}/out/runs/noisy/export" in steps["eval_noisy"].cmd
    # τ is read on the paper's fixed tree: tree=auto would decode a weak drafter's text plain (τ 1.0 for both)
    for variant in ("noisy", "lag0"):
        assert "tree_widths=[4,16,16,16,16]" in steps[f"eval_{variant}"].cmd


def test_ablations_run_on_any_hf_target_with_a_presets_settings(
    tmp_path, corpus, monkeypatch, load_benchmark
):
    """--preset smollm2 --target DIR (the GPU runs: a converted GGUF): that directory is the target and the
    tokenizer of the data, and the preset's per-stage extras (bf16 on a GPU) reach both stages."""
    from longspec.testing import save_tiny_target

    target = save_tiny_target("llama", tmp_path / "smol")
    os.rename(os.path.join(corpus, "train.jsonl"), os.path.join(corpus, "train.jsonl.gz"))  # a bundle's name
    steps = _plan_of(
        load_benchmark("ablations/anchor_offset"),
        ["--out", str(tmp_path / "out"), "--corpus", corpus, "--preset", "smollm2", "--target", str(target)],
        monkeypatch,
    )
    assert steps["data_short"].cmd[steps["data_short"].cmd.index("--tokenizer") + 1] == str(target)
    assert steps["data_short"].cmd[steps["data_short"].cmd.index("--source") + 1].endswith("train.jsonl.gz")
    for name in ("train_stage1_anchor", "train_stage1_plain"):
        config = _train_config(steps[name])
        assert config.target.path == str(target) and config.deepspeed.precision == "auto"
        assert config.stage.anchor_max_len == 7680  # the preset's anchor range


def test_a_gguf_preset_without_a_converted_target_is_one_clear_error(corpus, load_benchmark, tmp_path):
    module = load_benchmark("ablations/anchor_offset")
    with pytest.raises(UserError, match="convert it"):
        module.main(["--out", str(tmp_path / "out"), "--corpus", corpus, "--preset", "smollm2"])
    with pytest.raises(UserError, match="not an HF model directory"):
        module.main(["--out", str(tmp_path / "out"), "--corpus", corpus, "--target", str(tmp_path)])


def test_anchor_offset_result_is_paired_and_ignores_a_lucky_first_batch(
    tmp_path, corpus, monkeypatch, load_benchmark
):
    """The GPU run's flat stage-2 curves: an easy first batch once "reached" the plain run's final loss at step
    1 (a 60x "speedup"). Only full trailing windows count now, and the paired per-step difference is reported."""
    import json

    module = load_benchmark("ablations/anchor_offset")
    out = tmp_path / "out"
    plain2 = [2.9, 4.0, 3.9, 4.1, 4.0, 3.9, 4.0, 4.1, 3.95, 4.0]  # flat, with an easy first batch
    curves = {
        "stage1_anchor": [5.0, 4.0],
        "stage1_plain": [5.0, 4.0],
        "stage2_from_anchor": [x + 0.05 for x in plain2],
        "stage2_from_plain": plain2,
    }

    def run(steps, out_dir, **kwargs):
        for name, losses in curves.items():
            run_dir = os.path.join(out_dir, "runs", name)
            os.makedirs(run_dir, exist_ok=True)
            with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
                f.writelines(json.dumps({"step": i + 1, "ce": ce}) + "\n" for i, ce in enumerate(losses))

    monkeypatch.setattr(module, "run_pipeline", run)
    module.main(["--out", str(out), "--corpus", corpus, "--stage2-steps", "10", "--smooth", "3"])
    result = json.loads((out / "anchor_offset.json").read_text())
    assert result["anchor_steps_to_target"] is None and result["speedup"] is None  # never below plain's end
    assert result["paired_difference"] == pytest.approx(0.05) and result["paired_difference_se"] < 1e-6
    assert "paired per step: +0.0500" in result["table"]
    # --rescore: the same figures from the recorded losses, nothing run
    monkeypatch.setattr(module, "run_pipeline", None)
    module.main(
        ["--rescore", str(out / "anchor_offset.json"), "--out", str(tmp_path / "again"), "--smooth", "3"]
    )
    again = json.loads((tmp_path / "again" / "anchor_offset.json").read_text())
    assert again["paired_difference"] == result["paired_difference"] and again["table"] == result["table"]


def test_flash_noisy_evaluates_a_suite_as_its_preset_does(tmp_path, corpus, monkeypatch, load_benchmark):
    """--preset smollm2 --eval-data SUITE FILES: the eval runs on those files with the suite's overrides (no
    length filter or margin, the suite's context), as `python -m longspec.pipeline --preset smollm2` evaluates."""
    from longspec.pipeline import eval_data_overrides, load_preset
    from longspec.testing import save_tiny_target

    target = save_tiny_target("llama", tmp_path / "smol")
    suite = [str(tmp_path / "lcc_4k.jsonl"), str(tmp_path / "qmsum_4k.jsonl")]
    steps = _plan_of(
        load_benchmark("ablations/flash_noisy"),
        ["--out", str(tmp_path / "out"), "--corpus", corpus, "--preset", "smollm2", "--target", str(target),
         "--eval-data", *suite],
        monkeypatch,
    )  # fmt: skip
    cmd = steps["eval_noisy"].cmd
    overrides = eval_data_overrides(load_preset("smollm2"), suite)
    assert overrides[0] == f"data.name=[{','.join(suite)}]" and "data.context_margin=0" in overrides
    assert all(o in cmd for o in overrides) and f"target.path={target}" in cmd


def test_flash_noisy_pools_tau_over_the_eval_sources(tmp_path, corpus, monkeypatch, load_benchmark):
    """τ over several suite files: weighted by each file's kept samples; a file with none kept is left out."""
    import json

    module = load_benchmark("ablations/flash_noisy")
    out = tmp_path / "out"

    def row(tau, samples):
        return {"longspec": {"mean_accept_length": tau, "identical_to_greedy": 1.0, "num_samples": samples}}

    summaries = {
        "noisy": {"lcc_4k": row(2.0, 1), "qmsum_4k": row(3.5, 3), "gov_report_4k": row(9.0, 0)},
        "lag0": {"lcc_4k": row(2.0, 1), "qmsum_4k": row(3.0, 3)},
    }

    def run(steps, out_dir, **kwargs):
        for variant, summary in summaries.items():
            os.makedirs(os.path.join(out_dir, "runs", variant))
            with open(os.path.join(out_dir, "runs", variant, "metrics.jsonl"), "w") as f:
                f.write(json.dumps({"step": 1, "ce": 4.0}) + "\n")
            os.makedirs(os.path.join(out_dir, f"eval_{variant}"))
            with open(os.path.join(out_dir, f"eval_{variant}", "results.json"), "w") as f:
                json.dump({"summary": summary}, f)

    monkeypatch.setattr(module, "run_pipeline", run)
    module.main(["--out", str(out), "--corpus", corpus])
    result = json.loads((out / "flash_noisy.json").read_text())
    assert (
        result["noisy"]["tau"] == pytest.approx((2.0 + 3 * 3.5) / 4) and result["noisy"]["num_samples"] == 4
    )
    assert result["lag0"]["tau"] == pytest.approx((2.0 + 3 * 3.0) / 4)
    assert result["tau_change"] == pytest.approx(12.5 / 11.0 - 1)
