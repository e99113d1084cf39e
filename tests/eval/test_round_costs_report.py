from longspec.eval.report import round_costs_markdown


def test_round_costs_per_bucket_in_plain_steps_with_a_draft_vocabulary():
    results = {
        "round_costs_s": {
            "512:ar": 0.002,
            "512:1": 0.0025,
            "512:4-16": 0.004,
            "512:lookup8": 0.0021,
            "4096:ar": 0.004,
            "4096:1": 0.006,
            "4096:2-2-2": 0.007,
            "4096:4-16": 0.010,
        },
        "draft_vocab": {"size": 16384, "target_vocab": 49152},
    }
    lines = round_costs_markdown(results)
    assert (
        lines[1]
        == "## Round costs (measured before decoding; the drafter drafts over 16,384 of the target's 49,152 ids)"
    )
    assert lines[-2:] == [
        "| 512 | 2.000 | 2.500 | 1.25 | `4-16` | 4.000 | 2.00 |",  # a lookup is not a drafter tree
        "| 4096 | 4.000 | 6.000 | 1.50 | `4-16` | 10.000 | 2.50 |",
    ]


def test_no_section_without_the_two_rounds_it_compares():
    assert round_costs_markdown({}) == []
    assert round_costs_markdown({"round_costs_s": {"512:ar": 0.002, "512:lookup8": 0.003}}) == []
