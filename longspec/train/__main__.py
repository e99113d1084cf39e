"""Entry point: `python -m longspec.train [hydra overrides]`, under `deepspeed` or `torchrun` for several processes.

    torchrun --nproc_per_node 8 -m longspec.train target=llama31_8b stage=stage1_slimpajama data.path=data/stage1
    deepspeed --num_gpus 8 --module longspec.train stage=stage2_prolong init_from=runs/llama31_8b/stage1/export
The Hydra config is composed and validated into a `TrainConfig` here, once; everything below sees dataclasses.
A user error (bad override, missing or truncated input, locked or foreign run directory) is one line on stderr and
exit status 2; `--debug` or HYDRA_FULL_ERROR=1 shows the traceback.
"""

from __future__ import annotations

import os
import sys

from longspec.lifetime import die_with_launcher


def main(argv: list[str] | None = None) -> None:
    if (
        "RANK" in os.environ
    ):  # a worker of torchrun / deepspeed: die with the launcher, armed before slow imports
        die_with_launcher()
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or os.environ.get("HYDRA_FULL_ERROR") == "1"  # as longspec.cli.run_cli
    # The deepspeed launcher appends --local_rank=N (LOCAL_RANK is in the environment as well).
    overrides = [a for a in argv if not a.startswith("--local_rank") and a != "--debug"]
    if any(a in ("-h", "--help") for a in overrides):
        print(__doc__)
        return
    from omegaconf import OmegaConf

    from longspec.atomic import write_text_atomic
    from longspec.cli import USER_ERRORS, one_line, os_error_line
    from longspec.train.config import load_config
    from longspec.train.trainer import Trainer, TrainingStopped

    # Only set-up is a user's mistake (config, inputs, run directory); an error inside the training loop is a bug
    # and keeps its traceback, which is why this is not `run_cli` around the whole of main.
    try:
        cfg = load_config(overrides)
        trainer = Trainer(cfg)
    except USER_ERRORS as e:
        if debug:
            raise
        if os.environ.get("RANK", "0") == "0":  # every rank fails alike; one line is enough
            print(f"error: {os_error_line(e) or one_line(e)}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    try:
        if trainer.rank == 0:
            write_text_atomic(  # a resume never finds half a config; a failed write leaves no temp file
                os.path.join(trainer.run_dir, "config.yaml"),
                f"# python -m longspec.train {' '.join(overrides)}\n"
                + OmegaConf.to_yaml(OmegaConf.structured(cfg)),
            )
        trainer.train()
    except TrainingStopped as e:  # a run that diverged: one line, like a user error (its fix is the user's)
        if trainer.rank == 0:
            print(f"error: {one_line(e)}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    except OSError as e:  # a full disk or a read-only folder while saving: one line, not a traceback
        if debug or os_error_line(e) is None:
            raise
        if trainer.rank == 0:
            print(f"error: {os_error_line(e)}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    finally:
        trainer.close()


if __name__ == "__main__":
    main()
