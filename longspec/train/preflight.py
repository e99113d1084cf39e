"""Checks a training launch runs BEFORE any model is loaded (minutes for a large target): the inputs exist and are
whole, and a run directory being resumed belongs to this run. Each raises ValueError / FileNotFoundError with one
line naming the file or the field; `__main__` prints it without a traceback.
"""

from __future__ import annotations

import glob
import json
import os
import re
import struct
from typing import Any

from longspec.data.manifest import Manifest, tokenizer_fingerprint
from longspec.drafter import WEIGHTS_NAME
from longspec.drafter.weights import check_finite
from longspec.train.checkpoint import RESUME_KEYS, checkpoints_root, latest_checkpoint, read_trainer_state
from longspec.train.config import TrainConfig
from longspec.train.inputs import input_changes

__all__ = [
    "check_safetensors",
    "check_model_dir",
    "check_inputs",
    "check_data",
    "check_data_ids",
    "check_resume",
]

# A hub id: "name" or "org/name" (what transformers would try to download); anything else must be a directory.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def check_safetensors(path: str) -> None:
    """Raise ValueError naming `path` unless its header parses and the file holds every byte the header promises
    (a truncated copy otherwise fails deep inside the loader, without the file's name)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path} is truncated ({size} bytes): not a safetensors file; copy it again")
        (header_len,) = struct.unpack("<Q", head)
        if 8 + header_len > size:
            raise ValueError(
                f"{path} is truncated: its header alone needs {8 + header_len} bytes, the file has {size}"
            )
        try:
            header = json.loads(f.read(header_len))
            end = max(
                (int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0
            )
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            raise ValueError(f"{path} is corrupt: its safetensors header does not parse") from None
    if 8 + header_len + end != size:
        raise ValueError(
            f"{path} is truncated or corrupt: its header describes {8 + header_len + end} bytes, the file has {size}"
        )


def check_model_dir(directory: str, what: str) -> None:
    """Every safetensors file of a local model directory is whole."""
    for path in sorted(glob.glob(os.path.join(directory, "*.safetensors"))):
        check_safetensors(path)
    if what == "init_from":
        weights = os.path.join(directory, WEIGHTS_NAME)
        if not os.path.isfile(weights):
            raise FileNotFoundError(
                f"init_from={directory!r} has no {WEIGHTS_NAME}; pass a drafter exported with "
                "`python -m longspec.export RUN_DIR OUT_DIR`"
            )
        from safetensors.torch import load_file

        # Before the target loads (Drafter.from_pretrained checks again when it builds the drafter): a NaN
        # drafter trained every step at loss nan.
        check_finite(load_file(weights), weights, purpose="start from")


def check_inputs(cfg: TrainConfig) -> None:
    """The target, data and init_from exist and are whole (cheap: headers and sizes, no weights read)."""
    path = cfg.target.path
    if os.path.isdir(path):
        check_model_dir(path, "target")
    elif os.path.exists(path) or not _HUB_ID.match(path):
        raise FileNotFoundError(f"target.path={path!r} is not a model directory (nor a hub id)")
    if not os.path.isdir(cfg.data.path):
        raise FileNotFoundError(
            f"data.path={cfg.data.path!r} is not a directory; run `python -m data_prep.stage1|stage2|stage3_sft "
            "... --out DIR` first"
        )
    if cfg.init_from is not None:
        check_model_dir(cfg.init_from, "init_from")
    if os.path.exists(cfg.output_dir) and not os.path.isdir(cfg.output_dir):
        raise FileExistsError(f"output_dir={cfg.output_dir!r} exists and is not a directory")
    if cfg.checkpoint.resume == "never" and os.path.isdir(cfg.output_dir):
        # A fresh run saves step_N over an earlier run's step_N but leaves its later steps, which the next resume
        # and `longspec.export` (the latest checkpoint) would take for this run's.
        latest = latest_checkpoint(cfg.output_dir)
        if latest is not None:
            raise FileExistsError(
                f"output_dir={cfg.output_dir!r} holds an earlier run's checkpoints (latest {os.path.basename(latest)})"
                f" and checkpoint.resume=never starts a new run: remove {checkpoints_root(cfg.output_dir)} or "
                "choose another output_dir (checkpoint.resume=auto continues it)"
            )


def check_data(manifest: Manifest, cfg: TrainConfig, tokenizer) -> None:
    """The prepared data must fit the stage and come from the target's tokenizer."""
    stage = cfg.stage
    if manifest.packed and manifest.seq_len != stage.seq_len:
        raise ValueError(
            f"{cfg.data.path} holds packed rows of {manifest.seq_len} tokens but stage.seq_len is {stage.seq_len}; "
            "re-run the prep with --seq-len or override stage.seq_len"
        )
    if not manifest.packed and manifest.seq_len > stage.seq_len:
        raise ValueError(
            f"{cfg.data.path} allows rows of up to {manifest.seq_len} tokens, more than stage.seq_len "
            f"({stage.seq_len}); re-run the prep with --max-len {stage.seq_len} or raise stage.seq_len"
        )
    if cfg.data.check_tokenizer and tokenizer is not None:
        expected = tokenizer_fingerprint(tokenizer)["sha256"]
        if manifest.tokenizer.get("sha256") != expected:
            raise ValueError(
                f"{cfg.data.path} was tokenized with another tokenizer than the target's ({cfg.target.display}); "
                "re-run the prep with --tokenizer pointing at the target (or set data.check_tokenizer=false)"
            )


def check_data_ids(manifest: Manifest, cfg: TrainConfig, embedding_rows: int) -> None:
    """The data's tokenizer cannot produce ids past the target's embedding. data.check_tokenizer=false lets data of
    another tokenizer through (the same ids under another hash), but never ids the target cannot embed: those were
    an IndexError traceback inside the first forward."""
    vocab = manifest.tokenizer.get("vocab_size")
    if isinstance(vocab, int) and vocab > embedding_rows:
        raise ValueError(
            f"{cfg.data.path} was tokenized with a tokenizer of {vocab} tokens but the target's embedding has "
            f"{embedding_rows} rows: ids >= {embedding_rows} would index past it; re-run the prep with --tokenizer "
            "pointing at the target"
        )


def check_resume(checkpoint: str, cfg: TrainConfig, world_size: int, inputs: dict[str, Any]) -> list[str]:
    """Refuse (ValueError, one line) to resume `checkpoint` with another world size, or on other inputs
    (`inputs.run_inputs`: data, target, the config fields that decide what is trained) unless resume.force;
    returns the forced differences (for a warning). Call it after `verify_checkpoint`: the state file is parsed
    only once its checksum matched."""
    state = read_trainer_state(checkpoint, RESUME_KEYS)
    if state["world_size"] != world_size:
        # Not forcible: the optimizer state is sharded per rank, DeepSpeed cannot re-split it.
        raise ValueError(
            f"{checkpoint} was written by {state['world_size']} processes, this launch has {world_size}: "
            f"relaunch with {state['world_size']}, or start a new output_dir with init_from= an exported drafter"
        )
    saved = state.get("inputs")
    if isinstance(saved, dict):
        diffs = input_changes(saved, inputs)
    else:
        diffs = ["the checkpoint records no inputs (written by an older longspec)"]
    if diffs and not cfg.resume.force:
        raise ValueError(
            f"output_dir {cfg.output_dir!r} holds another run (step {state['step']}): {'; '.join(diffs)}; "
            "pass resume.force=true to resume it anyway, or choose another output_dir"
        )
    return diffs
