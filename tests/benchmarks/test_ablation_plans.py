"""The CPU ablations (benchmarks/ablations/) build their runs from the pipeline's public API: the steps they plan
compose into valid training configs that differ only in the switch under study."""

from __future__ import annotations

import os

import pytest

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
