"""What a training run is trained on: its inputs' fingerprint, stored in every checkpoint's trainer_state.json and
compared before a resume (`preflight.check_resume`), so that a run directory is continued only on the inputs it
was started with.

The fingerprint (`run_inputs`) holds three parts, each a flat dict of dotted names, so that a change is reported
field by field ("data.rows 11942 -> 2288"):
- the data: its path, its row count and the sha256 of its manifest.json's content. The manifest lists every
  shard with its rows, tokens and (since the prep records them) the sha256 of its bytes, the tokenizer, the source
  and the prep's filters: a re-prep with other rows, another source or another tokenizer changes it;
- the target: name, path and GGUF file as given, and `longspec.fingerprint.target_fingerprint` of its config
  (shapes, depth, RoPE). Its tokenizer is covered by the data, whose manifest records the tokenizer's hash and
  which `check_data` holds to the target's;
- the effective config: the fields that decide what is trained (`TRAINED_FIELDS`).

Left out of the config part, because a user changes them on resume for good reasons and they do not change what a
step computes: the run's length (max_steps, stop_at_step, data.num_epochs: a run is extended on resume, and a
changed schedule length is logged), checkpointing and logging (checkpoint.*, logging.*), resume.*, output_dir,
max_nonfinite_steps, the memory / speed knobs that leave the maths alone (stage.micro_batch_size: the loss is
normalised by the global count of valid tokens; data.pad_to_multiple: padding carries no loss; loss.backend,
loss.chunk_size: the same loss by another kernel; deepspeed.offload_*, deepspeed.backend), data.check_tokenizer and
target.trust_remote_code.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

from longspec.data.manifest import Manifest, manifest_path
from longspec.fingerprint import target_fingerprint
from longspec.train.config import TrainConfig

__all__ = ["TRAINED_FIELDS", "run_inputs", "input_changes"]

# The config fields that change what is trained. stage.name is the run's stage; zero_stage the layout of the
# optimizer state the checkpoint holds (DeepSpeed cannot re-split it), precision the arithmetic of every step.
TRAINED_FIELDS = (
    "stage.name",
    "stage.position_ids",
    "stage.num_anchors",
    "stage.anchor_max_len",
    "stage.num_draft_levels",
    "stage.flash_noisy",
    "stage.seq_len",
    "stage.global_batch_size",
    "data.shuffle",
    "optim.lr",
    "optim.min_lr_ratio",
    "optim.warmup_ratio",
    "optim.weight_decay",
    "optim.betas",
    "optim.eps",
    "optim.grad_clip",
    "drafter.window",
    "drafter.draft_vocab_size",
    "drafter.draft_vocab_data",
    "loss.distill_weight",
    "loss.distill_temperature",
    "deepspeed.zero_stage",
    "deepspeed.precision",
    "init_from",
    "seed",
)


def _norm(path: str | None) -> str | None:
    return os.path.abspath(path) if isinstance(path, str) and os.path.exists(path) else path


def _field(cfg: TrainConfig, name: str) -> Any:
    value: Any = cfg
    for part in name.split("."):
        value = getattr(value, part)
    return list(value) if isinstance(value, (list, tuple)) else value


def run_inputs(cfg: TrainConfig) -> dict[str, Any]:
    """The fingerprint of what `cfg` trains on (module docstring). Reads the data's manifest and the target's config
    (no weights): cheap enough to run before any model loads."""
    with open(manifest_path(cfg.data.path), "rb") as f:
        manifest_sha = hashlib.sha256(f.read()).hexdigest()
    from longspec.target_source import load_config

    hf_config = load_config(cfg.target.source(), trust_remote_code=cfg.target.trust_remote_code)
    inputs: dict[str, Any] = {
        "data.path": _norm(cfg.data.path),
        "data.rows": Manifest.load(cfg.data.path).num_rows,
        "data.manifest_sha256": manifest_sha,
        "target.name": cfg.target.name,
        "target.path": _norm(cfg.target.path),
        "target.gguf_file": cfg.target.gguf_file,
    }
    for key, value in target_fingerprint(hf_config).items():
        if key != "fingerprint_version":
            inputs[f"target.{key}"] = value
    for name in TRAINED_FIELDS:
        inputs[name] = _norm(_field(cfg, name)) if name == "init_from" else _field(cfg, name)
    return json.loads(json.dumps(inputs))  # as read back from trainer_state.json


def _show(value: Any) -> str:
    if isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value):
        return value[:12]  # a sha256: its head tells two apart
    return repr(value)


def input_changes(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """'field old -> new' for every input that differs (`saved` from a checkpoint, `current` from `run_inputs`),
    in `current`'s order; a field the checkpoint does not record counts as changed (written by an older longspec:
    it cannot be verified)."""
    changes = []
    for key, value in current.items():
        if key not in saved:
            changes.append(f"{key} not recorded in the checkpoint -> {_show(value)}")
        elif saved[key] != value:
            changes.append(f"{key} {_show(saved[key])} -> {_show(value)}")
    return changes
