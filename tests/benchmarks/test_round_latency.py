import json

import pytest
import torch


@pytest.fixture(scope="module")
def round_latency(load_benchmark):
    return load_benchmark("round_latency")


def test_tiny_mode_writes_a_complete_table(round_latency, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OUT", str(tmp_path))
    round_latency.main(
        ["--tiny", "--contexts", "40", "--iters", "1", "--warmup", "1", "--round-costs", "--kernels"]
    )
    result = json.loads((tmp_path / "round_latency.json").read_text())
    (row,) = result["rows"]
    assert row["context"] == 40 and row["tree_nodes"] == 69
    for key in (
        "ar_hf_ms",
        "ar_ours_ms",
        "ar_ours_static_ms",
        "draft_ms",
        "verify_ms",
        "accept_ms",
        "floor_ms",
    ):
        assert row[key] > 0, key
    assert row["round_ms"] == pytest.approx(row["draft_ms"] + row["verify_ms"] + row["accept_ms"])
    assert row["ar_static_vs_eager_max_abs_diff"] < 1e-4  # the graph's path computes the same logits
    assert row["draft_static_matches_eager"]
    # the draft step's launches in order (on the CPU: its top-level ATen ops), each with a time
    assert len(row["draft_kernels"]) == row["draft_launches"] > 0
    assert all(name.startswith("aten::") and us >= 0 for name, us in row["draft_kernels"])
    # the whole round as generate runs it, every tree="auto" candidate, greedy and sampling
    costs = result["round_costs_ms"]
    assert set(costs) == {"T=0", "T=1"} and all(
        len(c) == 15 and min(c.values()) > 0 for c in costs.values()
    )  # 9 trees, 4 lookup chains, 2 lookup forests
    assert result["catch_up_ms"] > 0  # the drafter ring's catch-up, timed on its own
    out = capsys.readouterr().out
    assert f"total of {row['draft_launches']} launches" in out
    assert "| context |" in out and "whole round, ms (T=1): 1024:ar" in out and "catch-up" in out


def test_layer_routes_swap_the_fused_steps_and_restore_them(round_latency):
    # The routes the GPU run compares (Liger's kernels need CUDA; "torch" runs anywhere): swapped in for the
    # context only, with the engine's steps dropped on both sides so no route replays another's.
    import torch

    from longspec.infer.engine import SpeculativeEngine
    from longspec.kernels import layer_ops as kernels
    from longspec.modules import layer_ops
    from longspec.testing import make_tiny_target

    engine = SpeculativeEngine(make_tiny_target("llama"))
    before = (layer_ops.add_rms_norm, layer_ops.qkv_rope, layer_ops.silu_mul)
    ids = torch.arange(5)[None]
    expected = engine.target(ids).hidden
    engine.target_step.steps = {"stale": None}
    with round_latency.layer_route(engine, "torch"):
        assert layer_ops.qkv_rope is kernels.qkv_rope_naive and engine.target_step.steps == {}
        assert torch.equal(engine.target(ids).hidden, expected)
    assert (layer_ops.add_rms_norm, layer_ops.qkv_rope, layer_ops.silu_mul) == before
    assert engine.target_step.steps == {}
    packed = engine.target.packed
    with round_latency.layer_route(engine, "unfused"):  # the HF modules' own layer
        assert engine.target.packed is None
        assert torch.equal(engine.target(ids).hidden, expected)
    assert engine.target.packed is packed


def test_a_draft_vocabulary_and_a_chain_of_one(round_latency, tmp_path, monkeypatch):
    """--draft-vocab K drafts through K head rows; --tree 1 times one draft step (a chain of one) and its round."""
    monkeypatch.setenv("OUT", str(tmp_path))
    round_latency.main(
        ["--tiny", "--contexts", "40", "--iters", "1", "--warmup", "1", "--draft-vocab", "64", "--tree", "1"]
    )
    result = json.loads((tmp_path / "round_latency.json").read_text())
    (row,) = result["rows"]
    assert result["draft_vocab_size"] == 64
    assert row["tree_nodes"] == 2 and row["draft_ms"] > 0 and row["draft_static_matches_eager"]
    assert row["draft_launches"] > 0 and row["ar_launches"] > 0


def test_launch_counts_grow_with_the_work(round_latency):
    """The launch count is a count of what one call dispatches: two calls of a step count twice one call."""
    step = lambda: torch.ones(3).add_(1).mul_(2)  # noqa: E731 - three ATen ops at top level
    once = round_latency.count_launches(step, torch.device("cpu"))
    twice = round_latency.count_launches(lambda: (step(), step()), torch.device("cpu"))
    assert once == 3 and twice == 6
