"""The decoding methods, in one registry: each name and what runs it. The engine, the baselines' `run_method` and
the eval config's validation all read it, so a method is added (or its needs changed) here only.

- "longspec":   tree speculative decoding with the drafter (`longspec.infer.engine`)
- "vanilla_hf": plain HF decoding, eager attention, HF DynamicCache (the unoptimised reference)
- "vanilla_fa": plain HF decoding with FlashAttention (flash-attn when installed, else PyTorch SDPA): the paper's
                baseline, its speedups are reported against this one
- "hf_compile": HF's own fastest decoding: a StaticCache and the decode step under torch.compile
- "ar":         our own autoregressive decoding on the same engine (static cache, our attention backends)
- "pld":        prompt-lookup n-gram drafts verified on the same engine (lossless at any temperature)
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ALL_METHODS", "ENGINE_METHODS", "HF_METHODS", "METHODS", "DecodingMethod", "get_method"]


@dataclass(frozen=True, kw_only=True)
class DecodingMethod:
    name: str
    # What runs it: "engine" = SpeculativeEngine (our static cache and attention); "hf" = the HF model's own
    # forward on a DynamicCache (`baselines.hf_generate`); "hf_compile" = HF's StaticCache + torch.compile.
    runner: str
    # What proposes tokens on the engine: "drafter" (the LongSpec tree) or "ngram" (prompt lookup); None: nothing.
    drafts: str | None = None
    hf_attention: str | None = None  # runner "hf": "eager", or "flash" (flash-attn when it fits, else SDPA)

    @property
    def needs_drafter(self) -> bool:
        return self.drafts == "drafter"


METHODS: dict[str, DecodingMethod] = {
    m.name: m
    for m in (
        DecodingMethod(name="longspec", runner="engine", drafts="drafter"),
        DecodingMethod(name="vanilla_hf", runner="hf", hf_attention="eager"),
        DecodingMethod(name="vanilla_fa", runner="hf", hf_attention="flash"),
        DecodingMethod(name="hf_compile", runner="hf_compile"),
        DecodingMethod(name="ar", runner="engine"),
        DecodingMethod(name="pld", runner="engine", drafts="ngram"),
    )
}
ALL_METHODS = tuple(METHODS)
# Runners that decode several prompts together (batch_size > 1); hf_compile's StaticCache graph is batch 1.
BATCH_RUNNERS = ("engine", "hf")
BATCH_METHODS = tuple(name for name, m in METHODS.items() if m.runner in BATCH_RUNNERS)
ENGINE_METHODS = tuple(name for name, m in METHODS.items() if m.runner == "engine")
HF_METHODS = tuple(name for name, m in METHODS.items() if m.runner == "hf")


def get_method(name: str, *, runner: str | None = None) -> DecodingMethod:
    """The registered method `name` (of `runner` when given), else a ValueError listing the choices."""
    choices = ALL_METHODS if runner is None else tuple(n for n, m in METHODS.items() if m.runner == runner)
    if name not in choices:
        what = "method" if runner is None else f"{runner} method"
        raise ValueError(f"unknown {what} {name!r}; choose one of {', '.join(choices)}")
    return METHODS[name]
