"""Entry point: `python -m longspec.train [hydra overrides]`, under `deepspeed` or `torchrun` for several processes.

    torchrun --nproc_per_node 8 -m longspec.train target=llama31_8b stage=stage1_slimpajama data.path=data/stage1
    deepspeed --num_gpus 8 --module longspec.train stage=stage2_prolong init_from=runs/llama31_8b/stage1/export
The Hydra config is composed and validated into a `TrainConfig` here, once; everything below sees dataclasses.
"""

from __future__ import annotations

import os
import sys


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    # The deepspeed launcher appends --local_rank=N (LOCAL_RANK is in the environment as well).
    overrides = [a for a in argv if not a.startswith("--local_rank")]
    if any(a in ("-h", "--help") for a in overrides):
        print(__doc__)
        return
    from omegaconf import OmegaConf

    from longspec.train.config import load_config
    from longspec.train.trainer import Trainer

    try:
        cfg = load_config(overrides)
    except (ValueError, FileNotFoundError) as e:  # a user mistake in the overrides or YAML: no traceback
        raise SystemExit(f"error: {e}") from None
    trainer = Trainer(cfg)
    if trainer.rank == 0:
        with open(os.path.join(trainer.run_dir, "config.yaml"), "w") as f:
            f.write(f"# python -m longspec.train {' '.join(overrides)}\n")
            f.write(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    try:
        trainer.train()
    finally:
        trainer.close()


if __name__ == "__main__":
    main()
