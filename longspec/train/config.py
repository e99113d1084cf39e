"""Typed schemas of the training config (composed by Hydra from configs/, converted once in `main`).

    python -m longspec.train target=llama31_8b stage=stage1_slimpajama data.path=data/stage1 output_dir=runs/s1

Groups: `target` (which frozen model), `stage` (the recipe: data shape, positions, batch, optimizer -- stage files
also set `deepspeed.zero_stage`), `deepspeed` (typed fields turned into the DeepSpeed JSON by
`deepspeed_config.build_deepspeed_config`), `loss`, `checkpoint`, `logging`. Below `main()` only these
dataclasses exist; `__post_init__` rejects nonsense with a ValueError naming the field.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from omegaconf import MISSING

from longspec.config import Schema, TargetConfig, check, compose, drafter_window

__all__ = [
    "TargetConfig",
    "DrafterSettings",
    "DataConfig",
    "StageConfig",
    "OptimConfig",
    "LossConfig",
    "DeepSpeedSettings",
    "CheckpointConfig",
    "ResumeConfig",
    "LoggingConfig",
    "TrainConfig",
    "load_config",
]
# TargetConfig lives in longspec.config (shared with eval); re-exported here for existing imports.


@dataclass(kw_only=True)
class DrafterSettings(Schema):
    """Drafter shape choices that are not copied from the target."""

    # sliding self-attention: the token + `window` previous tokens (ALGORITHM §2). null: an init_from drafter's
    # own, else longspec.drafter.DEFAULT_WINDOW; TrainConfig resolves it (a value that disagrees with init_from's
    # drafter is an error), so the trainer always sees a number
    window: int | None = None
    # a reduced draft vocabulary (longspec.drafter.vocab): the head scores only these many ids, chosen from token
    # counts of `draft_vocab_data`. null: an init_from drafter's own, else the target's whole vocabulary
    draft_vocab_size: int | None = None
    # prepared datasets whose trained-on tokens choose the ids (the drafter's own training data, e.g. stage 1 and
    # stage 3); empty: data.path
    draft_vocab_data: list[str] = field(default_factory=list)

    def validate(self) -> None:
        check(self.window is None or self.window >= 1, f"drafter.window must be >= 1, got {self.window}")
        check(
            self.draft_vocab_size is None or self.draft_vocab_size >= 1,
            f"drafter.draft_vocab_size must be >= 1, got {self.draft_vocab_size}",
        )
        for path in self.draft_vocab_data:
            if not os.path.isdir(path):
                raise FileNotFoundError(
                    f"drafter.draft_vocab_data: {path!r} is not a prepared dataset directory (from data_prep)"
                )


@dataclass(kw_only=True)
class DataConfig(Schema):
    """Prepared data (a directory written by data_prep.stage1|stage2|stage3_sft)."""

    path: str = MISSING  # directory with manifest.json + shards
    num_epochs: int = 1  # passes over the data when max_steps < 0 (the paper trains 1 epoch per stage)
    shuffle: bool = True  # permute rows each epoch (seeded by seed + epoch)
    pad_to_multiple: int = 64  # pad ragged SFT rows to a multiple of this (fewer distinct shapes)
    check_tokenizer: bool = True  # refuse data tokenized by a tokenizer other than the target's

    def validate(self) -> None:
        check(bool(self.path), "data.path must point to a prepared data directory")
        check(self.num_epochs >= 1, f"data.num_epochs must be >= 1, got {self.num_epochs}")
        check(self.pad_to_multiple >= 1, f"data.pad_to_multiple must be >= 1, got {self.pad_to_multiple}")


@dataclass(kw_only=True)
class StageConfig(Schema):
    """One training stage (ALGORITHM §3.5 / paper App. D)."""

    name: str = MISSING  # stage1_slimpajama | stage2_prolong | stage3_sft | a tiny variant
    position_ids: str = "plain"  # "anchor_offset" (stage 1) or "plain" (0..T-1, long stages)
    num_anchors: int = 4  # anchor-offset: the first positions kept as attention sinks
    # anchor-offset: MAX_LEN, every position id stays below it (ALGORITHM §3.1). null: derived from the target's
    # trained context (longspec.positions.default_max_len: 15000 for 16K, 30000 for 32K and longer). Training-only,
    # so it lives here and not in the target schema that eval shares; the value depends on the target, which is why
    # it is derived from the target's own config rather than written into target or stage YAMLs. Resolved by
    # resolve_anchor_max_len when the target is loaded; unused by plain-position stages.
    anchor_max_len: int | None = None
    num_draft_levels: int = 5  # gamma: flash-noisy lag j ~ U{1..gamma-1}, one draw per micro-batch
    flash_noisy: bool = True  # the lag above (all paper stages); False trains with lag 0
    seq_len: int = MISSING  # row length the data must have (packed) or not exceed (SFT)
    global_batch_size: int = MISSING  # sequences per optimizer step over all ranks
    micro_batch_size: int = 1  # sequences per rank per forward

    def validate(self) -> None:
        check(bool(self.name), "stage.name must not be empty (it names the run and is checked on resume)")
        check(
            self.position_ids in ("anchor_offset", "plain"),
            f"stage.position_ids must be 'anchor_offset' or 'plain', got {self.position_ids!r}",
        )
        check(self.num_anchors >= 0, f"stage.num_anchors must be >= 0, got {self.num_anchors}")
        check(
            self.num_draft_levels >= 2,
            f"stage.num_draft_levels (gamma) must be >= 2, got {self.num_draft_levels}",
        )
        check(self.seq_len >= 2, f"stage.seq_len must be >= 2, got {self.seq_len}")
        check(self.micro_batch_size >= 1, f"stage.micro_batch_size must be >= 1, got {self.micro_batch_size}")
        check(
            self.global_batch_size >= self.micro_batch_size,
            f"stage.global_batch_size ({self.global_batch_size}) < stage.micro_batch_size ({self.micro_batch_size})",
        )
        check(
            self.global_batch_size % self.micro_batch_size == 0,
            f"stage.global_batch_size ({self.global_batch_size}) must be a multiple of stage.micro_batch_size "
            f"({self.micro_batch_size})",
        )
        check(
            self.position_ids != "anchor_offset" or self.num_anchors < self.seq_len,
            f"stage.num_anchors ({self.num_anchors}) must be < stage.seq_len ({self.seq_len})",
        )
        check(
            self.anchor_max_len is None or self.anchor_max_len >= 1,
            f"stage.anchor_max_len must be >= 1, got {self.anchor_max_len}",
        )
        check(
            self.position_ids != "anchor_offset"
            or self.anchor_max_len is None
            or self.anchor_max_len >= self.seq_len,
            f"stage.anchor_max_len ({self.anchor_max_len}) must be >= stage.seq_len ({self.seq_len})",
        )

    def resolve_anchor_max_len(self, max_positions: int | None) -> int:
        """MAX_LEN of this anchor-offset stage for a target of `max_positions` positions (its config's
        max_position_embeddings; None when it has none): an explicit stage.anchor_max_len wins but must fit the
        target's context, null derives the paper's value from it (longspec.positions.default_max_len)."""
        from longspec.positions import default_max_len

        assert self.position_ids == "anchor_offset", self.position_ids
        if self.anchor_max_len is not None:
            check(
                max_positions is None or self.anchor_max_len <= max_positions,
                f"stage.anchor_max_len ({self.anchor_max_len}) exceeds the target's context ({max_positions} "
                "positions)",
            )
            return self.anchor_max_len
        check(
            max_positions is not None,
            f"stage {self.name} uses anchor-offset positions and the target's config has no "
            "max_position_embeddings to derive MAX_LEN from: set stage.anchor_max_len (its trained context)",
        )
        derived = default_max_len(max_positions)
        check(
            derived >= self.seq_len,
            f"stage.seq_len ({self.seq_len}) exceeds the anchor-offset MAX_LEN {derived} derived from the "
            f"target's context ({max_positions} positions): set stage.anchor_max_len (<= {max_positions}) or "
            "shorten the rows",
        )
        return derived


@dataclass(kw_only=True)
class OptimConfig(Schema):
    """AdamW + cosine schedule with linear warmup + gradient clipping."""

    lr: float = MISSING  # peak learning rate
    min_lr_ratio: float = 0.0  # the cosine decays to lr * min_lr_ratio
    warmup_ratio: float = 0.1  # fraction of the steps spent in linear warmup
    weight_decay: float = 0.1  # decoupled; not applied to norms and biases
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global grad norm (0 disables)

    def validate(self) -> None:
        check(self.lr > 0, f"optim.lr must be > 0, got {self.lr}")
        check(0 <= self.min_lr_ratio <= 1, f"optim.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        check(0 <= self.warmup_ratio < 1, f"optim.warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
        check(self.weight_decay >= 0, f"optim.weight_decay must be >= 0, got {self.weight_decay}")
        check(
            len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
            f"optim.betas must be two values in [0, 1), got {list(self.betas)}",
        )
        check(self.eps > 0, f"optim.eps must be > 0, got {self.eps}")
        check(self.grad_clip >= 0, f"optim.grad_clip must be >= 0, got {self.grad_clip}")


@dataclass(kw_only=True)
class LossConfig(Schema):
    """Next-token CE on the data labels (+ optional KL to the target), both fused: no [tokens x vocab] logits."""

    distill_weight: float = 0.0  # weight of KL(target || drafter) per token; 0 = hard labels only (the paper)
    distill_temperature: float = 1.0  # softmax temperature of both distributions in the KL
    backend: str = "auto"  # fused CE backend: auto (Liger on CUDA, else chunked) | liger | chunked | torch
    chunk_size: int | None = None  # rows per chunk of the chunked losses (default: ~8M logits per chunk)

    def validate(self) -> None:
        check(self.distill_weight >= 0, f"loss.distill_weight must be >= 0, got {self.distill_weight}")
        check(
            self.distill_temperature > 0,
            f"loss.distill_temperature must be > 0, got {self.distill_temperature}",
        )
        check(
            self.backend in ("auto", "liger", "chunked", "torch"),
            f"loss.backend must be auto, liger, chunked or torch, got {self.backend!r}",
        )
        check(
            self.chunk_size is None or self.chunk_size >= 1,
            f"loss.chunk_size must be >= 1, got {self.chunk_size}",
        )


@dataclass(kw_only=True)
class DeepSpeedSettings(Schema):
    """Typed DeepSpeed choices; the JSON is built from them in one function."""

    zero_stage: int = 1  # 1: shard optimizer states; 3: also gradients and parameters, the frozen target too
    offload_optimizer: bool = False  # optimizer states in CPU memory (DeepSpeedCPUAdam)
    offload_params: bool = False  # ZeRO-3 only: parameters in CPU memory
    precision: str = "auto"  # auto (bf16 on GPU, fp32 on CPU) | bf16 | fp32
    backend: str = "auto"  # torch.distributed backend: auto (nccl on GPU, gloo on CPU) | nccl | gloo

    def validate(self) -> None:
        check(
            self.zero_stage in (0, 1, 2, 3),
            f"deepspeed.zero_stage must be 0, 1, 2 or 3, got {self.zero_stage}",
        )
        check(
            self.precision in ("auto", "bf16", "fp32"),
            f"deepspeed.precision must be auto, bf16 or fp32, got {self.precision!r}",
        )
        check(
            self.backend in ("auto", "nccl", "gloo"),
            f"deepspeed.backend must be auto, nccl or gloo, got {self.backend!r}",
        )
        check(
            not self.offload_params or self.zero_stage == 3,
            "deepspeed.offload_params needs deepspeed.zero_stage=3",
        )


@dataclass(kw_only=True)
class CheckpointConfig(Schema):
    """Periodic atomic checkpoints under <output_dir>/checkpoints."""

    save_every: int = 500  # optimizer steps between checkpoints (the last step is always saved)
    keep_last: int = 2  # checkpoints kept (older ones are deleted after a new one is complete)
    resume: str = "auto"  # auto: continue from the latest checkpoint in output_dir if any | never

    def validate(self) -> None:
        check(self.save_every >= 1, f"checkpoint.save_every must be >= 1, got {self.save_every}")
        check(self.keep_last >= 1, f"checkpoint.keep_last must be >= 1, got {self.keep_last}")
        check(
            self.resume in ("auto", "never"), f"checkpoint.resume must be auto or never, got {self.resume!r}"
        )


@dataclass(kw_only=True)
class ResumeConfig(Schema):
    """What a resume may override. A run directory is resumed only by the run that wrote it (same target, data,
    stage and world size) and only while no other trainer holds its lock."""

    force: bool = False  # resume despite another target / data path / stage, or take over another host's lock

    def validate(self) -> None:
        check(isinstance(self.force, bool), f"resume.force must be true or false, got {self.force!r}")


@dataclass(kw_only=True)
class LoggingConfig(Schema):
    """Console line + metrics.jsonl every step; optional Weights & Biases."""

    log_every: int = 1  # console line every N optimizer steps (metrics.jsonl gets every step)
    wandb: str = "disabled"  # disabled | offline | online
    wandb_project: str = "longspec"
    run_name: str | None = None  # default: the output directory's name

    def validate(self) -> None:
        check(self.log_every >= 1, f"logging.log_every must be >= 1, got {self.log_every}")
        check(bool(self.wandb_project), "logging.wandb_project must not be empty")
        check(self.run_name is None or bool(self.run_name), "logging.run_name must not be empty (or null)")
        check(
            self.wandb in ("disabled", "offline", "online"),
            f"logging.wandb must be disabled, offline or online, got {self.wandb!r}",
        )


@dataclass(kw_only=True)
class TrainConfig(Schema):
    """Everything one training run needs."""

    target: TargetConfig = field(default_factory=TargetConfig)
    stage: StageConfig = field(default_factory=StageConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    drafter: DrafterSettings = field(default_factory=DrafterSettings)
    loss: LossConfig = field(default_factory=LossConfig)
    deepspeed: DeepSpeedSettings = field(default_factory=DeepSpeedSettings)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    resume: ResumeConfig = field(default_factory=ResumeConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    output_dir: str = MISSING  # run directory: checkpoints, metrics.jsonl, train.log, config.yaml
    init_from: str | None = (
        None  # an exported drafter (python -m longspec.export) to start from: stage chaining
    )
    max_steps: int = -1  # optimizer steps (the LR schedule's length); -1 = data.num_epochs epochs
    stop_at_step: int = (
        -1
    )  # end this launch after this step (checkpointed), schedule unchanged: time-limited jobs
    seed: int = 0  # data order, anchor offsets, noisy lags and drafter init
    # stop the run (exit 2) after this many consecutive steps whose loss or gradient norm is NaN / inf: a
    # transient one (a bad batch) is logged and passes, a diverged run ends instead of training on nan
    max_nonfinite_steps: int = 3

    def validate(self) -> None:
        check(
            self.max_steps == -1 or self.max_steps >= 1, f"max_steps must be -1 or >= 1, got {self.max_steps}"
        )
        check(
            self.max_nonfinite_steps >= 1, f"max_nonfinite_steps must be >= 1, got {self.max_nonfinite_steps}"
        )
        check(
            self.stop_at_step == -1 or self.stop_at_step >= 1,
            f"stop_at_step must be -1 or >= 1, got {self.stop_at_step}",
        )
        check(bool(self.output_dir), "output_dir must be set")
        check(
            bool(self.target.name),
            "target.name must not be empty (it names the run and is checked on resume)",
        )
        inputs = {"target.path": self.target.path, "data.path": self.data.path, "init_from": self.init_from}
        for name, path in inputs.items():
            # The run directory is written (config.yaml, train.log, checkpoints/): never one of the inputs.
            check(
                path is None or os.path.abspath(path) != os.path.abspath(self.output_dir),
                f"output_dir {self.output_dir!r} is the {name}: choose a directory of its own for the run",
            )
        if self.init_from is not None and not os.path.isdir(self.init_from):
            raise FileNotFoundError(
                f"init_from={self.init_from!r} is not a directory; pass a drafter exported with "
                "`python -m longspec.export RUN_DIR OUT_DIR`"
            )
        self.drafter.window = drafter_window(self.drafter.window, self.init_from, field="drafter.window")


def load_config(overrides: list[str] | None = None, *, config_name: str = "train") -> TrainConfig:
    """Compose configs/<config_name>.yaml with Hydra overrides and validate it into a TrainConfig."""
    return compose(
        TrainConfig,
        schema_name="train_schema",
        config_name=config_name,
        overrides=overrides,
        what="training config",
    )
