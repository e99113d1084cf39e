"""The drafter on disk: `model.safetensors` (the block alone), `config.json` (its shapes and the target
fingerprint) and, for a drafter with a reduced draft vocabulary, `draft_vocab.safetensors` (its id map).

Every file goes to a temporary name and is renamed into place, so a crash never leaves a truncated one; a load
checks the target fingerprint, the weights' finiteness and the id map's hash before any of it is used.
"""

from __future__ import annotations

import json
import os

import torch

from longspec.atomic import umask_file_mode, write_text_atomic
from longspec.drafter.config import DrafterConfig, read_config
from longspec.drafter.vocab import DRAFT_VOCAB_NAME, DraftVocab
from longspec.drafter.weights import check_finite
from longspec.fingerprint import fingerprint_mismatches, target_fingerprint

__all__ = ["CONFIG_NAME", "WEIGHTS_NAME", "load_drafter", "save_drafter"]

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"


def save_drafter(drafter, out_dir: str | os.PathLike) -> None:
    """Write the block alone: model.safetensors + config.json (+ draft_vocab.safetensors with a draft vocabulary;
    the config records its size and hash, so a copy that lost the map is refused at load)."""
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in drafter.state_dict().items()}
    weights = os.path.join(out_dir, WEIGHTS_NAME)
    save_file(state, weights + ".tmp", metadata={"format": "pt"})
    umask_file_mode(weights + ".tmp")
    os.replace(weights + ".tmp", weights)
    vocab = drafter.draft_vocab
    if vocab is not None:
        umask_file_mode(vocab.save(out_dir))
    config = {"architecture": "LongSpecDrafter", **drafter.config.to_dict()}
    write_text_atomic(os.path.join(out_dir, CONFIG_NAME), json.dumps(config, indent=2, sort_keys=True))


def _check_target(target, device: torch.device | None) -> None:
    if not all(hasattr(target, name) for name in ("config", "embed_tokens", "lm_head")):
        raise TypeError(
            f"target must be the loaded TargetModel the drafter runs on, got {type(target).__name__}"
        )
    if device is not None:
        weights_on = target.embed_tokens.weight.device
        if weights_on.type != "meta" and (
            device.type != weights_on.type or device.index not in (None, weights_on.index)
        ):
            raise ValueError(
                f"device {str(device)!r}: the target's weights are on {str(weights_on)!r}, and the drafter "
                "runs on its embedding and LM head; load both onto one device"
            )


def read_draft_vocab(path: str, config: DrafterConfig) -> DraftVocab | None:
    """The id map a saved drafter's config announces (None for a full-vocabulary drafter): present, readable and
    the one the config names, or one ValueError naming the file."""
    vocab = DraftVocab.load(path)
    if config.draft_vocab_size is None:
        if vocab is not None:
            raise ValueError(
                f"{os.path.join(path, DRAFT_VOCAB_NAME)} is not announced by the drafter's config.json"
            )
        return None
    if vocab is None:
        raise FileNotFoundError(
            f"{os.path.join(path, DRAFT_VOCAB_NAME)} not found: the drafter was trained over a draft vocabulary of "
            f"{config.draft_vocab_size} ids; copy or export the whole drafter directory"
        )
    if vocab.fingerprint() != config.draft_vocab_sha256 or vocab.vocab_size != config.vocab_size:
        raise ValueError(
            f"{os.path.join(path, DRAFT_VOCAB_NAME)} is not the draft vocabulary this drafter was trained with "
            "(its hash differs from config.json's draft_vocab_sha256)"
        )
    return vocab


def load_drafter(
    cls,
    path: str | os.PathLike,
    target,
    tokenizer=None,
    *,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
    draft_head: bool = True,
):
    """Load a saved block onto `target` (a TargetModel), refusing a target it was not trained for.

    The tokenizer hash is compared when both the checkpoint and the call have a tokenizer. dtype: a torch
    dtype or its name as for `TargetModel.from_pretrained` ("auto": the saved weights' dtype; None: float32);
    device: the target's (the block runs on the target's embedding and LM head). A directory that is not a
    whole drafter (a config.json that is not a drafter config, damaged weights, a missing id map) is one
    ValueError naming the file. draft_head=False: a draft vocabulary's head rows are not copied out of the
    target's LM head (`Drafter.use_draft_vocab`), for a drafter whose weights only seed training: the trainer
    reads the rows itself, and under ZeRO-3 the head is a shard with no rows to copy."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from longspec.target_source import resolve_device, resolve_dtype

    dtype, device = resolve_dtype(dtype), resolve_device(device)
    _check_target(target, device)  # each one error naming the argument, not an error from deep in torch
    path = os.path.expanduser(os.fspath(path))  # as the target's path (target_source.resolve_source)
    if os.path.isfile(path):
        raise FileNotFoundError(
            f"{path!r} is a file: give the drafter's directory (holding {CONFIG_NAME} and {WEIGHTS_NAME})"
        )
    config_path, weights_path = os.path.join(path, CONFIG_NAME), os.path.join(path, WEIGHTS_NAME)
    for p in (config_path, weights_path):
        if not os.path.isfile(p):
            raise FileNotFoundError(
                f"{p} not found: is {path!r} a directory written by Drafter.save_pretrained?"
            )
    config = read_config(config_path)  # a damaged or foreign file: one ValueError naming it
    problems = fingerprint_mismatches(config.target_fingerprint, target_fingerprint(target.config, tokenizer))
    if problems:
        raise ValueError(
            f"drafter at {path!r} does not match this target:\n  "
            + "\n  ".join(problems)
            + "\nload the target (and tokenizer) it was trained for, or train a drafter for this one"
        )
    vocab = read_draft_vocab(path, config)
    try:
        state = load_file(weights_path)
    except (SafetensorError, OSError) as e:
        raise ValueError(
            f"{weights_path} is not a readable safetensors file ({e}): truncated or damaged; copy or export "
            "the drafter again"
        ) from e
    check_finite(state, weights_path, purpose="load")
    if dtype == "auto":
        dtype = next(iter(state.values())).dtype if state else None
    drafter = cls(config, target.embed_tokens, target.lm_head)
    try:
        drafter.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise ValueError(
            f"{weights_path} does not hold the block {config_path} describes: {' '.join(str(e).split())}"
        ) from e
    # For inference, like the target: frozen (so the engine can pack its projections) and in eval mode.
    # Training starts from its weights through a fresh module (train.build.init_drafter_weights).
    drafter = drafter.to(device=device, dtype=dtype).requires_grad_(False).eval()
    drafter.use_draft_vocab(vocab, head=draft_head)  # its head rows on the target head's device
    return drafter
