"""One evaluation run (`run_eval`): every method on every sample, then results.json, report.md and plots. The CLIs
are `python -m longspec.eval` (one run) and `python -m longspec.eval.runs` (several in one process).

Speedups are ratios of decode throughput measured in this same run (docs/ALGORITHM.md §5). At temperature 0 every
method's output is compared with the target's greedy output (a target-only method of the run: ar, vanilla_fa or
vanilla_hf), which is the lossless check at evaluation scale.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time

import torch

from longspec.atomic import write_text_atomic
from longspec.cli import UserError
from longspec.eval import sample_runs
from longspec.eval.config import EvalConfig
from longspec.eval.datasets import load_samples, prompt_context_len
from longspec.eval.progress import EvalProgress, run_key
from longspec.eval.report import write_report
from longspec.eval.session import EvalSession
from longspec.eval.summary import greedy_reference, summarise
from longspec.fingerprint import target_fingerprint
from longspec.infer.baselines import reserve_hf_compiled, run_method, run_method_batch
from longspec.infer.methods import get_method
from longspec.modules.rope import exact_positions, longrope_long, longrope_original
from longspec.ownership import check_output_dir, claim_output_dir
from longspec.provenance import git_commit
from longspec.target import _check_model_type

__all__ = ["log_summary", "run_eval"]

logger = logging.getLogger("longspec.eval")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


EVAL_KIND = "evaluation"  # the ownership marker's kind of an output_dir (longspec.ownership)


def _device_and_dtype(cfg: EvalConfig) -> tuple[torch.device, torch.dtype]:
    device = torch.device(
        ("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device
    )
    if cfg.dtype != "auto":
        return device, _DTYPES[cfg.dtype]
    return device, torch.bfloat16 if device.type == "cuda" else torch.float32


def _eos_ids(tokenizer, hf_config) -> tuple[int, ...]:
    ids = set()
    for value in (getattr(hf_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return tuple(sorted(ids))


def _check_positions(cfg: EvalConfig, hf_config, datasets: list[tuple[str, list]]) -> None:
    """Refuse, before any generation, a run whose output would pass the target's max_position_embeddings: past
    it the target extrapolates silently, and every τ and speedup of the run would mean something else. (Draft
    tokens a round proposes beyond max_new_tokens are discarded, so they do not count.) A dynamic-NTK rope bounds
    the run where its frequencies start changing (`rope.exact_positions`); a longrope one needs each call on one
    side of its original context (`SpeculativeEngine._fix_longrope`)."""
    longest_prompt = max(s.prompt_len for _, samples in datasets for s in samples)
    max_new_tokens = cfg.generation.max_new_tokens
    max_positions = getattr(hf_config, "max_position_embeddings", None)
    exact = exact_positions(hf_config)
    if exact is not None and (max_positions is None or exact < max_positions):
        reach = longest_prompt + max_new_tokens
        if reach > exact:
            raise UserError(
                f"the longest prompt ({longest_prompt} tokens) + max_new_tokens={max_new_tokens} = {reach} "
                f"tokens, past the {exact} positions within which this target's "
                f"{hf_config.rope_parameters['rope_type']} rope keeps fixed frequencies (past them HF changes them "
                f"with the length, which the engine does not follow): set data.context_len <= {exact}"
            )
    original = longrope_original(hf_config)
    if original is not None:
        for name, samples in datasets:
            for start in range(0, len(samples), cfg.batch_size):
                lengths = [s.prompt_len for s in samples[start : start + cfg.batch_size]]
                if longrope_long(lengths, max_new_tokens, original) is None:
                    raise UserError(
                        f"{name}: prompts of {min(lengths)}-{max(lengths)} tokens (+ max_new_tokens="
                        f"{max_new_tokens}) cross this target's original context ({original} tokens), where "
                        "its longrope rope switches factors mid-sequence: keep every prompt above it (e.g. "
                        f"data.min_prompt_tokens={original + 1}) or every prompt + max_new_tokens within it"
                    )
    if max_positions is None:
        return
    if cfg.data.context_len is not None and cfg.data.context_len > max_positions:
        raise UserError(
            f"data.context_len={cfg.data.context_len} exceeds the target's max_position_embeddings={max_positions}"
        )
    reach = longest_prompt + max_new_tokens
    if reach > max_positions:
        raise UserError(
            f"the longest prompt ({longest_prompt} tokens) + max_new_tokens={max_new_tokens} = {reach} tokens, "
            f"past the target's max_position_embeddings={max_positions}: lower max_new_tokens, or set "
            f"data.context_margin >= max_new_tokens so that prompts leave room for the output"
        )


def run_eval(cfg: EvalConfig, session: EvalSession | None = None) -> dict:
    """Run the evaluation described by `cfg`; returns the results dict also written to results.json.

    Everything that can be checked without the model's weights is checked first: the tokenizer and config, every
    data source (a source with no usable sample is an error), and the positions the generation will reach.
    `session`: the models of an earlier run in this process, reused when this run asks for the same target
    (`longspec.eval.runs`); by default the run loads its own."""
    from tqdm.auto import tqdm

    from longspec.target_source import check_tokenizer_fits, load_config, load_tokenizer

    # Where an evaluation's time goes besides decoding (logged, and kept in results.json as phases_s).
    clock = _Phases()
    check_output_dir(cfg.output_dir, EVAL_KIND, what="output_dir")  # a user's folder: refused before any load
    device, dtype = _device_and_dtype(cfg)
    methods = cfg.methods
    trust = cfg.target.trust_remote_code
    model_source = cfg.target.source()  # an HF directory / hub id, or a GGUF file
    tokenizer = load_tokenizer(model_source, trust_remote_code=trust)
    hf_config = load_config(model_source, trust_remote_code=trust)
    # A family the adapter does not run is refused now, before anything else about the run: a data check's
    # advice (another data.context_margin) would be useless for it.
    _check_model_type(hf_config)
    check_tokenizer_fits(tokenizer, hf_config.vocab_size)  # the embedding's rows
    # by default prompts fit the target's context, or the range its rope rotates exactly (`_check_positions`)
    context_len = prompt_context_len(cfg.data.context_len, hf_config)
    if context_len is None:
        raise UserError("the target's config has no max_position_embeddings: set data.context_len")
    gen_config = cfg.generation_config(eos_token_ids=_eos_ids(tokenizer, hf_config))

    datasets: list[tuple[str, list]] = []
    data_reports = []
    for source in cfg.data.sources:
        samples, report = load_samples(
            source,
            tokenizer,
            context_len=context_len,
            min_prompt_tokens=cfg.data.min_prompt_tokens,
            context_margin=cfg.data.context_margin,
            template=cfg.data.template,
        )
        samples = samples[: cfg.max_samples] if cfg.max_samples else samples
        data_reports.append(report.to_dict())
        # Results, the lossless check and a stopped run's chunks are keyed by dataset name, which for a file is
        # its base name: two sources of one name (a/rows.jsonl, b/rows.jsonl) get distinct names, or they would
        # merge as one dataset, be checked against the wrong reference records and be read back in each other's
        # place on a rerun.
        name, k = samples[0].dataset, 1
        while any(name == other for other, _ in datasets):
            k += 1
            name = f"{samples[0].dataset}_{k}"
        for sample in samples:
            sample.dataset = name
        data_reports[-1]["dataset"] = name
        datasets.append((name, samples))
    longest = max(s.prompt_len for _, samples in datasets for s in samples)
    _check_positions(cfg, hf_config, datasets)
    clock.mark("data")

    session = EvalSession() if session is None else session
    engine = session.engine_for(
        cfg, model_source=model_source, tokenizer=tokenizer, device=device, dtype=dtype
    )
    target = engine.target
    clock.mark("load")

    results: dict = {
        "config": _config_dict(cfg),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "commit": git_commit(),
        "data": data_reports,
        "context_len": context_len,  # what the prompts were fitted to (data.context_len, or the target's)
        "methods": {m: {} for m in methods},
    }
    if (
        engine.drafter is not None
    ):  # the drafter's head: how many ids it drafts over (a draft vocabulary) of the target's
        results["draft_vocab"] = {"size": engine.drafter.draft_vocab_size, "target_vocab": target.vocab_size}

    # Size the static cache once for the longest prompt, so no sample pays for a reallocation (or, with
    # cuda_graphs, a re-capture) inside its timed decode; then warm every method up untimed.
    engine.reserve_for([longest], gen_config)
    if "hf_compile" in methods:  # the same for HF's static cache: one compilation, in the warm-up
        reserve_hf_compiled(target.model, longest + cfg.generation.max_new_tokens)
    if cfg.warmup:
        warm = dataclasses.replace(gen_config, max_new_tokens=min(8, cfg.generation.max_new_tokens))
        # On a GPU, kernel selection is per shape (cuDNN attention plans, Triton autotuning by context length):
        # the first tokens at a new context length run far slower (benchmarks/decode_methods.py shows it). Warm
        # up at each data source's first prompt, not at a toy length.
        # (A CPU has no per-shape kernels: a short prompt initialises everything there.)
        warm_prompts = [samples[0].prompt_ids for _, samples in datasets]
        if device.type != "cuda":
            warm_prompts = [list(range(16))]
        for prompt in warm_prompts:
            for method in methods:
                run_method(method, prompt, warm, target=target, engine=engine)
        if "longspec" in methods and gen_config.fixed_tree is None:
            # tree=auto: every candidate's round cost on this device, per context bucket of the run.
            shortest = min((s.prompt_len for _, samples in datasets for s in samples), default=16)
            costs = engine.measure_round_costs(
                gen_config, [shortest, longest + cfg.generation.max_new_tokens]
            )
            results["round_costs_s"] = costs.to_dict()
        batched = [m for m in methods if get_method(m).runner == "engine"] if cfg.batch_size > 1 else []
        if batched:  # the batch's cache, and its static steps / graphs (keyed by batch size), set up untimed
            # (after the batch-1 work above, which reallocates the cache for one row), for the batch's bucket
            # and the smaller ones it shrinks into as its rows finish (`SpeculativeEngine.warm_up`)
            engine.reserve_for([longest] * cfg.batch_size, gen_config)
            for method in batched:
                # every bucket once (its steps do not depend on the prompt), then each source's shape at the
                # batch's size (kernel selection)
                widest = max(warm_prompts, key=len)
                engine.warm_up(widest, warm, batch_size=cfg.batch_size, method=method)
                for prompt in warm_prompts:
                    if prompt is not widest:
                        engine.generate_batch([prompt] * cfg.batch_size, warm, method=method)
        if cfg.batch_size > 1:  # the batched HF baselines' kernels at the batch's shapes
            for method in [m for m in methods if get_method(m).runner == "hf"]:
                for prompt in warm_prompts:
                    run_method_batch(method, [prompt] * cfg.batch_size, warm, target=target)
    clock.mark("warm_up")

    reference = greedy_reference(methods) if cfg.generation.temperature == 0 else None
    # Each finished chunk goes to disk as it completes; a rerun of a stopped run reads them back (progress.py).
    claim_output_dir(cfg.output_dir, EVAL_KIND, what="output_dir")
    key = run_key(
        results["config"],
        datasets,
        target=target_fingerprint(hf_config),
        target_path=model_source.gguf_path or model_source.repo,
        drafter_dir=_drafter_dir(cfg),
    )
    progress = EvalProgress(cfg.output_dir, key)
    resumed = {}
    for dataset, samples in datasets:
        bar = tqdm(total=len(samples), desc=dataset, unit="sample", dynamic_ncols=True)
        for start in range(0, len(samples), cfg.batch_size):
            chunk = samples[start : start + cfg.batch_size]
            done = progress.get(dataset, start)
            kept = done or sample_runs.timed_runs(
                methods, chunk, gen_config, cfg, target=target, engine=engine
            )
            for method in methods:
                records = kept[method]
                results["methods"][method].setdefault(dataset, []).extend(records)
                last = records[-1]
                bar.set_postfix_str(
                    f"{method}: τ {last['mean_accept_length']:.2f}, {last['tokens_per_s']:.1f} tok/s"
                )
            if done is not None:
                resumed[dataset] = resumed.get(dataset, 0) + len(chunk)
            else:
                if reference is not None:
                    for index, sample in enumerate(chunk, start=start):
                        sample_runs.check_against_reference(
                            results["methods"], dataset, reference, sample, target, index
                        )
                progress.add(dataset, start, kept)
            bar.update(len(chunk))
        bar.close()
    if resumed:  # their times come from the stopped process (its policy state, its machine load)
        results["resumed"] = resumed

    clock.mark("samples")
    results["phases_s"] = clock.seconds
    logger.info("phases: %s", ", ".join(f"{name} {sec:.1f} s" for name, sec in clock.seconds.items()))
    results["summary"] = summarise(
        results["methods"], greedy=cfg.generation.temperature == 0, max_spread=cfg.max_timing_spread
    )
    os.makedirs(cfg.output_dir, exist_ok=True)
    write_text_atomic(
        os.path.join(cfg.output_dir, "results.json"),
        json.dumps(_json_safe(results), indent=1, allow_nan=False),
    )
    write_report(results, cfg.output_dir)
    progress.finish()
    return results


def _drafter_dir(cfg: EvalConfig) -> str | None:
    uses_drafter = any(get_method(m).needs_drafter for m in cfg.methods)
    return cfg.drafter.path if uses_drafter and cfg.drafter.init == "pretrained" else None


def _json_safe(obj):
    """NaN / inf (e.g. τ of a run with no rounds) -> null: results.json stays strict JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


class _Phases:
    """Wall seconds between marks: {phase name: seconds since the previous mark (or construction)}."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = round(now - self._last, 3)
        self._last = now


def _config_dict(cfg: EvalConfig) -> dict:
    return dataclasses.asdict(cfg)


def log_summary(results: dict, output_dir: str) -> None:
    """One log line per (dataset, method): τ and tokens/s, after where results.json went."""
    logger.info("wrote %s", os.path.join(output_dir, "results.json"))
    for dataset, per_method in results["summary"].items():
        for method, summary in per_method.items():
            logger.info(
                "%s %s: τ %.2f, %.1f tok/s",
                dataset,
                method,
                summary["mean_accept_length"],
                summary["tokens_per_s"],
            )
