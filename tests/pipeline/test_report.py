"""The pipeline's report (longspec.pipeline.report): the results table, training summary and report files."""

from __future__ import annotations

import json

from longspec.pipeline import eval_rows, load_preset, plan, results_table, write_report


def test_results_table_and_report(tmp_path):
    preset = load_preset("cpu")
    (tmp_path / "eval").mkdir()
    summary = {
        "heldout_lcc": {
            "longspec": {"mean_accept_length": 2.5, "tokens_per_s": 30.0, "speedup": {"vanilla_hf": 1.5},
                         "identical_to_greedy": 1.0, "mean_prompt_len": 1500, "num_samples": 3},
            "vanilla_hf": {"mean_accept_length": 1.0, "tokens_per_s": 20.0, "speedup": {},
                           "identical_to_greedy": 1.0, "mean_prompt_len": 1500, "num_samples": 3},
        },
        # every sample degenerate: the headline is empty, the table falls back to all samples, marked; longspec
        # slower than plain decoding says why
        "looping": {
            "longspec": {"mean_accept_length": None, "tokens_per_s": None, "speedup": {}, "num_samples": 0,
                         "num_degenerate": 2, "identical_to_greedy": 1.0,
                         "all_samples": {"mean_accept_length": 1.1, "tokens_per_s": 18.0, "mean_prompt_len": 900,
                                         "trees": {"ar": 45, "1": 5},
                                         "policy": {"ar": {"expected_tokens": 1.0, "cost_ms": 1.1,
                                                           "tokens_per_ms": 0.909},
                                                    "1": {"expected_tokens": 1.4, "cost_ms": 1.6,
                                                          "tokens_per_ms": 0.875},
                                                    "lookup16": {"expected_tokens": 1.1, "cost_ms": 1.3,
                                                                 "tokens_per_ms": 0.846}}}},
            "vanilla_hf": {"mean_accept_length": None, "tokens_per_s": None, "speedup": {}, "num_samples": 0,
                           "num_degenerate": 2, "identical_to_greedy": 1.0,
                           "all_samples": {"mean_accept_length": 1.0, "tokens_per_s": 20.0, "mean_prompt_len": 900}},
        },
    }  # fmt: skip
    # speculating in most rounds and still slower: says so, not "decoded without it"
    summary["short"] = {
        "longspec": {"mean_accept_length": 1.39, "tokens_per_s": 15.0, "num_samples": 1, "mean_prompt_len": 3500,
                     "trees": {"4-16-16-16-16": 18}},
        "vanilla_hf": {"mean_accept_length": 1.0, "tokens_per_s": 20.0, "num_samples": 1, "mean_prompt_len": 3500},
    }  # fmt: skip
    # batched decoding: a row's own tokens/s is its length over the batch's time; the table shows the batch's
    summary["batched"] = {
        "longspec": {"mean_accept_length": 1.5, "tokens_per_s": 30.5, "batch_tokens_per_s": 675.8,
                     "num_samples": 1, "mean_prompt_len": 3560},
        "vanilla_hf": {"mean_accept_length": 1.0, "tokens_per_s": 40.0, "num_samples": 1, "mean_prompt_len": 3560},
    }  # fmt: skip
    (tmp_path / "eval" / "results.json").write_text(json.dumps({"summary": summary}))
    rows = eval_rows(str(tmp_path), preset)
    table = results_table(rows)
    assert "| longspec | 3 | 2.50 | 30.0 | 1.50x | yes |" in table
    assert "| longspec | 0 (+2 degenerate) | 1.10* | 18.0* | 0.90x* | yes |" in table
    assert (
        "eval / looping: longspec at 0.90x of vanilla_hf" in table and "without it in 90% of rounds" in table
    )
    # ... and what the policy believed there, from its own figures
    assert (
        "At the last sample's end the policy rated plain decoding 0.909 tokens/ms (1.10 ms a step), its best "
        "speculating round `1` 0.875 (1.40 tokens expected in 1.60 ms)." in table
    )
    assert "| batched | 3560 | longspec | 1 | 1.50 | 675.8 | 16.89x |" in table
    assert "eval / short: longspec at 0.75x of vanilla_hf: speculation ran in 100% of rounds" in table
    run_dir = tmp_path / "runs" / "stage1"
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text(
        "".join(
            json.dumps({"step": s, "loss": 9.0 - s, "ce": 5.0 - s, "acc": 0.1 * s, "tokens_seen": 100 * s})
            + "\n"
            for s in (1, 2)
        )
    )
    text = write_report(str(tmp_path), preset, plan(preset, str(tmp_path)), {}, 12.0)
    assert "| 1 | 2 | 200 | 4.000 | 3.000 | 20.0% |" in text
    assert (tmp_path / "report.md").exists() and (tmp_path / "training_loss.png").exists()
    assert json.loads((tmp_path / "e2e_summary.json").read_text())["eval"][0]["tau"] == 2.5
