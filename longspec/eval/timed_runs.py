"""Each evaluated method's per-sample records, timed: `timed_runs` decodes a chunk of samples with every method,
in `timing_repeats` interleaved runs (the fastest kept per sample, every run's time beside it)."""

from __future__ import annotations

import math

from longspec.infer.baselines import run_method, run_method_batch
from longspec.infer.graphs import no_gc
from longspec.infer.methods import BATCH_RUNNERS, get_method

__all__ = ["timed_runs"]


def timed_runs(methods: list[str], samples: list, config, cfg, *, target, engine) -> dict[str, list[dict]]:
    """Each method's records for `samples`, from `cfg.timing_repeats` interleaved runs: repeat r runs the
    methods in an order rotated by r (no method is always the first after a new prompt), and every repeat
    after the first starts longspec's tree policy from the state the first started from (a repeat must not
    decode a text its policy has already learned). Per sample the fastest run's record is kept whole (its
    output, τ, trees and time belong together; at T=0 every run's output is the target's greedy one), with
    every run's time and τ under "timing_runs". The policies then continue from the first repeat's state,
    as after a single run."""
    repeats = cfg.timing_repeats
    start_state = engine.policy_state() if repeats > 1 else None
    after_first = None
    runs: dict[str, list[list[dict]]] = {method: [] for method in methods}
    for rep in range(repeats):
        shift = rep % len(methods)
        for method in methods[shift:] + methods[:shift]:
            if rep > 0 and get_method(method).needs_drafter:  # only longspec's rounds teach the policies
                engine.restore_policies(start_state)
            # every method's decode, the HF baselines' too: no garbage collection's stall inside a timing
            with no_gc():
                runs[method].append(
                    _generate(method, samples, config, cfg.batch_size, target=target, engine=engine)
                )
        if rep == 0 and repeats > 1:
            after_first = engine.policy_state()
    if repeats == 1:
        return {method: per_run[0] for method, per_run in runs.items()}
    engine.restore_policies(after_first)
    kept = {}
    for method, per_run in runs.items():
        kept[method] = []
        for index in range(len(samples)):
            candidates = [records[index] for records in per_run]
            best = dict(min(candidates, key=lambda record: record["decode_s"]))
            best["timing_runs"] = [
                {key: record[key] for key in ("decode_s", "tokens_per_s", "mean_accept_length")}
                for record in candidates
            ]
            kept[method].append(best)
    return kept


def _generate(method: str, samples: list, config, batch_size: int, *, target, engine) -> list[dict]:
    """One record per sample of `samples` for `method`: a method that decodes batches (the engine's, and the HF
    baselines vanilla_hf / vanilla_fa) decodes them together when batch_size > 1 (`run_method_batch`; each
    record then carries the batch's throughput), hf_compile one sample at a time (`run_method`)."""
    batched = batch_size > 1 and get_method(method).runner in BATCH_RUNNERS
    pad = batch_size - len(samples) if batched else 0
    if batched:
        # A dataset's last, smaller batch is padded with repeats of its last prompt (their outputs dropped,
        # their time counted): another batch size would reallocate the cache and, with cuda_graphs, capture
        # new graphs inside the timed decode, then again for the next dataset's full batches.
        prompts = [s.prompt_ids for s in samples] + [samples[-1].prompt_ids] * pad
        outputs = run_method_batch(method, prompts, config, target=target, engine=engine)[: len(samples)]
    else:
        outputs = [run_method(method, s.prompt_ids, config, target=target, engine=engine) for s in samples]
    records = [
        _record(sample, result.stats, result.tokens) for sample, result in zip(samples, outputs, strict=True)
    ]
    if batched:
        # Every row of a batch shares its decode wall time: the batch's throughput is all its tokens over it.
        tokens = sum(max(r["num_new_tokens"] - 1, 0) for r in records)
        decode_s = records[0]["decode_s"]
        for record in records:
            record["batch_size"] = len(samples)
            record["batch_padding"] = (
                pad  # rows decoded only to keep the batch shape: their tokens not counted
            )
            record["batch_tokens_per_s"] = tokens / decode_s if decode_s > 0 and tokens > 0 else math.nan
    return records


def _record(sample, stats, tokens: list[int]) -> dict:
    return {
        "id": sample.id,
        "prompt_len": sample.prompt_len,
        "output_ids": tokens,
        "num_new_tokens": stats.num_new_tokens,
        "rounds": stats.rounds,
        "accepted": stats.accepted,
        "mean_accept_length": stats.mean_accept_length,
        "tokens_per_s": stats.tokens_per_s,
        "prefill_s": stats.prefill_s,
        "decode_s": stats.decode_s,
        "draft_s": stats.draft_s,
        "verify_s": stats.verify_s,
        "overhead_s": stats.overhead_s,
        "trees": stats.trees,
        "depth_reached": stats.depth_reached,
        "depth_accepted": stats.depth_accepted,
        "policy": stats.policy,
        "round_trees": stats.round_trees,
        "round_ms": stats.round_ms,
    }
