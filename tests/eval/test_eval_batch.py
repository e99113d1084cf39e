"""`python -m longspec.eval ... batch_size=N` (issue 13): the engine methods (through `generate_batch`) and the HF
baselines vanilla_hf / vanilla_fa (left-padded) decode N samples at a time, hf_compile one at a time; at T=0 every
sample's output is the one it gets decoded alone."""

import json

import pytest

from longspec.eval.__main__ import main
from longspec.eval.config import load_eval_config

METHODS = ("longspec", "ar", "pld")


@pytest.fixture
def three_rows(tmp_path):
    """Three prompts of different lengths: a batch of 2, then a last batch of 1."""
    path = tmp_path / "rows.jsonl"
    with open(path, "w") as f:
        for i, text in enumerate(
            ("def f(x):\n    return {x: 1}\n", "A: hi. B: we ship Monday. ", "x = [1, 2]\n")
        ):
            row = {"_id": f"r{i}", "context": text * (2 + i), "input": "", "answers": ["a"], "dataset": "lcc"}
            f.write(json.dumps(row) + "\n")
    return str(path)


def _run(eval_overrides, data, out, *extra) -> dict:
    overrides = eval_overrides(out, f"method=[{','.join(METHODS)},vanilla_fa,hf_compile]", *extra, data=data)
    assert main(overrides) == 0
    return json.loads((out / "results.json").read_text())


def test_batch_size_2_gives_the_outputs_of_batch_size_1(eval_overrides, three_rows, tmp_path):
    one = _run(eval_overrides, three_rows, tmp_path / "b1", "warmup=false")
    two = _run(eval_overrides, three_rows, tmp_path / "b2", "batch_size=2")
    for method in (*METHODS, "vanilla_fa", "hf_compile"):
        outputs = [[r["output_ids"] for r in run["methods"][method]["rows"]] for run in (one, two)]
        assert len(outputs[0]) == 3 and outputs[0] == outputs[1], method
        assert two["summary"]["rows"][method]["identical_to_greedy"] == 1.0, method  # lossless, batched
    for method in (*METHODS, "vanilla_fa"):  # batched: each record carries its batch's size and throughput
        records = two["methods"][method]["rows"]
        assert [r["batch_size"] for r in records] == [2, 2, 1], method
        # the last batch ran padded to 2 rows (one cache shape, one set of graphs for the whole run)
        assert [r["batch_padding"] for r in records] == [0, 0, 1], method
        assert records[0]["batch_tokens_per_s"] == records[1]["batch_tokens_per_s"] > 0
        assert records[0]["decode_s"] == records[1]["decode_s"]  # a row's decode time is its batch's
        assert two["summary"]["rows"][method]["batch_tokens_per_s"] > 0
    assert "batch_size" not in two["methods"]["hf_compile"]["rows"][0]  # its compiled step is batch 1
    assert all("batch_tokens_per_s" not in agg for agg in one["summary"]["rows"].values())
    report = (tmp_path / "b2" / "report.md").read_text()
    assert "## Batch throughput (batch_size 2)" in report and "| rows | hf_compile | – (batch 1) |" in report
    assert "Batch throughput" not in (tmp_path / "b1" / "report.md").read_text()


def test_batch_size_0_is_one_clear_error(tiny_target_dir, three_rows):
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        load_eval_config(
            ["target=tiny_llama", f"target.path={tiny_target_dir}", f"data.path={three_rows}", "batch_size=0"]
        )


def test_sampling_runs_batched(eval_overrides, three_rows, tmp_path):
    """T > 0 is allowed with batch_size > 1 (batched sampling is exact); no greedy check then."""
    results = _run(
        eval_overrides, three_rows, tmp_path / "out", "batch_size=2", "temperature=0.7", "warmup=false"
    )
    for method in METHODS:
        records = results["methods"][method]["rows"]
        assert [r["batch_size"] for r in records] == [2, 2, 1] and all(r["output_ids"] for r in records)
        assert results["summary"]["rows"][method]["identical_to_greedy"] is None
