"""Helpers shared by the inference tests (imported by name: tests/infer is on sys.path under pytest)."""

import torch

from longspec.drafter import Drafter, DrafterConfig

WINDOW = 8  # drafter window, far below the prompt lengths the tests use


def reference_greedy(target, prompt: torch.Tensor, num_tokens: int) -> list[int]:
    """Target-only greedy decoding with full forwards of the HF model (no cache): obviously right."""
    ids = prompt[None]
    for _ in range(num_tokens):
        next_id = target.model(ids).logits[0, -1].argmax()
        ids = torch.cat([ids, next_id.reshape(1, 1)], dim=1)
    return ids[0, prompt.numel() :].tolist()


def random_drafter(target, window: int = WINDOW) -> Drafter:
    return Drafter(
        DrafterConfig.from_target_config(target.config, window=window), target.embed_tokens, target.lm_head
    )
