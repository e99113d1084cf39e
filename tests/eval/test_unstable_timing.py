"""Timing that refuses to lie: a sample whose interleaved runs of one method spread past the limit (a busy
machine) gives no speedup; the eval's report and the pipeline's table say "unstable" and why, in one line."""

from __future__ import annotations

import random

from longspec.eval.report import report_markdown
from longspec.eval.summary import MAX_TIMING_SPREAD, summarise, timing_spread
from longspec.pipeline.report import results_table


def _record(sample_id: str, output: list[int], runs_s: list[float]) -> dict:
    """A sample timed in interleaved runs (`runs_s`, decode seconds), the fastest kept, as the eval records it."""
    return {"id": sample_id, "prompt_len": 100, "output_ids": output, "num_new_tokens": len(output),
            "rounds": len(output), "accepted": [0] * len(output), "decode_s": min(runs_s), "draft_s": 0.0,
            "verify_s": 0.0, "overhead_s": 0.0,
            "timing_runs": [{"decode_s": s, "tokens_per_s": 1.0, "mean_accept_length": 1.0} for s in runs_s]}  # fmt: skip


def _results(ar_runs: list[float], max_spread: float = MAX_TIMING_SPREAD) -> dict:
    rng = random.Random(0)
    text = [rng.randrange(2000) for _ in range(64)]  # real text, not a loop the quality guard sets apart
    methods = {
        "ar": {"d": [_record("a", text, ar_runs)]},
        "longspec": {"d": [_record("a", text, [0.5, 0.55, 0.6])]},
    }
    config = {"target": {"path": "t"}, "generation": {"temperature": 0.0, "max_new_tokens": 64},
              "timing_repeats": 3, "max_timing_spread": max_spread}  # fmt: skip
    return {"summary": summarise(methods, greedy=True, max_spread=max_spread), "methods": methods, "data": [],
            "device": "cpu", "dtype": "float32", "started": "now", "config": config}  # fmt: skip


def test_a_spread_past_the_limit_gives_no_speedup_and_the_report_says_unstable():
    assert (
        timing_spread(_record("a", [1], [0.2, 6.2])) == 31.0
        and timing_spread(_record("a", [1], [0.2])) is None
    )
    stable = _results([1.0, 1.1, 1.2])  # 1.2x: within 1.5x
    spec = stable["summary"]["d"]["longspec"]
    assert spec["unstable_vs"] == [] and spec["speedup"]["ar"] == 2.0
    assert "| longspec | 1.00 | 126.0 | 2.00x |" in report_markdown(stable)

    # ar's runs of one sample took 0.2 s and 6.2 s: the machine was busy, no "x vs ar" from it
    busy = _results([6.2, 0.2, 0.3])
    spec, ar = busy["summary"]["d"]["longspec"], busy["summary"]["d"]["ar"]
    assert ar["unstable_samples"] == ["a"] and spec["unstable_samples"] == []
    assert spec["unstable_vs"] == ["ar"] and "ar" not in spec["speedup"]
    text = report_markdown(busy)
    assert "| longspec | 1.00 | 126.0 | unstable |" in text and "unstable vs ar" in text
    assert "spread more than 1.5x (slowest / fastest: a busy machine)" in text
    assert "1 beyond the 1.5x limit (unstable)" in text

    # the limit is the eval's max_timing_spread
    assert _results([6.2, 0.2, 0.3], max_spread=40)["summary"]["d"]["longspec"]["speedup"]["ar"] == 0.4


def test_the_pipeline_table_prints_unstable_and_one_line_why():
    rows = [
        {"run": "eval", "temperature": 0.0, "dataset": "d", "method": "longspec", "tau": 1.8, "tokens_per_s": 30.0,
         "speedup": {}, "unstable_vs": ["ar"], "max_timing_spread": 1.5, "identical": 1.0, "identical_text": "yes",
         "unexplained": 0, "prompt_len": 900, "num_samples": 3, "trees": {"ar": 1}},
        {"run": "eval", "temperature": 0.0, "dataset": "d", "method": "ar", "tau": 1.0, "tokens_per_s": 40.0,
         "speedup": {}, "unstable_vs": [], "max_timing_spread": 1.5, "identical": 1.0, "identical_text": "yes",
         "unexplained": 0, "prompt_len": 900, "num_samples": 3},
    ]  # fmt: skip
    table = results_table(rows)
    assert "| longspec | 3 | 1.80 | 30.0 | unstable | yes |" in table
    assert sum("spread more than 1.5x" in line for line in table.splitlines()) == 1
    assert (
        "longspec at 0.75x of ar" not in table
    )  # no ratio from an unstable cell, not even the "slower" line
