"""The quality guard: degenerate target outputs are flagged and kept out of the headline τ / speedup."""

import math
import random

from longspec.eval.quality import MIN_DISTINCT_RATIO, assess, periodic_tail, repeated_share
from longspec.eval.report import outputs_markdown, report_markdown
from longspec.eval.summary import summarise


def _real(n, seed=0):
    rng = random.Random(seed)
    return [rng.randrange(2000) for _ in range(n)]


def test_assess_flags_one_token_loops_short_ngram_loops_and_not_real_text():
    assert assess([7] * 200).reason == "low_distinct_ratio"
    assert assess([7] * 200).distinct_ratio == 1 / 200
    looped = _real(60) + [11, 12, 13, 14, 15] * 30  # 150 of 210 tokens loop a 5-gram; ratio 65/210 is fine
    quality = assess(looped)
    assert (
        quality.distinct_ratio > MIN_DISTINCT_RATIO and quality.reason == "loop" and quality.loop_period == 5
    )
    assert not assess(_real(300)).degenerate
    assert not assess([1, 1, 1]).degenerate  # too short to judge
    assert assess([]).distinct_ratio is None and not assess([]).degenerate


def test_assess_flags_a_repeated_sentence_that_is_no_short_period():
    """What SmolLM2-135M-Instruct wrote for a 4K-token summary prompt: one ~25-token sentence over and over, with
    small variations, so neither the distinct ratio (0.17) nor a period <= 16 catches it."""
    intro = _real(20, seed=1)
    sentence = _real(25, seed=2)
    looped = intro + [t for k in range(5) for t in sentence[:-1] + [3000 + k]]
    quality = assess(looped)
    assert quality.distinct_ratio > MIN_DISTINCT_RATIO and quality.loop_period is None
    assert quality.reason == "repetition" and quality.repeated_share > 0.7
    assert repeated_share(_real(300)) == 0.0 and not assess(_real(300)).degenerate


def test_periodic_tail_matches_a_plain_scan():
    rng = random.Random(3)
    for _ in range(200):
        tokens = [rng.randrange(3) for _ in range(rng.randrange(0, 40))]
        period, length = periodic_tail(tokens, 6)
        best = (None, 0)  # reference: try every tail length and period directly
        for p in range(1, 7):
            for n in range(2 * p, len(tokens) + 1):
                tail = tokens[len(tokens) - n :]
                if all(tail[i] == tail[i - p] for i in range(p, n)) and n > best[1]:
                    best = (p, n)
        assert (period, length) == best


def _record(sample_id, output, accepted, decode_s):
    return {"id": sample_id, "prompt_len": 100, "output_ids": output, "num_new_tokens": len(output),
            "rounds": len(accepted), "accepted": accepted, "decode_s": decode_s, "draft_s": 0.0,
            "verify_s": 0.0, "overhead_s": 0.0}  # fmt: skip


def test_degenerate_samples_are_reported_apart_and_do_not_inflate_tau():
    good, bad = _real(100), [5] * 100
    methods = {
        # The target-only reference: one step a token.
        "ar": {"d": [_record("ok", good, [0] * 100, 1.0), _record("loop", bad, [0] * 100, 1.0)]},
        # The drafter predicts the loop perfectly (τ 10) but real text poorly (τ 2).
        "longspec": {"d": [_record("ok", good, [1] * 50, 0.5), _record("loop", bad, [9] * 10, 0.1)]},
    }
    summary = summarise(methods, greedy=True)["d"]
    spec = summary["longspec"]
    assert spec["num_degenerate"] == 1 and spec["num_samples"] == 1
    assert spec["mean_accept_length"] == 2.0  # the headline: the real sample only
    assert spec["degenerate_samples"]["mean_accept_length"] == 10.0
    assert math.isclose(spec["all_samples"]["mean_accept_length"], 200 / 60)
    assert math.isclose(spec["speedup"]["ar"], (99 / 0.5) / (99 / 1.0))  # speedup on the real sample too
    assert spec["quality"]["loop"]["degenerate"] and not spec["quality"]["ok"]["degenerate"]
    assert spec["quality"]["loop"]["judged_on"] == "ar"
    assert spec["identical_to_greedy"] == 1.0  # the lossless check still covers every sample
    results = {"summary": {"d": summary}, "methods": methods, "data": [], "device": "cpu", "dtype": "float32",
               "started": "now", "config": {"target": {"path": "t"}, "temperature": 0.0, "max_new_tokens": 100}}  # fmt: skip
    text = report_markdown(results)
    assert "## Output quality" in text and "| d | 2 | 1 (loop) |" in text and "longspec 10.00" in text


def test_without_a_target_only_method_each_output_is_judged():
    methods = {
        "longspec": {"d": [_record("a", [5] * 64, [3] * 16, 0.1), _record("b", _real(64), [1] * 32, 0.2)]}
    }
    spec = summarise(methods, greedy=False)["d"]["longspec"]
    assert spec["num_degenerate"] == 1 and spec["quality"]["a"]["judged_on"] == "longspec"
    assert spec["mean_accept_length"] == 2.0


def test_outputs_markdown_shows_the_reference_text_with_its_verdict():
    good, bad = _real(64), [5] * 64
    methods = {
        "ar": {"d": [_record("ok", good, [0] * 64, 1.0), _record("loop", bad, [0] * 64, 1.0)]},
        "longspec": {"d": [_record("ok", good, [1] * 32, 0.5), _record("loop", bad, [7] * 8, 0.1)]},
    }
    # a decoded text that holds a code fence: the block's own fence must be longer
    text = outputs_markdown(
        methods, lambda ids: "```x```" if ids == bad else " ".join(map(str, ids)), max_chars=20
    )
    assert "## d / ok\n\nar, 64 tokens, distinct ratio" in text and ", ok\n" in text
    assert "## d / loop\n\nar, 64 tokens, distinct ratio 0.02, degenerate: low_distinct_ratio" in text
    assert "````text\n```x```\n````" in text
    assert " [...]" in text  # the real sample is cut at max_chars


def test_a_loop_that_only_another_method_wrote_sets_the_sample_apart():
    """At T=0 a bf16 near-tie can end the reference early while another method continues into a loop (GPU,
    gov_report_8k: graph AR stopped after 19 tokens, longspec wrote 128 of one repeated sentence): that
    method's speed was measured on the loop, so the sample is degenerate and the verdict names the method. A
    method that differs without looping changes nothing."""
    answer = _real(19)
    looped = answer + answer[:10] * 11
    methods = {
        "ar": {"d": [_record("tie", answer, [0] * 19, 1.0), _record("ok", _real(64), [0] * 64, 1.0)]},
        "pld": {"d": [_record("tie", answer, [0] * 19, 1.0), _record("ok", _real(64)[:60], [1] * 30, 0.5)]},
        "longspec": {"d": [_record("tie", looped, [7] * 16, 0.1), _record("ok", _real(64), [1] * 32, 0.5)]},
    }
    spec = summarise(methods, greedy=True)["d"]["longspec"]
    assert spec["quality"]["tie"]["degenerate"] and spec["quality"]["tie"]["judged_on"] == "longspec"
    assert not spec["quality"]["ok"]["degenerate"] and spec["quality"]["ok"]["judged_on"] == "ar"
    assert spec["num_degenerate"] == 1 and spec["num_samples"] == 1
