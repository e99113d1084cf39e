"""Export a training run's drafter as a self-contained HF-style directory.

    python -m longspec.export RUN_DIR OUT_DIR [--step N] [--dtype bfloat16] [--overwrite] [--debug]

Takes the latest complete checkpoint of RUN_DIR (or step N) and writes OUT_DIR with
    config.json          DrafterConfig incl. the target fingerprint (shapes, RoPE, tokenizer hash)
    model.safetensors    the drafter block only (the target's embedding and LM head are not copied)
    draft_vocab.safetensors   the draft vocabulary's id map, for a drafter trained over one (its sha256 is in
                         config.json's draft_vocab_sha256)
    README.md            a short model card: target, stage, steps, tokens, data
The weights are the ones `Drafter.save_pretrained` wrote at checkpoint time (ZeRO-3 shards already gathered), so
export needs neither the target nor DeepSpeed. Load with `Drafter.from_pretrained(OUT_DIR, target, tokenizer)`,
which refuses a target the drafter was not trained for; `init_from=OUT_DIR` starts the next stage from it.
OUT_DIR may not be RUN_DIR or contain it (RUN_DIR/export is the usual place), and `--overwrite` replaces a previous
export only. User errors are one line on stderr with exit status 2 (`--debug` for the traceback).
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import sys

from longspec.atomic import umask_file_mode
from longspec.cli import ArgumentParser, UserError, run_cli, write_failure
from longspec.drafter import CONFIG_NAME, WEIGHTS_NAME, DrafterConfig
from longspec.drafter.files import read_draft_vocab
from longspec.drafter.vocab import DRAFT_VOCAB_NAME
from longspec.drafter.weights import check_finite
from longspec.ownership import (
    check_output_dir,
    removable,
    remove_owned,
    resolve_output,
    swap_in,
    write_marker,
)
from longspec.train.checkpoint import (
    CHECKSUMS_NAME,
    STATE_NAME,
    checkpoints_root,
    drafter_dir,
    list_checkpoints,
    read_trainer_state,
    verify_checkpoint,
)

__all__ = [
    "EXPORT_FILES",
    "default_out_dir",
    "export_marker",
    "find_checkpoint",
    "export_drafter",
    "check_out_dir",
    "main",
]

_SHARED_PREFIXES = ("embed_tokens", "lm_head", "model.", "target.")
_DTYPES = ("float32", "bfloat16", "float16")
CARD_NAME = "README.md"
EXPORT_FILES = frozenset((CONFIG_NAME, WEIGHTS_NAME, CARD_NAME))  # what every export directory holds
EXPORT_KIND = "export"  # its ownership marker's kind: `--overwrite` replaces only a directory marked so


def default_out_dir(run_dir: str) -> str:
    """RUN_DIR/export: the documented place for a run's export (the one OUT_DIR inside RUN_DIR that is allowed)."""
    return os.path.join(run_dir, "export")


def export_marker(out_dir: str) -> str:
    """The file that shows OUT_DIR holds an export. OUT_DIR is swapped in whole by a rename, so any one of its
    files proves all are there; the drafter config is the one `init_from` / `drafter.path` read first."""
    return os.path.join(out_dir, CONFIG_NAME)


def find_checkpoint(run_dir: str, step: int | None = None) -> str:
    """The checkpoint directory to export: RUN_DIR/checkpoints/step_N (latest complete one by default)."""
    root = checkpoints_root(run_dir)
    if not os.path.isdir(root):
        raise FileNotFoundError(
            f"{run_dir!r} has no checkpoints/ directory: is it a `python -m longspec.train` run?"
        )
    found = dict(list_checkpoints(run_dir))
    if not found:
        raise FileNotFoundError(f"{root} holds no complete checkpoint yet")
    if step is None:
        step = max(found)
    elif step not in found:
        raise FileNotFoundError(
            f"no complete checkpoint for step {step} in {root}; available: {sorted(found)}"
        )
    return found[step]


def _model_card(config: dict, state: dict, num_params: int) -> str:
    target = state.get("target", {})
    data = state.get("data", {})
    fingerprint = config.get("target_fingerprint", {})
    return f"""# LongSpec drafter for `{target.get("name", "?")}`

A one-block LongSpec drafter (sliding self-attention over each token and its {config.get("window")} predecessors,
cross-attention to the target's last-layer KV cache, SwiGLU MLP) for lossless long-context speculative decoding. It shares the target's
embedding and LM head, which are **not** included: load it onto its target.

| | |
|---|---|
| target | `{target.get("path", "?")}` ({fingerprint.get("model_type", "?")}, hidden {fingerprint.get("hidden_size", "?")}, vocab {fingerprint.get("vocab_size", "?")}) |
| parameters (block only) | {num_params:,} |
| draft vocabulary | {config.get("draft_vocab_size") or "the target's whole vocabulary"} ids (sha256 {config.get("draft_vocab_sha256") or "-"}) |
| stage | {state.get("stage", "?")} (initialised from: {state.get("init_from") or "scratch"}) |
| optimizer steps | {state.get("step", "?")} of {state.get("total_steps", "?")} |
| tokens seen | {state.get("tokens_seen", 0):,} |
| data | `{data.get("path", "?")}` ({data.get("rows", "?")} rows, seq len {data.get("seq_len", "?")}) |

```python
from longspec.target import TargetModel
from longspec.drafter import Drafter
target = TargetModel.from_pretrained("{target.get("path", "TARGET")}", dtype="bfloat16", device="cuda")
drafter = Drafter.from_pretrained("THIS_DIR", target)  # raises ValueError for a different target
```
"""


def _inside(path: str, root: str) -> bool:
    """`path` is `root` or below it (both already resolved)."""
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def check_out_dir(run_dir: str, out_dir: str, *, overwrite: bool) -> None:
    """Refuse an OUT_DIR whose replacement would destroy anything but a previous export, before touching a file.

    OUT_DIR may not be RUN_DIR, contain it, or lie inside its checkpoints/ (the weights being exported);
    RUN_DIR/export, the documented place, is fine. An existing non-empty OUT_DIR needs --overwrite, and even then
    only a previous export (marked so by longspec.ownership, holding only what the export wrote) is replaced, so a
    mistyped OUT_DIR such as a home directory is never deleted."""
    run, out = os.path.realpath(run_dir), os.path.realpath(out_dir)
    if _inside(run, out):
        raise UserError(
            f"OUT_DIR {out_dir!r} is the run directory {run_dir!r} or contains it; exporting there would delete "
            f"the run: choose another OUT_DIR, e.g. {default_out_dir(run_dir)!r}"
        )
    if _inside(out, checkpoints_root(run)):
        raise UserError(f"OUT_DIR {out_dir!r} lies inside {run_dir!r}/checkpoints: choose another OUT_DIR")
    out = resolve_output(out_dir)  # a symlink: its target is replaced, the link kept
    if os.path.isdir(out) and os.listdir(out) and not overwrite:
        check_output_dir(out, EXPORT_KIND, what="OUT_DIR")  # someone else's folder: say so, not "--overwrite"
        raise FileExistsError(f"{out_dir!r} exists and is not empty; pass --overwrite to replace it")
    check_output_dir(out, EXPORT_KIND, what="OUT_DIR", whole=True)


def _remove_stale_temps(out_dir: str) -> None:
    """Temp / old-export dirs next to OUT_DIR left by an export that was killed (its pid no longer runs). Only a
    directory marked as an export (or still empty, or holding only its marker being written) is ours to remove."""
    prefix = glob.escape(out_dir)
    for path in glob.glob(prefix + ".tmp-*") + glob.glob(prefix + ".old-*"):
        m = re.search(r"\.(?:tmp|old)-(\d+)$", path)
        if not m or os.path.islink(path) or not os.path.isdir(path):
            continue
        pid = int(m.group(1))
        if pid != os.getpid() and _pid_alive(pid):
            continue  # another export into the same OUT_DIR is running
        if removable(path, EXPORT_KIND):
            remove_owned(path, EXPORT_KIND)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _fsync_file(path: str) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def export_drafter(
    run_dir: str, out_dir: str, *, step: int | None = None, dtype: str | None = None, overwrite: bool = False
) -> str:
    """Write the drafter of RUN_DIR's checkpoint to OUT_DIR. Every check runs before the first write; the files
    go to OUT_DIR.tmp-PID, which is renamed into place (the old export moved aside first), so OUT_DIR holds either
    the old export or the new one, whole, and a failure leaves no temp directory behind."""
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load_file, save_file

    if dtype is not None and dtype not in _DTYPES:
        raise UserError(f"--dtype {dtype!r} is not one of {list(_DTYPES)}")
    check_out_dir(run_dir, out_dir, overwrite=overwrite)
    checkpoint = find_checkpoint(run_dir, step)
    source = drafter_dir(checkpoint)
    config_path, weights_path = os.path.join(source, CONFIG_NAME), os.path.join(source, WEIGHTS_NAME)
    if not (os.path.isfile(config_path) and os.path.isfile(weights_path)):
        raise FileNotFoundError(
            f"{source} lacks {CONFIG_NAME} / {WEIGHTS_NAME}: the checkpoint is incomplete"
        )
    if os.path.isfile(os.path.join(checkpoint, CHECKSUMS_NAME)):
        # The drafter's files against the sums the trainer wrote: a changed byte inside the weights still parses
        # as safetensors and was exported as if whole. (A checkpoint of an older version has no sums: not checked.)
        # The trainer state too: it is parsed only once its checksum matched.
        rel = os.path.relpath(source, checkpoint)
        files = [os.path.join(rel, CONFIG_NAME), os.path.join(rel, WEIGHTS_NAME), STATE_NAME]
        if os.path.exists(os.path.join(source, DRAFT_VOCAB_NAME)):
            files.append(os.path.join(rel, DRAFT_VOCAB_NAME))
        verify_checkpoint(checkpoint, files, purpose="export it")
    state = read_trainer_state(checkpoint)  # one line naming the file when it is missing or malformed
    try:
        with open(config_path) as f:
            config = json.load(f)
    except json.JSONDecodeError as e:
        raise UserError(f"{checkpoint}: unreadable JSON ({e}); the checkpoint is corrupt") from e
    if not isinstance(config, dict):  # valid JSON, not ours: an AttributeError
        raise UserError(f"{config_path} is not a JSON object; the checkpoint is corrupt")
    if not config.get("target_fingerprint"):
        raise ValueError(
            f"{config_path} has no target fingerprint; refusing to export an unverifiable drafter"
        )
    try:  # what Drafter.from_pretrained will build: else the export is written and only its loading fails
        drafter_config = DrafterConfig.from_dict({k: v for k, v in config.items() if k != "architecture"})
    except (TypeError, ValueError) as e:
        raise UserError(
            f"{config_path} is not a valid drafter config ({e}); the checkpoint is corrupt"
        ) from e
    vocab = read_draft_vocab(source, drafter_config)  # the map config.json names, whole, or one error
    files = sorted(EXPORT_FILES | ({DRAFT_VOCAB_NAME} if vocab is not None else set()))
    try:
        with safe_open(weights_path, framework="pt") as f:
            keys = list(f.keys())
        weights = load_file(weights_path)
    except (SafetensorError, OSError) as e:
        raise UserError(
            f"{weights_path} is not a readable safetensors file ({e}); the checkpoint is corrupt"
        ) from e
    check_finite(weights, weights_path, purpose="export")
    shared = [k for k in keys if k.startswith(_SHARED_PREFIXES)]
    assert not shared, (
        f"drafter checkpoint holds target weights {shared[:3]}: save_pretrained must store the block only"
    )
    if dtype is not None:
        import torch

        weights = {k: v.to(getattr(torch, dtype)) for k, v in weights.items()}
        check_finite(weights, f"{weights_path} cast to {dtype}", purpose="export")  # a value past its range

    out_dir = resolve_output(out_dir)
    _remove_stale_temps(out_dir)
    tmp = f"{out_dir}.tmp-{os.getpid()}"
    try:
        os.makedirs(tmp)
        write_marker(tmp, EXPORT_KIND)  # first: a temp dir left by a killed export is provably ours
        save_file(weights, os.path.join(tmp, WEIGHTS_NAME), metadata={"format": "pt"})
        umask_file_mode(os.path.join(tmp, WEIGHTS_NAME))
        shutil.copyfile(config_path, os.path.join(tmp, CONFIG_NAME))
        if vocab is not None:
            vocab.save(tmp)
        num_params = sum(v.numel() for v in weights.values())
        with open(os.path.join(tmp, CARD_NAME), "w") as f:
            f.write(_model_card(config, state, num_params))
        for name in files:
            _fsync_file(os.path.join(tmp, name))
        write_marker(tmp, EXPORT_KIND, files=files)
        swap_in(tmp, out_dir, EXPORT_KIND)  # OUT_DIR is the old export, absent, or the new one; never partial
    except BaseException as e:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp)  # this process's own temp dir
        cause = write_failure(e, os.path.dirname(os.path.abspath(tmp)))
        if cause is not e:
            raise cause from None
        raise
    return out_dir


def _main(argv: list[str]) -> None:
    parser = ArgumentParser(prog="python -m longspec.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", help="a training run's output_dir")
    parser.add_argument("out_dir", help="where to write the drafter")
    parser.add_argument(
        "--step", type=int, default=None, help="export this step (default: the latest checkpoint)"
    )
    parser.add_argument(
        "--dtype", default=None, help=f"cast the weights: one of {_DTYPES} (default: as trained)"
    )
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args(argv)
    checkpoint = find_checkpoint(args.run_dir, args.step)
    out = export_drafter(
        args.run_dir, args.out_dir, step=args.step, dtype=args.dtype, overwrite=args.overwrite
    )
    print(f"exported {checkpoint} -> {out}")


def main(argv: list[str] | None = None) -> int:
    """The CLI: exit status 0, or 2 with one `error:` line on stderr for a user error (`--debug`: traceback)."""
    return run_cli(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
