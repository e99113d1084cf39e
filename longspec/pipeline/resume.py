"""Whether a stage's run directory may be resumed: its latest checkpoint must have been trained on the inputs the
stage would train on now (the trainer refuses a resume on other inputs; the pipeline restarts the stage instead)."""

from __future__ import annotations

from longspec.train.checkpoint import (
    STATE_NAME,
    CheckpointError,
    latest_checkpoint,
    read_trainer_state,
    verify_checkpoint,
)
from longspec.train.config import load_config
from longspec.train.inputs import input_changes, run_inputs

__all__ = ["restart_on_changed_inputs"]


def restart_on_changed_inputs(run_dir: str, train_overrides: list[str]) -> bool:
    """Before a training step that would resume `run_dir`: True, after one line saying what changed, when its
    latest checkpoint was trained on other inputs than the step's (`longspec.train.inputs`: the data re-prepared
    with other rows, another target, another trained config field); the caller then restarts the stage from
    scratch. A checkpoint whose state does not verify or records no inputs is kept: the trainer refuses it by
    name, and nothing is deleted on a guess."""
    latest = latest_checkpoint(run_dir)
    try:
        verify_checkpoint(latest, [STATE_NAME])
        saved = read_trainer_state(latest).get("inputs")
    except CheckpointError:
        return False
    if not isinstance(saved, dict):
        return False
    changes = input_changes(saved, run_inputs(load_config(train_overrides)))
    if changes:
        print(f"  {run_dir}: trained on other inputs ({'; '.join(changes)}): the stage restarts from scratch")
    return bool(changes)
