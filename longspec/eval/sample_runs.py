"""One chunk of samples through every method of an evaluation (`timed_runs`): the interleaved timed runs, one
record per sample, and at temperature 0 the check of each output against the reference method's (`check_against_
reference`). `longspec.eval.harness.run_eval` calls them for each chunk of each data source."""

from __future__ import annotations

import logging
import math

from longspec.eval.divergence import TIE_ULPS, analyse_divergence
from longspec.infer.baselines import run_method, run_method_batch
from longspec.infer.graphs import no_gc
from longspec.infer.methods import BATCH_RUNNERS, get_method

__all__ = ["check_against_reference", "generate", "timed_runs"]

logger = logging.getLogger("longspec.eval")


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
                    generate(method, samples, config, cfg.batch_size, target=target, engine=engine)
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


def generate(method: str, samples: list, config, batch_size: int, *, target, engine) -> list[dict]:
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


def check_against_reference(methods: dict, dataset: str, reference: str, sample, target, index: int) -> None:
    """T = 0: each method's output for the sample at `index` of `dataset` vs the reference method's; a
    difference gets a `divergence` entry (first position, the two tokens, the target's logit gap there,
    near-tie or not)."""
    ref_tokens = methods[reference][dataset][index]["output_ids"]
    for method, per_dataset in methods.items():
        record = per_dataset[dataset][index]
        if method == reference:
            continue
        divergence = analyse_divergence(target.model, sample.prompt_ids, record["output_ids"], ref_tokens)
        if divergence is None:
            continue
        record["divergence"] = divergence.to_dict()
        if divergence.near_tie:
            verdict = f"a near-tie (|gap| <= {divergence.tolerance:.3g}, {TIE_ULPS:g} ulp)"
        elif divergence.reference_off:
            verdict = f"NOT a near-tie, but this output's token is the target's argmax: {reference} left it"
        else:
            verdict = "NOT a near-tie"
        log = logger.warning if divergence.explained else logger.error
        log(
            "%s %s sample %s differs from %s at token %d (%s vs %s): target logit gap %s, %s",
            dataset,
            method,
            sample.id,
            reference,
            divergence.index,
            divergence.token,
            divergence.reference_token,
            "n/a" if divergence.gap is None else f"{divergence.gap:.4g}",
            verdict,
        )
