"""Every decoding method behind one call (`run_method`), so the harness measures them side by side in the same
run; the methods themselves are listed in `longspec.infer.methods`. The HF baselines live here:

- `hf_generate` / `hf_generate_batch` ("vanilla_hf", "vanilla_fa"): plain HF decoding on a DynamicCache, eager or
  flash attention, one prompt or a left-padded batch.
- `hf_compiled_generate` ("hf_compile"): HF's own fastest decoding, what a user who knows transformers would
  pick: a StaticCache and the decode step under torch.compile(mode="reduce-overhead") (CUDA graphs on GPU), SDPA.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import time
import weakref

import torch

from longspec.infer.accept import sample_token, target_distribution
from longspec.infer.engine import GenerationConfig, GenerationResult, SpeculativeEngine
from longspec.infer.methods import ALL_METHODS, BATCH_METHODS, BATCH_RUNNERS, HF_METHODS, get_method
from longspec.infer.stats import GenerationStats
from longspec.kernels.row_argmax import row_argmax
from longspec.modules.attention import HAS_FLASH_ATTN

__all__ = [
    "ALL_METHODS",
    "BATCH_METHODS",
    "HF_METHODS",
    "hf_attn_implementation",
    "hf_generate",
    "hf_generate_batch",
    "hf_compiled_generate",
    "reserve_hf_compiled",
    "run_method",
    "run_method_batch",
    "using_attn_implementation",
]

logger = logging.getLogger(__name__)

# A StaticCache's length is part of the compiled step's shapes: round it up so prompts of similar length share one
# compilation (HF's static-cache attention reads all max_cache_len slots, so the bucket stays fine-grained).
STATIC_CACHE_BUCKET = 1024


def hf_attn_implementation(method: str, model) -> str:
    """The HF attn_implementation a vanilla method (runner "hf") runs with on this model."""
    if get_method(method, runner="hf").hf_attention == "eager":
        return "eager"
    param = next(model.parameters())
    if HAS_FLASH_ATTN and param.is_cuda and param.dtype in (torch.float16, torch.bfloat16):
        return "flash_attention_2"
    return "sdpa"  # PyTorch's flash / memory-efficient kernels on GPU, its math path on CPU


def _cache_kwarg(model) -> str:
    """transformers >= 5.2x names the forward's cache argument `cache`; older 5.x call it `past_key_values`."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def hf_generate(
    hf_model, prompt_ids, config: GenerationConfig, *, attn_implementation: str
) -> GenerationResult:
    """Vanilla HF decoding of one prompt (`hf_generate_batch` of one)."""
    return hf_generate_batch(hf_model, [prompt_ids], config, attn_implementation=attn_implementation)[0]


@torch.no_grad()
def hf_generate_batch(
    hf_model, prompts, config: GenerationConfig, *, attn_implementation: str
) -> list[GenerationResult]:
    """Vanilla HF decoding of prompts of any lengths together, as HF's own batched generation does: left-padded
    into one prefill forward (SDPA or flash-attn whatever the method), then one forward of every row per token
    on a DynamicCache with `attn_implementation`, until every row has finished (a finished row is still fed, its
    tokens dropped). Each row's positions count from its own first token and the attention mask hides the
    padding, so a row's output is its batch-1 output (up to the rounding a padded attention may change). One
    prompt runs unmasked (no padding: the attention's causal fast path). The sampling rule is the engine's
    (same target_distribution and sampler), so outputs are comparable; every row shares the decode's time."""
    from transformers import DynamicCache

    device = next(hf_model.parameters()).device
    prompts = [torch.as_tensor(p, dtype=torch.long, device=device).flatten() for p in prompts]
    if not prompts or any(p.numel() == 0 for p in prompts):
        raise ValueError("hf_generate_batch needs non-empty prompts")
    batch, width = len(prompts), max(p.numel() for p in prompts)
    ids = torch.zeros(batch, width, dtype=torch.long, device=device)
    # The attention mask for the whole call, allocated once: each step passes a longer view of it.
    full_mask = torch.ones(batch, width + config.max_new_tokens, dtype=torch.long, device=device)
    for row, prompt in enumerate(prompts):
        ids[row, width - prompt.numel() :] = prompt
        full_mask[row, : width - prompt.numel()] = 0
    mask = full_mask[:, :width]
    positions = (mask.cumsum(1) - 1).clamp(min=0)  # each row from 0 at its first real token
    padded = any(p.numel() < width for p in prompts)
    # Prefill is not what is compared (tokens/s exclude it) and eager attention over a 32K prompt would
    # materialise H x 32K x 32K scores: prefill with SDPA / flash, decode with the method's implementation.
    # The K/V written to the cache do not depend on the attention implementation.
    prefill_implementation = "flash_attention_2" if attn_implementation == "flash_attention_2" else "sdpa"
    stats = [GenerationStats(method=f"hf[{attn_implementation}]", prompt_len=p.numel()) for p in prompts]
    generator = torch.Generator().manual_seed(config.seed)
    cache_arg = _cache_kwarg(hf_model)

    def forward(tokens, step_positions):
        extra = {"attention_mask": mask} if padded else {}
        out = hf_model(tokens, position_ids=step_positions, use_cache=True, logits_to_keep=1,
                       **extra, **{cache_arg: cache})  # fmt: skip
        return out.logits[:, -1]  # [B, V]

    cache = DynamicCache(config=hf_model.config)
    with using_attn_implementation(hf_model, prefill_implementation):
        start = _now(device)
        token = _pick(forward(ids, positions), config, generator)  # [B]
        emitted = [[t] for t in token.tolist()]  # host sync
        prefill_s = _now(device) - start
    done = [_row_done(row, config) for row in emitted]
    last = positions[:, -1]
    with using_attn_implementation(hf_model, attn_implementation):
        start = _now(device)
        while not all(done):
            last = last + 1
            mask = full_mask[:, : mask.shape[1] + 1]
            token = _pick(forward(token[:, None], last[:, None]), config, generator)
            for row, value in enumerate(token.tolist()):  # host sync: the stopping test needs the tokens
                if not done[row]:
                    emitted[row].append(value)
                    stats[row].record_round(0)
                    done[row] = _row_done(emitted[row], config)
        decode_s = _now(device) - start
    results = []
    for row_stats, tokens in zip(stats, emitted, strict=True):
        row_stats.prefill_s, row_stats.decode_s = prefill_s, decode_s
        row_stats.verify_s = decode_s
        row_stats.num_new_tokens = len(tokens)
        results.append(GenerationResult(tokens=tokens, stats=row_stats))
    return results


def _row_done(tokens: list[int], config: GenerationConfig) -> bool:
    return len(tokens) >= config.max_new_tokens or tokens[-1] in config.eos_token_ids


class _CompiledDecoder:
    """One model's compiled decode step and its StaticCache, reused across calls (a new cache object or length
    would mean new guards, i.e. a recompilation: tens of seconds)."""

    def __init__(self, hf_model):
        self.step = torch.compile(hf_model.forward, mode="reduce-overhead", fullgraph=True)
        self.cache = None
        self.max_len = 0

    def cache_for(self, hf_model, needed: int):
        from transformers import StaticCache

        max_len = -(-needed // STATIC_CACHE_BUCKET) * STATIC_CACHE_BUCKET
        if self.cache is None or self.max_len < needed:  # grow only: a new length is a new compilation
            self.cache = None  # free the old one first
            # Allocated lazily by the (uncompiled) prefill, on the model's device and dtype.
            self.cache = StaticCache(config=hf_model.config, max_cache_len=max_len)
            self.max_len = max_len
        else:
            self.cache.reset()
        return self.cache


_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def reserve_hf_compiled(hf_model, max_len: int) -> None:
    """Size hf_compile's StaticCache for `max_len` tokens up front (as SpeculativeEngine.reserve does for ours),
    so every later call fits it and none recompiles inside a timed decode."""
    if hf_model not in _COMPILED:
        _COMPILED[hf_model] = _CompiledDecoder(hf_model)
    _COMPILED[hf_model].cache_for(hf_model, max_len)


@torch.no_grad()
def hf_compiled_generate(hf_model, prompt_ids, config: GenerationConfig) -> GenerationResult:
    """HF transformers' fastest batch-1 decoding: a StaticCache (fixed shapes) and the decode step compiled with
    torch.compile(mode="reduce-overhead", fullgraph=True), i.e. replayed as a CUDA graph on GPU. The prefill runs
    the uncompiled forward (its length varies). The first call per model / cache bucket compiles: the eval's
    warm-up pays for it, not the measurement. Sampling rule as in hf_generate."""
    device = next(hf_model.parameters()).device
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long, device=device).flatten()
    stats = GenerationStats(method="hf[static+compile]", prompt_len=prompt.numel())
    generator = torch.Generator().manual_seed(config.seed)
    cache_arg = _cache_kwarg(hf_model)
    with using_attn_implementation(hf_model, "sdpa"):
        if hf_model not in _COMPILED:
            _COMPILED[hf_model] = _CompiledDecoder(hf_model)
        decoder = _COMPILED[hf_model]
        cache = decoder.cache_for(hf_model, prompt.numel() + config.max_new_tokens)
        start = _now(device)
        logits = hf_model(prompt[None], use_cache=True, logits_to_keep=1, **{cache_arg: cache}).logits[0, -1]
        token = _pick(logits, config, generator)
        emitted = [int(token)]  # host sync
        stats.prefill_s = _now(device) - start
        position = torch.full((1, 1), prompt.numel(), dtype=torch.long, device=device)
        start = _now(device)
        while len(emitted) < config.max_new_tokens and emitted[-1] not in config.eos_token_ids:
            out = decoder.step(
                token.reshape(1, 1), position_ids=position, use_cache=True, **{cache_arg: cache}
            )
            token = _pick(out.logits[0, -1], config, generator)
            emitted.append(int(token))  # host sync: the stopping test needs the token
            position = position + 1
            stats.record_round(0)
        stats.decode_s = _now(device) - start
    stats.verify_s = stats.decode_s
    stats.num_new_tokens = len(emitted)
    return GenerationResult(tokens=emitted, stats=stats)


def _pick(logits: torch.Tensor, config: GenerationConfig, generator) -> torch.Tensor:
    """The engine's sampling rule (same target_distribution and sampler), so outputs are comparable."""
    if config.temperature == 0:
        return row_argmax(logits)
    probs = target_distribution(
        logits, temperature=config.temperature, top_k=config.top_k, top_p=config.top_p
    )
    return sample_token(probs, generator)


@contextlib.contextmanager
def using_attn_implementation(hf_model, implementation: str):
    """HF forwards inside run with `implementation`; the model's own is restored on exit.

    SDPA (standing in for flash-attn) on a GPU runs with the flash / memory-efficient kernels only. PyTorch may
    otherwise pick cuDNN attention, which builds a plan per key length: every decode step is a new length, so its
    first tokens at a context are set-up, not attention: a baseline slowed by that would be unfairly slow."""
    previous = hf_model.config._attn_implementation
    hf_model.set_attn_implementation(implementation)
    try:
        if implementation == "sdpa" and next(hf_model.parameters()).is_cuda:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
                yield
        else:
            yield
    finally:
        hf_model.set_attn_implementation(previous)


def run_method(
    method: str, prompt_ids, config: GenerationConfig, *, target, engine: SpeculativeEngine | None = None
):
    """Generate with any method in ALL_METHODS, by its registered runner."""
    runner = get_method(method).runner
    if runner == "hf_compile":
        return hf_compiled_generate(target.model, prompt_ids, config)
    if runner == "hf":
        return hf_generate(
            target.model, prompt_ids, config, attn_implementation=hf_attn_implementation(method, target.model)
        )
    if engine is None:
        engine = SpeculativeEngine(target)
    return engine.generate(prompt_ids, config, method=method)


def run_method_batch(
    method: str, prompts, config: GenerationConfig, *, target, engine: SpeculativeEngine | None = None
) -> list[GenerationResult]:
    """Generate for several prompts together with a method that decodes batches (`BATCH_RUNNERS`): the engine's
    (`SpeculativeEngine.generate_batch`) or HF's (`hf_generate_batch`)."""
    runner = get_method(method).runner
    if runner not in BATCH_RUNNERS:
        raise ValueError(
            f"method {method!r} decodes one prompt at a time (batched: {', '.join(BATCH_METHODS)})"
        )
    if runner == "hf":
        attn = hf_attn_implementation(method, target.model)
        return hf_generate_batch(target.model, prompts, config, attn_implementation=attn)
    if engine is None:
        engine = SpeculativeEngine(target)
    return engine.generate_batch(prompts, config, method=method)


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # host sync: timing needs the GPU to have finished
    return time.perf_counter()
