"""What a training run is built from: the frozen target and the drafter (`build_model`, ZeRO-3 aware), the
DeepSpeed engine with its optimizer groups and LR schedule (`build_engine`), and the target's tokenizer.
`Trainer` (trainer.py) calls these once, before the first step.
"""

from __future__ import annotations

import logging
import math
from contextlib import nullcontext
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR

from longspec.config import TargetConfig, check
from longspec.data.token_counts import token_counts
from longspec.drafter import Drafter, DrafterConfig
from longspec.drafter.vocab import DraftVocab, check_draft_vocab_size, special_token_ids
from longspec.target import TargetModel
from longspec.target_source import load_config, load_tokenizer
from longspec.train.config import TrainConfig
from longspec.train.model import DraftingModel

__all__ = [
    "build_engine",
    "build_model",
    "cosine_with_warmup",
    "decay_groups",
    "import_model_class",
    "init_drafter_weights",
    "load_target_tokenizer",
]

log = logging.getLogger("longspec.train")


def cosine_with_warmup(total_steps: int, warmup_ratio: float, min_lr_ratio: float):
    """LR multiplier for optimizer step s (0-based): linear warmup to 1, then cosine down to min_lr_ratio."""
    warmup = math.ceil(warmup_ratio * total_steps)

    def multiplier(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return multiplier


def load_target_tokenizer(target: TargetConfig):
    """The target's tokenizer, or None (with a warning) for a target directory without one."""
    source = target.source()
    try:
        return load_tokenizer(source, trust_remote_code=target.trust_remote_code)
    except (OSError, ValueError) as e:
        if source.gguf_file:
            raise  # a GGUF always carries its tokenizer: failing to read it is an error in the file
        # A target directory without a tokenizer (e.g. random weights): no data/tokenizer check is possible.
        log.warning("no tokenizer at %s (%s): the data's tokenizer cannot be checked", source, e)
        return None


def import_model_class(hf_config) -> None:
    """Import the HF modeling module of `hf_config` (and torch._dynamo, which it pulls in lazily) now. Must happen
    BEFORE deepspeed.zero.Init: zero.Init patches torch.Tensor construction, and importing under the patch fails
    ("Signature mismatch ... tensor_pynew")."""
    import torch._dynamo  # noqa: F401
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if type(hf_config) in MODEL_FOR_CAUSAL_LM_MAPPING:
        MODEL_FOR_CAUSAL_LM_MAPPING[type(hf_config)]


def decay_groups(module: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups: decay on matrices, none on norm weights and biases (1-D tensors)."""
    decay, no_decay = [], []
    for param in module.parameters():
        if param.requires_grad:
            (decay if param.dim() >= 2 else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_model(
    cfg: TrainConfig, ds_config: dict, *, dtype: torch.dtype, device: torch.device, rank: int, tokenizer
) -> DraftingModel:
    """The frozen target and the drafter (from `init_from`, else seeded) in one DraftingModel, on `device` in
    `dtype`; under ZeRO-3 built inside deepspeed.zero.Init, so every rank holds 1/world of both."""
    import deepspeed

    zero3 = cfg.deepspeed.zero_stage == 3
    hf_ds_config = None
    if zero3:
        from transformers.integrations import HfDeepSpeedConfig

        import_model_class(load_config(cfg.target.source(), trust_remote_code=cfg.target.trust_remote_code))

        # Makes transformers load the checkpoint shard by shard into ZeRO-3 partitions (never a full copy
        # per rank); must stay referenced until the model is built.
        hf_ds_config = HfDeepSpeedConfig(ds_config)
    # Under ZeRO-3 the WHOLE wrapper (frozen target included) is built inside zero.Init, so every rank holds
    # 1/world of the target and the parameter dtypes agree.
    init_ctx = deepspeed.zero.Init(config_dict_or_path=ds_config, dtype=dtype) if zero3 else nullcontext()
    with init_ctx:
        target = TargetModel.from_pretrained(
            cfg.target.path,
            gguf_file=cfg.target.gguf_file,
            dtype=dtype,
            device=None if zero3 else device,
            trust_remote_code=cfg.target.trust_remote_code,
        )
    if tokenizer is not None:
        target.check_tokenizer(tokenizer)
    if cfg.stage.position_ids == "anchor_offset":
        # Resolved here, where the target's context is first known: the trainer and the run's config.yaml see
        # the number.
        max_pos = getattr(target.config, "max_position_embeddings", None)
        given = cfg.stage.anchor_max_len
        cfg.stage.anchor_max_len = cfg.stage.resolve_anchor_max_len(max_pos)
        log.info(
            "anchor-offset positions below %d (%s; the target has %s positions)",
            cfg.stage.anchor_max_len,
            "stage.anchor_max_len" if given is not None else "derived",
            max_pos,
        )
    source = None
    if cfg.init_from is not None:
        # Validates the target fingerprint (shapes, rope, tokenizer) before anything is trained.
        # Its weights seed the drafter below; the draft head's rows are not copied (a ZeRO-3 head is a shard).
        source = Drafter.from_pretrained(cfg.init_from, target, tokenizer, draft_head=False)
        drafter_config = source.config
        assert drafter_config.window == cfg.drafter.window, (
            "TrainConfig resolves drafter.window from init_from"
        )
    else:
        drafter_config = DrafterConfig.from_target_config(
            target.config, window=cfg.drafter.window, tokenizer=tokenizer
        )
    vocab = choose_draft_vocab(cfg, target.config.vocab_size, tokenizer, source)
    with init_ctx:
        drafter = Drafter(drafter_config, target.embed_tokens, target.lm_head)
        drafter.use_draft_vocab(vocab, head=False)  # saved with its checkpoints; the loss reads the head rows
        model = DraftingModel(target, drafter, **loss_settings(cfg))
    del hf_ds_config
    init_drafter_weights(drafter, source, seed=cfg.seed, zero3=zero3, rank=rank)
    if not zero3:
        model.to(device)
        drafter.to(dtype)
    return model


def choose_draft_vocab(
    cfg: TrainConfig, vocab_size: int, tokenizer, source: Drafter | None
) -> DraftVocab | None:
    """The run's draft vocabulary: init_from's own (a different drafter.draft_vocab_size is an error), else the
    drafter.draft_vocab_size most frequent trained-on tokens of drafter.draft_vocab_data (default: data.path) plus
    every special and added token of the tokenizer; None (the whole vocabulary) when no size below V is asked."""
    size = cfg.drafter.draft_vocab_size
    if source is not None and source.draft_vocab is not None:
        check(
            size is None or size == source.draft_vocab.size,
            f"drafter.draft_vocab_size={size} but the init_from drafter drafts over {source.draft_vocab.size} ids: "
            "drop drafter.draft_vocab_size (a loaded drafter keeps its own)",
        )
        return source.draft_vocab
    check_draft_vocab_size(size, vocab_size, "drafter.draft_vocab_size")
    if source is not None:
        check(
            size is None or size == vocab_size,
            f"drafter.draft_vocab_size={size} but the init_from drafter scores the whole vocabulary: train a "
            "drafter over a draft vocabulary from scratch (stage 1)",
        )
    if size is None:
        return None
    if size == vocab_size:
        log.info(
            "draft vocabulary: drafter.draft_vocab_size=%d is the whole vocabulary; no id map is kept", size
        )
        return None
    datasets = cfg.drafter.draft_vocab_data or [cfg.data.path]
    counts = token_counts(datasets, vocab_size)
    vocab = DraftVocab.from_counts(counts, size, keep=special_token_ids(tokenizer) if tokenizer else ())
    log.info(
        "draft vocabulary: %d of %d ids, %.2f%% of the trained-on tokens of %s",
        size, vocab_size, 100 * vocab.coverage(counts), ", ".join(datasets),
    )  # fmt: skip
    return vocab


def loss_settings(cfg: TrainConfig) -> dict:
    """DraftingModel's loss keyword arguments, from the config's `loss` group."""
    return {
        "distill_weight": cfg.loss.distill_weight,
        "distill_temperature": cfg.loss.distill_temperature,
        "loss_backend": cfg.loss.backend,
        "chunk_size": cfg.loss.chunk_size,
    }


def init_drafter_weights(
    drafter: Drafter, source: Drafter | None, *, seed: int, zero3: bool, rank: int
) -> None:
    """Seeded init (or the init_from weights), identical on every rank. Under ZeRO-3 the shards are gathered,
    rank 0 writes, and DeepSpeed re-partitions its values on exit."""
    import deepspeed

    params = list(drafter.parameters())
    ctx = deepspeed.zero.GatheredParameters(params, modifier_rank=0) if zero3 else nullcontext()
    with ctx, torch.no_grad():
        if rank == 0 or not zero3:
            if source is not None:
                drafter.load_state_dict(source.state_dict())
            else:
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(seed)
                    drafter.reset_parameters()


def build_engine(model: DraftingModel, cfg: TrainConfig, ds_config: dict, total_steps: int):
    """The DeepSpeed engine over the drafter's parameters: AdamW groups, cosine LR with warmup over total_steps."""
    import deepspeed

    optim = cfg.optim
    schedule = cosine_with_warmup(total_steps, optim.warmup_ratio, optim.min_lr_ratio)
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=decay_groups(model.drafter, optim.weight_decay),
        config=ds_config,
        lr_scheduler=lambda optimizer: LambdaLR(optimizer, schedule),
    )
    return engine
