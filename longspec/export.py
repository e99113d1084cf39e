"""Export a training run's drafter as a self-contained HF-style directory.

    python -m longspec.export RUN_DIR OUT_DIR [--step N] [--dtype bfloat16] [--overwrite]

Takes the latest complete checkpoint of RUN_DIR (or step N) and writes OUT_DIR with
    config.json          DrafterConfig incl. the target fingerprint (shapes, RoPE, tokenizer hash)
    model.safetensors    the drafter block only (the target's embedding and LM head are not copied)
    README.md            a short model card: target, stage, steps, tokens, data
The weights are the ones `Drafter.save_pretrained` wrote at checkpoint time (ZeRO-3 shards already gathered), so
export needs neither the target nor DeepSpeed. Load with `Drafter.from_pretrained(OUT_DIR, target, tokenizer)`,
which refuses a target the drafter was not trained for; `init_from=OUT_DIR` starts the next stage from it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil

from longspec.drafter import CONFIG_NAME, WEIGHTS_NAME

__all__ = ["find_checkpoint", "export_drafter", "main"]

_SHARED_PREFIXES = ("embed_tokens", "lm_head", "model.", "target.")


def find_checkpoint(run_dir: str, step: int | None = None) -> str:
    """The checkpoint directory to export: RUN_DIR/checkpoints/step_N (latest complete one by default)."""
    root = os.path.join(run_dir, "checkpoints")
    if not os.path.isdir(root):
        raise FileNotFoundError(
            f"{run_dir!r} has no checkpoints/ directory: is it a `python -m longspec.train` run?"
        )
    steps = sorted(
        int(m.group(1))
        for name in os.listdir(root)
        if (m := re.match(r"^step_(\d{8})$", name))
        and os.path.isfile(os.path.join(root, name, "trainer_state.json"))
    )
    if not steps:
        raise FileNotFoundError(f"{root} holds no complete checkpoint yet")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise FileNotFoundError(f"no complete checkpoint for step {step} in {root}; available: {steps}")
    return os.path.join(root, f"step_{step:08d}")


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


def export_drafter(
    run_dir: str, out_dir: str, *, step: int | None = None, dtype: str | None = None, overwrite: bool = False
) -> str:
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    checkpoint = find_checkpoint(run_dir, step)
    source = os.path.join(checkpoint, "drafter")
    config_path, weights_path = os.path.join(source, CONFIG_NAME), os.path.join(source, WEIGHTS_NAME)
    if not (os.path.isfile(config_path) and os.path.isfile(weights_path)):
        raise FileNotFoundError(
            f"{source} lacks {CONFIG_NAME} / {WEIGHTS_NAME}: the checkpoint is incomplete"
        )
    with open(config_path) as f:
        config = json.load(f)
    if not config.get("target_fingerprint"):
        raise ValueError(
            f"{config_path} has no target fingerprint; refusing to export an unverifiable drafter"
        )
    with open(os.path.join(checkpoint, "trainer_state.json")) as f:
        state = json.load(f)
    with safe_open(weights_path, framework="pt") as f:
        keys = list(f.keys())
    shared = [k for k in keys if k.startswith(_SHARED_PREFIXES)]
    assert not shared, (
        f"drafter checkpoint holds target weights {shared[:3]}: save_pretrained must store the block only"
    )

    if os.path.exists(out_dir) and os.listdir(out_dir) and not overwrite:
        raise FileExistsError(f"{out_dir!r} exists and is not empty; pass --overwrite to replace it")
    tmp = f"{out_dir.rstrip(os.sep)}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    weights = load_file(weights_path)
    if dtype is not None:
        import torch

        weights = {k: v.to(getattr(torch, dtype)) for k, v in weights.items()}
    save_file(weights, os.path.join(tmp, WEIGHTS_NAME), metadata={"format": "pt"})
    shutil.copyfile(config_path, os.path.join(tmp, CONFIG_NAME))
    num_params = sum(v.numel() for v in weights.values())
    with open(os.path.join(tmp, "README.md"), "w") as f:
        f.write(_model_card(config, state, num_params))
    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    os.rename(tmp, out_dir)  # the export appears whole or not at all
    return out_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", help="a training run's output_dir")
    parser.add_argument("out_dir", help="where to write the drafter")
    parser.add_argument(
        "--step", type=int, default=None, help="export this step (default: the latest checkpoint)"
    )
    parser.add_argument("--dtype", default=None, help="cast the weights, e.g. bfloat16 (default: as trained)")
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args(argv)
    out = export_drafter(
        args.run_dir, args.out_dir, step=args.step, dtype=args.dtype, overwrite=args.overwrite
    )
    print(f"exported {find_checkpoint(args.run_dir, args.step)} -> {out}")


if __name__ == "__main__":
    main()
