"""benchmarks/policy_replay.py: tree=auto's policy replayed over an evaluation's recorded outputs, on a results.json
of the real schema (the byte tokenizer of a saved tiny target, a LongBench-schema JSONL)."""

import json
import random

import pytest

from longspec.eval.datasets import load_samples
from longspec.infer.candidates import AUTO_LOOKUPS, AUTO_TREES, DrafterTree, Lookup, Plain, parse
from longspec.infer.policy.shadow import ShadowReport
from longspec.target_source import load_tokenizer
from longspec.testing import save_tiny_target

# ms per round, the shapes of the SmolLM2 GPU tables: plain, the drafter's trees dearer, lookups a little dearer
COSTS_MS = {"ar": 1.0, "1": 1.4, "1-1": 1.6, "1-1-1-1": 2.0, "2-2-2": 2.1, "4-4-4": 2.3, "4-8-8-8": 2.5,
            "4-16-16-16": 2.7, "4-16-16-16-16": 2.9, "lookup2": 1.15, "lookup4": 1.16, "lookup8": 1.18,
            "lookup16": 1.2}  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return save_tiny_target("llama", tmp_path_factory.mktemp("tiny_llama"))


def _results(tmp_path, tokenizer_dir, outputs) -> tuple[str, list[list[int]]]:
    """A results.json of a tree=auto evaluation over a two-row JSONL, `outputs(prompt_ids) -> output_ids` per
    row; returns its path and the prompts."""
    rows = [
        {"_id": "doc", "context": "The committee met on Monday and agreed to ship the release. " * 6,
         "input": "Summarise.", "answers": ["x"], "dataset": "gov_report"},
        {"_id": "code", "context": "def add(a, b):\n    return a + b\n" * 4, "input": "", "answers": ["x"],
         "dataset": "lcc"},
    ]  # fmt: skip
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    samples, _ = load_samples(
        str(data), load_tokenizer(tokenizer_dir), context_len=4096, min_prompt_tokens=0, context_margin=0
    )
    records, ar = {}, {}  # per dataset, as the harness writes them
    for sample in samples:
        output = outputs(sample.prompt_ids)
        for method, speed in ((records, 300.0), (ar, 200.0)):
            method.setdefault(sample.dataset, []).append(
                {
                    "id": sample.id,
                    "prompt_len": sample.prompt_len,
                    "output_ids": output,
                    "tokens_per_s": speed,
                }
            )
    results = {
        "config": {"data": {"name": [str(data)], "context_len": 4096, "min_prompt_tokens": 0,
                            "context_margin": 0, "template": None}},
        "round_costs_s": {f"1024:{name}": ms / 1e3 for name, ms in COSTS_MS.items()},
        "methods": {"longspec": records, "ar": ar},
    }  # fmt: skip
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))
    return str(path), [s.prompt_ids for s in samples]


def _replay(load_benchmark, tmp_path, results, tokenizer_dir, profile, *extra) -> dict:
    script = load_benchmark("policy_replay")
    out = tmp_path / "replay.json"
    args = [results, "--tokenizer", tokenizer_dir, "--accept-profile", profile, "--seeds", "2"]
    assert script.main([*args, "--json", str(out), *extra]) == 0
    return json.loads(out.read_text())


def test_candidate_names_parse_back():
    for candidate in (*AUTO_TREES, *AUTO_LOOKUPS, Lookup(3, 5)):
        assert parse(candidate.name) == candidate
    for bad in ("lookup", "lookupx2", "lookup16x0", "4-0", "big", ""):
        with pytest.raises(ValueError, match="not a round shape"):
            parse(bad)


def test_a_text_that_quotes_its_prompt_is_replayed_on_lookup_chains(load_benchmark, tmp_path, tokenizer_dir):
    """Outputs that copy 120 tokens of their prompt: the lookups' outcomes come from the text (the shadow's
    draft against the output), so the policy runs long lookup chains and the replay is well above plain, once the
    shadow has been heard (as in the engine: as the quote goes on, a round late); the measured speedup is read
    from the two methods' records."""
    results, prompts = _results(tmp_path, tokenizer_dir, lambda prompt: prompt[10:130])
    replay = _replay(load_benchmark, tmp_path, results, tokenizer_dir, "0")
    for row in replay["samples"]:
        assert row["lookup_hit_rate"] > 0.8 and row["replayed_speedup"] > 3.0, row
        assert row["rounds"].get("lookup16", 0) >= 5, row
        assert row["measured_speedup"] == pytest.approx(1.5)
    # the first call's quote reaches the policy as it goes on: a plain round or two, not the 16 that hearing its
    # shadow once all 16 drafts had matched cost (the second call starts from what the first taught the policy)
    assert replay["samples"][0]["rounds"].get("ar", 0) <= 2
    assert replay["summary"]["tau"] > 4.0  # chains of 16 accepted along the quote


def test_new_text_and_a_useless_drafter_replay_near_plain(load_benchmark, tmp_path, tokenizer_dir):
    """Outputs of fresh tokens (bytes no prompt holds, in a random order) and a drafter that accepts nothing:
    the policy decodes plain in most rounds and loses at most its explorations' share; lookup16 every round
    (`--fixed`, the reference) loses more."""
    rng = random.Random(0)

    def fresh(prompt):
        unused = sorted(set(range(3, 256)) - set(prompt))
        return [rng.choice(unused) for _ in range(200)]

    results, _ = _results(tmp_path, tokenizer_dir, fresh)
    replay = _replay(load_benchmark, tmp_path, results, tokenizer_dir, "0", "--fixed", "lookup16")
    for row in replay["samples"]:
        assert 0.9 <= row["replayed_speedup"] <= 1.0, row
        assert row["rounds"]["ar"] >= 0.8 * sum(row["rounds"].values()), row
        # the reference: a lookup chain every round pays its verify and accepts next to nothing here
        assert row["fixed_speedup"] < 0.9 < row["replayed_speedup"], row
    assert replay["summary"]["fixed"] == "lookup16"
    assert 1.0 <= replay["summary"]["fixed_tau"] < 1.1  # fresh tokens: next to nothing accepted
    with pytest.raises(SystemExit, match="not a candidate the evaluation measured"):
        _replay(load_benchmark, tmp_path, results, tokenizer_dir, "0", "--fixed", "lookup5")


def test_a_prompt_the_tokenizer_does_not_reproduce_or_a_batched_run_is_refused(
    load_benchmark, tmp_path, tokenizer_dir
):
    results, _ = _results(tmp_path, tokenizer_dir, lambda prompt: prompt[:20])
    payload = json.loads(open(results).read())
    next(iter(payload["methods"]["longspec"].values()))[0]["prompt_len"] += 1
    with open(results, "w") as f:
        json.dump(payload, f)
    with pytest.raises(SystemExit, match="another tokenizer or data file"):
        load_benchmark("policy_replay").main(
            [results, "--tokenizer", tokenizer_dir, "--json", str(tmp_path / "x")]
        )
    payload["config"]["batch_size"] = (
        4  # a batched evaluation: its policy decided for a batch, not per sample
    )
    with open(results, "w") as f:
        json.dump(payload, f)
    with pytest.raises(SystemExit, match="batch_size=1"):
        load_benchmark("policy_replay").main(
            [results, "--tokenizer", tokenizer_dir, "--json", str(tmp_path / "y")]
        )


def test_the_replay_hears_the_engines_shadow_reports_a_round_late(load_benchmark):
    """As the engine: the replay runs the engine's `LookupShadow` next to the call (the prompt and the first
    token, then each round's tokens, a lookup round's ending the pending shadow) and hears its reports a round
    late: a quote decoded plain as it goes on (open), and closed at its mismatch; a drafter round after plain ones
    pays the catch-up."""
    replay = load_benchmark("policy_replay")
    heard, heard_at = [], []

    class Scripted:
        lookups = (Lookup(16),)

        def __init__(self, script):
            self.script = list(script)

        def choose(self, context_len):
            heard_at.append(len(heard))
            return self.script.pop(0) if self.script else Plain()

        def observe(self, widths, ranks, context_len=None):
            pass

        def observe_time(self, widths, context_len, seconds, *, switched=False):
            pass

        def observe_shadow(self, report):
            heard.append(report)

    class Costs:
        def cost(self, widths, context_len):
            return 1.0 if not widths.speculates else 2.0

    # the output's first token 1 roots a lookup that drafts 2, 3, 4, 6, ...: the output quotes 2, 3, 4, then 0
    prompt, output = [5, 1, 2, 3, 4, 6, 7, 8, 9], [1, 2, 3, 4, 0, 10, 11]
    outcomes = replay.lookup_outcomes(prompt, output, 16, 3)
    replay.replay_call(Scripted([]), random.Random(0), prompt, output, outcomes, [], Costs())
    assert heard == [
        ShadowReport((1,), 0, False),  # rounds 0-2 (one token each): the quote as it goes on
        ShadowReport((2,), 1, False),
        ShadowReport((3,), 2, False),
        ShadowReport((3,), 3, True),  # round 3: its mismatch
        ShadowReport(()),  # roots 0 and 10: never seen before, nothing to draft
        ShadowReport(()),
    ]
    assert heard_at == [0, 0, 1, 2, 3, 4]  # round j hears round j - 2; the last two after the call
    heard.clear()
    # a lookup round at root 2 (accepting 3, 4: the bonus 0) ends the shadow of root 1 without a close
    replay.replay_call(
        Scripted([Plain(), Lookup(16)]), random.Random(0), prompt, output, outcomes, [], Costs()
    )
    assert heard == [ShadowReport((1,), 0, False), ShadowReport(()), ShadowReport(())]

    class Chain(Scripted):
        def choose(self, context_len):
            self.calls = getattr(self, "calls", 0) + 1
            return Plain() if self.calls % 2 else DrafterTree((1,))

        def observe_time(self, widths, context_len, seconds, *, switched=False):
            timed.append((widths, seconds, switched))

    timed = []
    outcomes = replay.lookup_outcomes(prompt, output[:5], 16, 3)
    result = replay.replay_call(
        Chain([]), random.Random(0), prompt, output[:5], outcomes, [0.0], Costs(), catch_up_s=0.5
    )
    assert result["speedup"] == pytest.approx(4 / (1 + 2.5 + 1 + 2.5))
    # as the engine: every round's time but the call's first, the chain's with the catch-up flagged as a switch
    chain = DrafterTree((1,))
    assert timed == [(chain, 2.5, True), (Plain(), 1.0, False), (chain, 2.5, True)]
