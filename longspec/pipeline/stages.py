"""A pipeline preset's training stage: `StagePlan`, a stage YAML and a partial tree of the trainer's own config
(longspec.train.config.TrainConfig) that the pipeline turns into one `python -m longspec.train` step's overrides.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from longspec.config import Schema, check, config_root
from longspec.train.config import TrainConfig

__all__ = ["MOVED_KEYS", "PIPELINE_SET", "StagePlan", "check_group"]


@dataclass(kw_only=True)
class StagePlan(Schema):
    """One drafter training stage: a stage YAML (configs/stage/<config>.yaml) and the training settings the
    preset changes in it, `train`: a partial tree of the trainer's own config (longspec.train.config.TrainConfig,
    the names and nesting of `python -m longspec.train` overrides), e.g.

        stage1: {config: tiny_stage1, train: {max_steps: 750, optim: {lr: 1.0e-3}, stage: {seq_len: 2048}}}
        python -m longspec.pipeline --preset smollm2 stage1.train.max_steps=200

    Checked when the preset is loaded: a key that is not a training setting, or a value of the wrong type, is one
    error naming it (stage1.train.optim.lrr), and the merged config is validated by the trainer's own rules
    (`PipelineConfig.check_stage`). The settings the pipeline fills in for every stage from its own fields
    (PIPELINE_SET: the target, data, output and init_from paths, window, distill_weight, the draft vocabulary,
    anchor_max_len, checkpoint.resume) are refused in `train`, naming the preset field that sets them: neither
    value would silently replace the other. `checkpoint.save_every` not given: the last step only (max_steps),
    and a rerun starts the stage again; given, a rerun resumes from the latest checkpoint.
    """

    config: str = MISSING  # the stage YAML (stage=...): position ids, ZeRO stage, loss mask come from it
    # training settings over the stage YAML's ({}: the stage YAML as it is); e.g. max_steps (optimizer steps,
    # the LR schedule's length), optim.lr, stage.seq_len / global_batch_size / micro_batch_size
    train: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        check(bool(self.config), "a stage plan needs config= (a stage YAML name)")
        # Here, not at the training step: a misspelt name ran the corpus and data preps (hours at paper scale)
        # before the trainer refused it.
        check_group("stage", self.config, "config")

    def setting(self, key: str) -> Any:
        """The value `train` gives the dotted training key (`stage.seq_len`), None when it gives none."""
        return _flatten(self.train).get(key)

    @property
    def max_steps(self) -> int | None:
        """The stage's fixed step count, train.max_steps; None when `train` gives none (the stage YAML's) or -1
        (data.num_epochs epochs)."""
        steps = self.setting("max_steps")
        return steps if isinstance(steps, int) and steps >= 1 else None

    @property
    def resumable(self) -> bool:
        """The stage checkpoints as it goes (train.checkpoint.save_every): a rerun continues its latest checkpoint."""
        return self.setting("checkpoint.save_every") is not None

    def merged(self, train: dict[str, Any], *, config: str | None = None) -> StagePlan:
        """This stage with `train` merged over its own tree (a key given replaces that key only) and, given, another
        stage YAML: e.g. an ablation's sizes over a preset stage's precision."""
        return StagePlan(config=config or self.config, train=_merge(self.train, train))

    def overrides(self) -> list[str]:
        """The training overrides of this stage: the stage YAML, then every setting of `train`."""
        flat = _flatten(self.train)
        if "checkpoint.save_every" not in flat and self.max_steps is not None:
            flat["checkpoint.save_every"] = self.max_steps  # the last step only (disk and time stay small)
        return [f"stage={self.config}", *(f"{key}={_hydra_value(value)}" for key, value in flat.items())]

    def check_train(self, name: str) -> None:
        """Every key of `train` is a training setting of the right type and not one the pipeline sets (`name`:
        the stage's field, stage1, in the messages)."""
        schema = OmegaConf.structured(TrainConfig)
        # the schema itself (its field names, nesting and types), one key at a time: an error names that key even
        # where OmegaConf's does not (a value where a group of settings belongs)
        for top, value in self.train.items():
            try:
                OmegaConf.merge(schema, {top: value})
            except OmegaConfBaseException as e:
                where = f"{name}.train.{e.full_key or top}"
                if isinstance(e, (ConfigKeyError, ConfigAttributeError)):
                    raise ValueError(
                        f"{where} is not a training setting (longspec.train.config.TrainConfig)"
                    ) from None
                raise ValueError(f"{where}: {str(e).splitlines()[0]}") from None
        for key in _flatten(self.train):
            owned = next((k for k in PIPELINE_SET if key == k or key.startswith(k + ".")), None)
            check(
                owned is None,
                f"{name}.train.{key} is set by the pipeline for every stage: use {PIPELINE_SET.get(owned)}",
            )


# Training settings the pipeline sets for every stage from its own fields (`PipelineConfig.train_overrides`),
# each with what sets it: a stage's `train` may not set them.
PIPELINE_SET = {
    "target": "target_config, target_path or target_gguf",
    "data.path": "stage1_source, stage2_sources or stage3_source (prepared into OUT/data/stageN)",
    "output_dir": "--out (each stage runs in OUT/runs/stageN)",
    "init_from": "the pipeline's stage chaining (each stage starts from the previous stage's export)",
    "stage.anchor_max_len": "anchor_max_len=",
    "drafter.window": "window=",
    "drafter.draft_vocab_size": "draft_vocab_size=",
    "drafter.draft_vocab_data": "draft_vocab_size= (stage 1 chooses the ids from the stage-1 and stage-3 data)",
    "loss.distill_weight": "distill_weight=",
    "checkpoint.resume": "train.checkpoint.save_every (given: a rerun resumes; not given: it starts again)",
}

# Stage fields that are keys of `train` instead, each with its path there: such a field (an override, a YAML of
# your own) is one error naming the path, never silently dropped.
_RENAMED = {
    "seq_len": "stage.seq_len",
    "num_steps": "max_steps",
    "global_batch_size": "stage.global_batch_size",
    "micro_batch_size": "stage.micro_batch_size",
    "lr": "optim.lr",
    "save_every": "checkpoint.save_every",
}
MOVED_KEYS = {
    **{f"stage{i}.{old}": f"stage{i}.{old} is stage{i}.train.{new}" for i in (1, 2, 3) for old, new in _RENAMED.items()},
    **{f"stage{i}.extra": f"stage{i}.extra: each training override is a key of stage{i}.train "
       f"(stage{i}.train.deepspeed.zero_stage=3)" for i in (1, 2, 3)},
}  # fmt: skip


def _hydra_value(value: Any) -> str:
    """`value` (from a YAML tree) written as a Hydra override's value that parses back to it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(map(_hydra_value, value)) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_hydra_value(v)}" for k, v in value.items()) + "}"
    text = str(value)
    # a plain word or path stays as it is; anything Hydra would read otherwise (a number, null, a space) is quoted
    if _PLAIN_STRING.fullmatch(text) and text.lower() not in ("null", "true", "false", "nan", "inf"):
        return text
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


_PLAIN_STRING = re.compile(r"[A-Za-z_/][\w./:-]*")


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over` merged into a copy of `base`, mappings key by key."""
    merged = dict(base)
    for key, value in over.items():
        both = isinstance(value, dict) and isinstance(merged.get(key), dict)
        merged[key] = _merge(merged[key], value) if both else value
    return merged


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested mapping as {dotted key: leaf value}, in the tree's order."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def check_group(group: str, name: str, field_name: str) -> None:
    """`name` is a YAML of the training / eval config group `group` (configs/<group>/<name>.yaml), which
    the steps compose."""
    directory = os.path.join(config_root(), group)
    names = sorted(n[: -len(".yaml")] for n in os.listdir(directory) if n.endswith(".yaml"))
    check(name in names, f"{field_name}={name!r} is not a {group} config; choose from {', '.join(names)}")
