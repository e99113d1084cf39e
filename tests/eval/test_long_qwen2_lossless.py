"""Lossless through the eval CLI on a tiny Qwen2 shaped like Qwen2.5-Coder-0.5B (issue 45): RoPE theta 1e6, q/k/v
biases, GQA 14/2 scaled down to 7/1, a 32K-style context, repository-level prompts of a few thousand tokens (the byte
tokenizer: one token a byte). At T=0 in float32 every method's output is the target's greedy output."""

import json

from longspec.eval.__main__ import main
from longspec.testing import save_tiny_target


def _repo_row(i: int) -> dict:
    """A repobench-p row of ~3K tokens: two files of context, the current file cut at a line end."""
    util = "".join(f"def helper_{k}(x):\n    return x * {k} + {i}\n\n\n" for k in range(25))
    current = "".join(
        f"def step_{k}(x):\n    y = helper_{k % 7}(x)\n    return y - {k}\n\n\n" for k in range(30)
    )
    return {"_id": f"repo-{i}", "dataset": "repobench-p", "chat": False, "answers": ["    y = helper_3(x)"],
            "context": f"# Path: pkg/util.py\n{util}# Path: pkg/models.py\n{util.replace('helper', 'model')}",
            "input": f"# Path: pkg/core.py\nfrom .util import helper_{i}\n\n{current}def step_99(x):\n"}  # fmt: skip


def test_a_32k_shaped_qwen2_stays_lossless_at_thousands_of_tokens(tmp_path):
    target = save_tiny_target("qwen2", tmp_path / "target", num_attention_heads=7, num_key_value_heads=1,
                              hidden_size=112, max_position_embeddings=32768)  # fmt: skip
    config = json.loads((tmp_path / "target" / "config.json").read_text())
    assert config["rope_parameters"]["rope_theta"] == 1e6 and config["max_position_embeddings"] == 32768
    data = tmp_path / "repobench-p_4k.jsonl"
    data.write_text("".join(json.dumps(_repo_row(i)) + "\n" for i in range(1)), encoding="utf-8")
    out = tmp_path / "out"
    status = main([
        "target=tiny_qwen2", f"target.path={target}", f"data.name=[{data}]", "data.min_prompt_tokens=2048",
        "data.context_len=4096", "data.context_margin=0", "drafter.init=random", "drafter.window=64",
        "dtype=float32", "method=[longspec,ar]", "max_new_tokens=16", "tree_widths=[2,2,2]", "temperature=0",
        "warmup=false", f"output_dir={out}",
    ])  # fmt: skip
    assert status == 0
    results = json.loads((out / "results.json").read_text())
    (report,) = results["data"]
    assert report["num_kept"] == 1  # a prompt of thousands of tokens
    samples = results["methods"]["longspec"]["repobench-p_4k"]
    assert all(2048 < s["prompt_len"] <= 4096 for s in samples)
    for method, agg in results["summary"]["repobench-p_4k"].items():
        assert agg["identical_to_greedy"] == 1.0, method
    assert sum(len(s["accepted"]) for s in samples) >= 1  # speculative rounds ran (the fixed tree)
