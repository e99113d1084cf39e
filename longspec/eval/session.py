"""The models an evaluation decodes with, kept from one run to the next within a process
(`python -m longspec.eval.runs`): the target, the drafter and the engine, with its static steps / CUDA graphs and
its measured round costs.

Why: as separate processes, each evaluation of a suite starts, loads the models, captures the graphs and measures
tree=auto's round costs again, which can take longer than its decoding. A run that follows one with the same
target (source, dtype, device) reuses all of it; a run with another target replaces it (one target at a time: a
user's 8B target in two dtypes would not fit twice).

What does not carry over: the adaptive tree policies (acceptance per depth, learned round times), which are
cleared at each run's start, so a run decides its trees as it would in a fresh process. The measured round costs
do carry over: they are a property of the device and the engine, measured once per decoding mode."""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass

import torch

from longspec.infer.engine import SpeculativeEngine

__all__ = ["EvalSession"]

logger = logging.getLogger("longspec.eval")


@dataclass(frozen=True)
class _TargetKey:
    repo: str
    gguf_file: str | None
    dtype: torch.dtype
    device: torch.device
    trust_remote_code: bool


@dataclass(frozen=True)
class _DrafterKey:
    init: str
    path: str | None
    seed: int
    window: int | None


class EvalSession:
    """One target and one engine at a time, reused by the next run that asks for the same ones."""

    def __init__(self):
        self._target_key: _TargetKey | None = None
        self._drafter_key: _DrafterKey | None = None
        self.target = None
        self.engine: SpeculativeEngine | None = None
        self.loads = 0  # targets loaded in this session (tests, and the run's log)

    def engine_for(self, cfg, *, model_source, tokenizer, device: torch.device, dtype: torch.dtype):
        """The engine of `cfg`'s target (loaded from `model_source` in `dtype` on `device`) and, when a method
        needs it, its drafter: the previous run's when it asked for the same, else a new one."""
        target_key = _TargetKey(
            model_source.repo, model_source.gguf_file, dtype, device, cfg.target.trust_remote_code
        )
        drafter_key = _drafter_key(cfg) if "longspec" in cfg.methods else None
        if target_key != self._target_key:
            self.release()  # before loading the next target: the two need not fit together
            self.target = _load_target(target_key)
            self._target_key = target_key
            self.loads += 1
        elif self.engine is not None and drafter_key not in (None, self._drafter_key):
            self._drop_engine()  # its steps hold the old drafter; free them before the new engine builds its own
            logger.info("session: same target (%s), another drafter: a new engine", model_source)
        elif self.engine is not None:
            logger.info("session: the previous run's target and engine (%s), reused", model_source)
        if self.engine is None:
            drafter = None if drafter_key is None else _build_drafter(cfg, self.target, tokenizer)
            self.engine = SpeculativeEngine(self.target, drafter)
            self._drafter_key = drafter_key
        # What the previous run's rounds taught the tree policy stays with that run.
        self.engine.policies.clear()
        return self.engine

    def release(self) -> None:
        """Drop the target and the engine (the next run loads its own): after a failed run, whose error may have
        left them half-way through a step."""
        self.engine = self.target = self._target_key = self._drafter_key = None
        _free_memory()

    def _drop_engine(self) -> None:
        if self.engine is not None:
            self.engine = self._drafter_key = None
            _free_memory()


def _free_memory() -> None:
    gc.collect()  # an engine's CUDA graphs and caches are reference cycles: free their memory now
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _drafter_key(cfg) -> _DrafterKey:
    d = cfg.drafter
    if d.init == "random":
        return _DrafterKey("random", None, d.seed, d.random_window)
    return _DrafterKey("pretrained", d.path, 0, None)


def _load_target(key: _TargetKey):
    from longspec.target import TargetModel

    target = TargetModel.from_pretrained(
        key.repo,
        gguf_file=key.gguf_file,
        dtype=key.dtype,
        device=key.device,
        trust_remote_code=key.trust_remote_code,
    )
    target.to(
        key.device
    )  # the adapter's own rotary buffers too (else a host copy per step, which graphs forbid)
    return target


def _build_drafter(cfg, target, tokenizer):
    """The drafter `longspec` decodes with: loaded (fingerprint-checked against the target) or random."""
    from longspec.drafter import Drafter, DrafterConfig

    weight = target.embed_tokens.weight
    if cfg.drafter.init == "random":
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.drafter.seed)
            config = DrafterConfig.from_target_config(
                target.config, window=cfg.drafter.random_window, tokenizer=tokenizer
            )
            drafter = Drafter(config, target.embed_tokens, target.lm_head)
        return drafter.to(device=weight.device, dtype=weight.dtype).requires_grad_(False).eval()
    # Raises ValueError naming the mismatching fields when the drafter was trained for another target.
    return Drafter.from_pretrained(
        cfg.drafter.path, target, tokenizer, dtype=weight.dtype, device=weight.device
    )
