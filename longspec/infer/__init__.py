"""Lossless speculative decoding (docs/ALGORITHM.md §4): dynamic-beam tree drafting, hybrid verification on a static KV
cache, greedy / lossless-sampling acceptance, and the baselines measured beside it.

    from longspec.infer import GenerationConfig, SpeculativeEngine
    result = SpeculativeEngine(target, drafter).generate(prompt_ids, GenerationConfig(max_new_tokens=256))
    result.tokens, result.stats.mean_accept_length, result.stats.accept_histogram
"""

from longspec.infer.engine import GenerationConfig, GenerationResult, SpeculativeEngine
from longspec.infer.stats import GenerationStats

__all__ = ["GenerationConfig", "GenerationResult", "GenerationStats", "SpeculativeEngine"]
