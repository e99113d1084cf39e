"""Pipeline presets (longspec.pipeline.presets): `--set` overrides and validation of the final preset."""

from __future__ import annotations

import pytest

from longspec.pipeline import PRESETS, apply_overrides, plan


def test_apply_overrides():
    preset = apply_overrides(
        PRESETS["cpu"], ["stage1.num_steps=5", "eval_max_samples=1", "tree_widths=2,2", "window=32"]
    )
    assert preset.stage1.num_steps == 5 and preset.eval_max_samples == 1
    assert preset.tree_widths == (2, 2) and preset.window == 32
    assert PRESETS["cpu"].stage1.num_steps != 5  # the registry is untouched
    with pytest.raises(ValueError, match="unknown preset field"):
        apply_overrides(PRESETS["cpu"], ["stage1.no_such_field=1"])
    with pytest.raises(ValueError, match="name=value"):
        apply_overrides(PRESETS["cpu"], ["window"])


def test_preset_validation_runs_once_on_the_final_preset(tmp_path):
    # an intermediate state (batch below micro-batch x processes) is fine while --set applies one field at a time
    preset = apply_overrides(PRESETS["cpu"], ["stage1.global_batch_size=2", "stage1.micro_batch_size=1"])
    assert plan(preset, str(tmp_path))
    with pytest.raises(ValueError, match="multiple of micro_batch_size"):
        plan(apply_overrides(PRESETS["cpu"], ["stage1.global_batch_size=3"]), str(tmp_path))
