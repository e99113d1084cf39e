"""Divergence analysis (longspec.eval.divergence) and how summaries and the pipeline table count near-ties."""

from __future__ import annotations

import pytest
import torch

from longspec.eval.divergence import analyse_divergence, first_divergence, tie_tolerance
from longspec.eval.summary import identical_text, summarise
from longspec.pipeline import results_table
from longspec.testing import make_tiny_hf_model


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 5, 3], [1, 2, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2  # one stopped early
    assert first_divergence([], []) is None


def test_tie_tolerance_is_two_ulp_of_the_top_logit():
    assert tie_tolerance(16.0, torch.bfloat16) == pytest.approx(2 * 2**-7 * 16)
    assert tie_tolerance(0.1, torch.float32) == pytest.approx(2 * 2**-23)  # floor at |logit| 1


def _greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


PROMPT = [3, 17, 42, 9, 11, 5]


def _greedy_and_ranked(index: int):
    """A tiny model, its greedy continuation of PROMPT (6 tokens) and the target's tokens at position `index` of
    it, best first."""
    model = make_tiny_hf_model("llama")
    greedy = _greedy(model, PROMPT, 6)
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + greedy[:index]])).logits[0, -1]
    return model, greedy, logits, logits.argsort(descending=True).tolist()


def test_gap_is_the_targets_logit_difference_on_the_reference_prefix():
    model, reference, logits, ranked = _greedy_and_ranked(3)
    prompt, runner_up = PROMPT, ranked[1]
    output = reference[:3] + [runner_up] + reference[4:]

    divergence = analyse_divergence(model, prompt, output, reference)
    assert (divergence.index, divergence.reference_token, divergence.token) == (3, reference[3], runner_up)
    assert divergence.gap == pytest.approx(float(logits[reference[3]] - logits[runner_up]), abs=1e-5)
    assert divergence.gap > divergence.tolerance and not divergence.near_tie  # fp32: a real difference
    assert not divergence.reference_off and not divergence.explained  # the target's argmax is the reference's
    # judged in another dtype's rounding (a bf16 run analysed in float32): the same gap, bf16's tolerance
    as_bf16 = analyse_divergence(model, prompt, output, reference, tie_dtype=torch.bfloat16)
    assert as_bf16.gap == divergence.gap
    assert as_bf16.tolerance == pytest.approx(tie_tolerance(float(logits.max()), torch.bfloat16))
    assert analyse_divergence(model, prompt, reference, reference) is None
    early = analyse_divergence(model, prompt, reference[:2], reference)
    assert early.index == 2 and early.token is None and not early.near_tie


def test_a_reference_that_leaves_the_targets_argmax_is_the_references_divergence():
    """The reference, not the checked output, takes a runner-up token: the gap is negative beyond the tolerance
    and the output's token is the target's argmax there, so the difference does not count against the output."""
    model, greedy, _, ranked = _greedy_and_ranked(2)
    prompt, runner_up, third = PROMPT, ranked[1], ranked[2]
    reference = greedy[:2] + [runner_up] + greedy[3:]

    divergence = analyse_divergence(model, prompt, greedy, reference)
    assert (divergence.index, divergence.reference_token, divergence.token) == (2, runner_up, greedy[2])
    assert divergence.gap < -divergence.tolerance and not divergence.near_tie
    assert divergence.reference_off and divergence.explained
    assert divergence.to_dict()["reference_off"] is True
    # Both off the argmax (the output takes the third token): the output's own error, whatever the sign
    both = analyse_divergence(model, prompt, greedy[:2] + [third] + greedy[3:], reference)
    assert both.gap > 0 and not both.reference_off and not both.explained


def test_an_exact_tie_is_a_near_tie():
    model = make_tiny_hf_model("llama")
    prompt = [3, 17, 42, 9, 11, 5]
    reference = _greedy(model, prompt, 3)
    twin = (reference[1] + 1) % model.config.vocab_size
    with (
        torch.no_grad()
    ):  # the twin's output row copies the chosen token's: their logits are equal everywhere
        model.lm_head.weight[twin] = model.lm_head.weight[reference[1]]
    output = [reference[0], twin, reference[2]]
    divergence = analyse_divergence(model, prompt, output, reference)
    assert divergence.index == 1 and divergence.gap == 0.0 and divergence.near_tie


def _record(sample_id: str, output: list[int], divergence: dict | None = None) -> dict:
    record = {"id": sample_id, "prompt_len": 10, "output_ids": output, "num_new_tokens": len(output),
              "rounds": len(output), "accepted": [0] * len(output), "decode_s": 1.0, "draft_s": 0.0,
              "verify_s": 1.0, "overhead_s": 0.0}  # fmt: skip
    if divergence is not None:
        record["divergence"] = divergence
    return record


def test_summary_counts_near_ties_apart_from_unexplained_differences():
    tie = {"index": 1, "reference_token": 2, "token": 7, "gap": 0.0625, "tolerance": 0.25, "near_tie": True}
    real = {**tie, "gap": 3.0, "near_tie": False}
    methods = {
        "ar": {"d": [_record("a", [1, 2, 3]), _record("b", [4, 5, 6]), _record("c", [7, 8, 9])]},
        "longspec": {"d": [_record("a", [1, 7, 3], tie), _record("b", [4, 5, 6]), _record("c", [7, 1, 9], real)]},
        "pld": {"d": [_record("a", [1, 2, 3]), _record("b", [4, 9, 6]), _record("c", [7, 8, 9])]},  # no analysis
    }  # fmt: skip
    summary = summarise(methods, greedy=True)["d"]
    assert summary["ar"]["identical_to_greedy"] == 1 and summary["ar"]["unexplained_divergences"] == 0
    assert summary["ar"]["ms_per_round"] == pytest.approx(1000 * 3.0 / 9)  # 3 samples: 1 s, 3 rounds each
    spec = summary["longspec"]
    assert spec["identical_to_greedy"] == pytest.approx(1 / 3)
    assert (spec["near_ties"], spec["unexplained_divergences"], spec["max_tie_gap"]) == (1, 1, 0.0625)
    assert summary["pld"]["unexplained_divergences"] == 1  # a difference nobody analysed is not excused
    assert identical_text(summary["ar"]) == "yes"
    # the real divergence: a gap of 3.0 where the tolerance (2 ulp) is 0.25, i.e. 24 ulp; pld's was not analysed
    assert (
        spec["max_divergence_ulps"] == pytest.approx(24.0) and summary["pld"]["max_divergence_ulps"] is None
    )
    assert identical_text(spec) == (
        "33% (1 near-tie, logit gap <= 0.0625; 1 NOT a near-tie, logit gap up to 24 ulp against a tolerance of 2)"
    )
    assert identical_text(summary["pld"]) == "67% (1 NOT a near-tie)"
    assert identical_text(summarise(methods, greedy=False)["d"]["longspec"]) == "n/a"

    # A difference where the reference left the target's argmax (`reference_off`) is counted apart, not against
    # the output; a record from before the field existed reads as not reference_off.
    off = {**real, "gap": -0.5, "reference_off": True}
    methods["longspec"]["d"][2] = _record("c", [7, 1, 9], off)
    spec = summarise(methods, greedy=True)["d"]["longspec"]
    assert (spec["near_ties"], spec["reference_divergences"], spec["unexplained_divergences"]) == (1, 1, 0)
    assert spec["max_reference_gap"] == 0.5 and spec["max_divergence_ulps"] is None
    assert identical_text(spec) == (
        "33% (1 near-tie, logit gap <= 0.0625; 1 where the reference left the target's argmax, by <= 0.5)"
    )

    rows = [{"run": "t0", "temperature": 0.0, "dataset": "d", "method": m, "tau": 1.0, "tokens_per_s": 1.0,
             "speedup": {}, "identical": s["identical_to_greedy"], "identical_text": identical_text(s),
             "prompt_len": 10, "num_samples": 3} for m, s in summary.items()]  # fmt: skip
    assert "33% (1 near-tie" in results_table(rows)
