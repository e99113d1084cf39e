"""Process-group start-up for `deepspeed` / `torchrun` launches (one process per GPU, or CPU processes on gloo)."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import torch

from longspec.lifetime import die_with_launcher

__all__ = ["DistInfo", "init_distributed"]


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(backend: str = "auto") -> DistInfo:
    """Start torch.distributed through DeepSpeed. Without a launcher, runs as a single process (rank 0 of 1)."""
    import deepspeed

    if "RANK" in os.environ:  # started by a launcher (torchrun / deepspeed): share its fate
        die_with_launcher()
    else:
        # A plain `python -m longspec.train`: a world of one (DeepSpeed would otherwise look for MPI).
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    on_gpu = torch.cuda.is_available()
    if backend == "auto":
        backend = "nccl" if on_gpu else "gloo"
    if not on_gpu:
        # DeepSpeed's CPU accelerator JIT-compiles a shared-memory comm op on first use; gloo does the same
        # collectives with no build step. Private switch, kept in this one place.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if on_gpu:
        torch.cuda.set_device(local_rank)
    deepspeed.init_distributed(dist_backend=backend)
    device = torch.device("cuda", local_rank) if on_gpu else torch.device("cpu")
    return DistInfo(
        rank=torch.distributed.get_rank(),
        world_size=torch.distributed.get_world_size(),
        local_rank=local_rank,
        device=device,
    )
