"""`python -m longspec.eval.report RESULTS --reanalyse TARGET`: a recorded run's divergences analysed again."""

from __future__ import annotations

import json

import pytest
import torch

from longspec.eval.__main__ import main as eval_main
from longspec.eval.datasets import recorded_prompts
from longspec.eval.report import main as report_main
from longspec.target_source import load_causal_lm, load_tokenizer, resolve_source


def _recorded_run(eval_overrides, tmp_path) -> tuple[dict, str]:
    out = tmp_path / "run"
    assert eval_main(eval_overrides(str(out), "method=[longspec,ar]")) == 0
    path = out / "results.json"
    return json.loads(path.read_text()), str(path)


def test_a_reference_that_left_the_targets_argmax_is_found_again(eval_overrides, tiny_target_dir, tmp_path):
    """The recorded reference (ar) is given a runner-up token at position 2 of one sample, as a batched bf16
    reference can write; re-analysed, the difference is the reference's and the summary counts no failure."""
    results, path = _recorded_run(eval_overrides, tmp_path)
    dataset, records = next(iter(results["methods"]["ar"].items()))
    record = records[0]
    greedy = record["output_ids"]
    assert results["methods"]["longspec"][dataset][0]["output_ids"] == greedy  # fp32: lossless as recorded
    source = resolve_source(tiny_target_dir)
    model = load_causal_lm(source, dtype=torch.float32).eval()
    data, tokenizer = results["config"]["data"], load_tokenizer(source)
    prompts = recorded_prompts(data, tokenizer, context_len=results["context_len"])
    prompt = prompts[(dataset, str(record["id"]))]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + greedy[:2]])).logits[0, -1]
    record["output_ids"] = greedy[:2] + [int(logits.argsort(descending=True)[1])] + greedy[3:]
    with open(path, "w") as f:
        json.dump(results, f)

    assert report_main([path, "--reanalyse", tiny_target_dir, "--dtype", "float32"]) == 0
    redone = json.loads(open(path).read())
    divergence = redone["methods"]["longspec"][dataset][0]["divergence"]
    assert divergence["index"] == 2 and divergence["token"] == greedy[2] and divergence["gap"] < 0
    assert divergence["reference_off"] and not divergence["near_tie"]
    summary = redone["summary"][dataset]["longspec"]
    assert (summary["reference_divergences"], summary["unexplained_divergences"]) == (1, 0)
    assert "where the reference left the target's argmax" in open(tmp_path / "run" / "report.md").read()


def test_a_prompt_that_is_not_the_evaluations_is_one_error(eval_overrides, tiny_target_dir, tmp_path, capsys):
    results, path = _recorded_run(eval_overrides, tmp_path)
    dataset, records = next(iter(results["methods"]["ar"].items()))
    records[0]["output_ids"] = records[0]["output_ids"][:-1] + [(records[0]["output_ids"][-1] + 1) % 256]
    for method in results["methods"].values():  # as if another tokenizer had made the run's prompts
        method[dataset][0]["prompt_len"] += 1
    with open(path, "w") as f:
        json.dump(results, f)
    assert report_main([path, "--reanalyse", tiny_target_dir]) != 0
    assert "the prompt is not the evaluation's" in capsys.readouterr().err


def test_a_device_this_machine_lacks_is_one_error_before_loading(
    eval_overrides, tiny_target_dir, tmp_path, capsys
):
    """--device names where the target runs; one this machine does not have is one error naming the flag."""
    _, path = _recorded_run(eval_overrides, tmp_path)
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert report_main([path, "--reanalyse", tiny_target_dir, "--device", "cuda"]) != 0
    assert "--device 'cuda'" in capsys.readouterr().err
