"""Run several training configs one after another in ONE distributed launch (a 2-process launch costs ~10 s).

    torchrun --standalone --nproc_per_node 2 tests/train/multi_run.py RUNS.json
RUNS.json: a list of Hydra override lists. Every run builds its own Trainer/engine; randomness is seeded from the
config, so a run here is identical to the same config launched alone.
"""

import json
import sys

from longspec.train.config import load_config
from longspec.train.distributed import init_distributed
from longspec.train.trainer import Trainer


def main() -> None:
    with open(sys.argv[1]) as f:
        runs = json.load(f)
    dist_info = init_distributed()
    for overrides in runs:
        trainer = Trainer(load_config(overrides), dist_info)
        trainer.train()
        trainer.close()


if __name__ == "__main__":
    main()
