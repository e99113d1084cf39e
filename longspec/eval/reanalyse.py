"""The lossless check's divergence analysis run again over a recorded evaluation (`python -m longspec.eval.report
RESULTS --reanalyse TARGET`): every T = 0 output that differs from the run's greedy reference gets its
`divergence` entry again from the current analysis (longspec.eval.divergence), with the target loaded in the
dtype asked for. What a recorded run's verdicts are under a newer rule, or in float32 (which measures the gap of
a bf16 flip without bf16 rounding; near-ties are still judged in the run's own dtype), without decoding anything
again: the outputs are the recorded ones, only the target's forward on each common prefix is run."""

from __future__ import annotations

from longspec.eval.datasets import prompt_context_len, recorded_prompts
from longspec.eval.divergence import analyse_divergence
from longspec.eval.summary import greedy_reference, recorded_generation
from longspec.target_source import resolve_dtype

__all__ = ["reanalyse"]


def reanalyse(results: dict, model, tokenizer, *, data_dir: str | None = None) -> int:
    """Rewrite the `divergence` entry of every recorded output that differs from its greedy reference (in place)
    -> how many were analysed. `model`: the target (an HF causal LM), `tokenizer`: its tokenizer, which must
    tokenize the evaluation's prompts as the evaluation did (checked by each prompt's length)."""
    config = results["config"]
    if recorded_generation(config).get("temperature", 0) != 0:
        raise ValueError("only a greedy (temperature 0) evaluation has divergences to analyse")
    methods = results["methods"]
    reference = greedy_reference(methods)
    if reference is None:
        raise ValueError("the evaluation ran no target-only method to check the others against")
    # the context the prompts were fitted to: recorded since it was (`context_len`), else the target's default
    context_len = results.get("context_len") or prompt_context_len(None, model.config)
    prompts = recorded_prompts(config["data"], tokenizer, data_dir, context_len=context_len)
    # near-ties in the dtype the outputs were computed in, whatever the analysis runs in
    run_dtype = resolve_dtype(results["dtype"]) if results.get("dtype") else None
    analysed = 0
    for method, per_dataset in methods.items():
        if method == reference:
            continue
        for dataset, records in per_dataset.items():
            expected = {str(r["id"]): r["output_ids"] for r in methods[reference].get(dataset, [])}
            for record in records:
                ref_tokens = expected.get(str(record["id"]))
                if ref_tokens is None or record["output_ids"] == ref_tokens:
                    continue
                prompt = prompts.get((dataset, str(record["id"])))
                if prompt is None or len(prompt) != record["prompt_len"]:
                    raise ValueError(
                        f"{dataset} / {record['id']}: the prompt is not the evaluation's ({record['prompt_len']} "
                        f"tokens there, {None if prompt is None else len(prompt)} here): another tokenizer or "
                        "data file"
                    )
                record["divergence"] = analyse_divergence(
                    model, prompt, record["output_ids"], ref_tokens, tie_dtype=run_dtype
                ).to_dict()
                analysed += 1
    return analysed
