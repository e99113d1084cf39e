"""GenerationStats: τ and the per-depth acceptance profile recorded round by round."""

import pytest

from longspec.eval.summary import _aggregate
from longspec.infer.stats import GenerationStats, tree_depth


def test_tree_depth():
    assert [tree_depth(t) for t in ("4-16-16", "1", "ar", None, "pld")] == [3, 1, 0, 0, 0]


def test_acceptance_profile_counts_only_the_depths_a_round_reached():
    stats = GenerationStats()
    stats.record_round(0, "ar")  # no tree: not part of the profile
    stats.record_round(2, "2-2-2")  # depths 1, 2 accepted, 3 reached and rejected
    stats.record_round(0, "2-2-2")  # depth 1 rejected: 2 and 3 never reached
    stats.record_round(1, "4-4")  # depth 1 accepted, 2 rejected
    stats.record_round(3, "1-1-1")  # the whole tree accepted
    assert stats.depth_reached == [4, 3, 2]
    assert stats.depth_accepted == [3, 2, 1]
    assert stats.acceptance_profile == pytest.approx([3 / 4, 2 / 3, 1 / 2])
    assert stats.mean_accept_length == pytest.approx((0 + 2 + 0 + 1 + 3 + 5) / 5)
    assert stats.to_dict()["acceptance_profile"] == stats.acceptance_profile


def test_profile_of_a_depth_no_round_reached_is_none_and_records_pool():
    a, b = GenerationStats(), GenerationStats()
    a.record_round(0, "2-2")
    b.record_round(2, "2-2")
    b.record_round(1, "2-2")
    assert a.acceptance_profile == [0.0, None]
    records = [
        {**s.to_dict(), "num_new_tokens": 3, "prompt_len": 5, "decode_s": 1.0, "tokens_per_s": 2.0}
        for s in (a, b)
    ]
    assert _aggregate(records)["acceptance_profile"] == pytest.approx([2 / 3, 1 / 2])


def test_rounds_are_logged_in_order_with_their_wall_time():
    stats = GenerationStats()
    stats.record_round(0, "ar", 0.0011)
    stats.record_round(3, "lookup16", 0.00135)
    stats.record_round(0)  # an HF baseline's step: no tree, no time
    stats.record_round(0, "ar", 0.001)
    assert stats.round_trees == ["ar", "lookup16", "ar"] and stats.round_ms == [1.1, 1.35, 1.0]
    assert stats.trees == {"ar": 2, "lookup16": 1}  # counted from the log, in first-run order
    assert stats.to_dict()["round_ms"] == [1.1, 1.35, 1.0] and stats.to_dict()["trees"] == stats.trees


def test_an_engine_call_logs_every_round():
    from infer_helpers import random_drafter

    from longspec.infer.engine import GenerationConfig, SpeculativeEngine
    from longspec.testing import make_tiny_target

    target = make_tiny_target("llama")
    engine = SpeculativeEngine(target, random_drafter(target))
    result = engine.generate(list(range(1, 30)), GenerationConfig(max_new_tokens=12, tree="auto"))
    stats = result.stats
    assert len(stats.round_trees) == len(stats.round_ms) == stats.rounds > 0
    assert all(ms > 0 for ms in stats.round_ms)


def test_a_decode_loop_runs_without_automatic_collection(monkeypatch):
    """no_gc around the decode loop: no collection inside it, the collector's state restored after it (a
    caller that had disabled it keeps it disabled)."""
    import gc

    from infer_helpers import random_drafter

    from longspec.infer.engine import GenerationConfig, SpeculativeEngine
    from longspec.infer.loop import DecodeLoop
    from longspec.testing import make_tiny_target

    seen = []
    real_run = DecodeLoop.run
    monkeypatch.setattr(
        DecodeLoop,
        "run",
        lambda self, roots: seen.append(gc.isenabled()) or real_run(self, roots),
    )
    target = make_tiny_target("llama")
    engine = SpeculativeEngine(target, random_drafter(target))
    config = GenerationConfig(max_new_tokens=6, tree="1")
    assert gc.isenabled()
    engine.generate(list(range(1, 20)), config)
    assert seen == [False] and gc.isenabled()
    gc.disable()
    try:
        engine.generate(list(range(1, 20)), config)
        assert not gc.isenabled()
    finally:
        gc.enable()
