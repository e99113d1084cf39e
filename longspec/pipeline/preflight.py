"""What `python -m longspec.pipeline` checks before its first step, so that a mistake costs seconds instead of the
preparation and training that ran before the step that refused it (a bad eval setting failed at the last step).

The preset's own fields are checked by its schema (presets.py, every numeric field's range included); here: the
target exists, no live process holds a directory the plan writes (longspec.lifetime), and the config of every
training and evaluation step is composed from the step's own command line and validated, as the step itself will
compose it. Inputs that earlier steps make (data, exports, the converted target) do not exist yet: stand-ins of
the same kind (an empty file or directory) take their place while the configs are checked.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable

from longspec.cli import USER_ERRORS, UserError, one_line
from longspec.drafter.vocab import check_draft_vocab_size
from longspec.eval.config import load_eval_config, split_config_name
from longspec.lifetime import LOCK_NAME, refuse_if_held
from longspec.pipeline.plan import EVAL_MODULE, Step
from longspec.pipeline.presets import PipelineConfig
from longspec.target_source import load_config as load_target_config
from longspec.target_source import resolve_source
from longspec.train.config import load_config

__all__ = ["check_plan"]

TRAIN_MODULE = ["-m", "longspec.train"]


def check_plan(preset: PipelineConfig, steps: list[Step], *, locks: bool = True) -> None:
    """Raise a one-line error (UserError / ValueError) for anything that would fail a step of this plan later.
    locks=False (a dry run, which writes nothing): the settings only, not the directories live runs hold."""
    check_target(preset)
    for step in steps if locks else ():
        for lock in step.locks:
            refuse_if_held(lock, "trainer" if os.path.basename(lock) == LOCK_NAME else "data prep")
    check_step_configs(steps)


def check_target(preset: PipelineConfig) -> None:
    """The target the plan names exists: a model directory, a GGUF file, or the target group's own model (a hub id
    passes: nothing here goes to the network)."""
    if preset.target_gguf is not None:
        field, path, gguf = "target_gguf", None, preset.target_gguf
    elif preset.target_path is not None:
        field, path, gguf = "target_path", preset.target_dir(), None
        if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
            raise UserError(f"target_path={preset.target_path!r} holds no config.json: not a model directory")
    else:
        return  # the target group's own model: the composed step configs name it (check_step_configs)
    try:
        source = resolve_source(path, gguf)
    except (FileNotFoundError, ValueError) as e:
        raise UserError(f"{field}={getattr(preset, field)!r}: {e}") from None
    if preset.draft_vocab_size is not None:
        check_target_vocab(preset.draft_vocab_size, source)


def check_target_vocab(size: int, source) -> None:
    """draft_vocab_size fits the target's vocabulary, as its config states it (stage 1 would refuse it after the
    data preparation). A config that cannot be read here is left to the steps' own errors."""
    try:
        vocab_size = load_target_config(source).vocab_size
    except (OSError, ValueError, AttributeError, ImportError):
        return
    try:
        check_draft_vocab_size(size, vocab_size)
    except ValueError as e:
        raise UserError(str(e)) from None


def check_step_configs(steps: list[Step]) -> None:
    """Compose and validate the training / evaluation config of every step from its command line."""
    made: set[str] = set()  # outputs of the steps before this one (files)
    with tempfile.TemporaryDirectory(prefix="longspec-preflight-") as stand_ins:
        file, directory = os.path.join(stand_ins, "file"), os.path.join(stand_ins, "dir")
        open(file, "w").close()
        os.mkdir(directory)
        for step in steps:
            overrides = _config_overrides(step)
            if overrides is not None:
                kind, args = overrides
                args = [_stand_in(arg, made, file, directory) for arg in args]
                try:
                    if kind == "train":
                        cfg = load_config(args)
                    else:
                        config_name, args = split_config_name(args)
                        cfg = load_eval_config(args, config_name=config_name)
                    if not _planned(cfg.target.path, made):
                        cfg.target.source()  # a local model directory that is not there
                except USER_ERRORS as e:
                    raise UserError(f"step {step.name}: {one_line(e)}") from None
            made.update(os.path.abspath(p) for p in step.outputs)


def _config_overrides(step: Step) -> tuple[str, list[str]] | None:
    """("train" | "eval", the Hydra overrides) of a `torchrun -m longspec.train` / `python -m longspec.eval`
    step; None for any other step."""
    cmd = step.cmd or []
    for kind, module in (("train", TRAIN_MODULE), ("eval", EVAL_MODULE)):
        for i in range(len(cmd) - len(module) + 1):
            if cmd[i : i + len(module)] == module:
                return kind, cmd[i + len(module) :]
    return None


def _planned(path: str | None, made: Iterable[str]) -> bool:
    """`path` does not exist yet and an earlier step makes it (one of its outputs, or the directory of one)."""
    if not path or os.path.exists(path):
        return False
    path = os.path.abspath(path)
    return any(p == path or p.startswith(path + os.sep) for p in made)


def _stand_in(arg: str, made: set[str], file: str, directory: str) -> str:
    """`key=value` with a value an earlier step makes replaced by a stand-in of its kind (file or directory)."""
    key, sep, value = arg.partition("=")
    if not sep:
        return arg
    if value.startswith("[") and value.endswith("]"):  # a list of paths (drafter.draft_vocab_data=[a,b])
        items = (
            [_stand_in_path(v, made, file, directory) for v in value[1:-1].split(",")] if value[1:-1] else []
        )
        return f"{key}=[{','.join(items)}]"
    return f"{key}={_stand_in_path(value, made, file, directory)}"


def _stand_in_path(value: str, made: set[str], file: str, directory: str) -> str:
    if not _planned(value, made):
        return value
    return file if os.path.abspath(value) in made else directory
