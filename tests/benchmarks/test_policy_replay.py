"""benchmarks/policy_replay.py: tree=auto's policy replayed over an evaluation's recorded outputs, on a results.json
of the real schema (the byte tokenizer of a saved tiny target, a LongBench-schema JSONL)."""

import json
import random

import pytest

from longspec.eval.datasets import load_samples
from longspec.infer.policy import AUTO_LOOKUPS, AUTO_TREES
from longspec.infer.tree import Lookup, parse_candidate, tree_name
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
        assert parse_candidate(tree_name(candidate)) == candidate
    for bad in ("lookup", "lookupx2", "lookup16x0", "4-0", "big", ""):
        with pytest.raises(ValueError, match="not a round shape"):
            parse_candidate(bad)


def test_a_text_that_quotes_its_prompt_is_replayed_on_lookup_chains(load_benchmark, tmp_path, tokenizer_dir):
    """Outputs that copy 120 tokens of their prompt: the lookups' outcomes come from the text (the shadow's
    draft against the output), so the policy runs long lookup chains and the replay is well above plain, once the
    shadow has been heard (as in the engine: when the text has decided it); the measured speedup is read from the
    two methods' records."""
    results, prompts = _results(tmp_path, tokenizer_dir, lambda prompt: prompt[10:130])
    replay = _replay(load_benchmark, tmp_path, results, tokenizer_dir, "0")
    for row in replay["samples"]:
        assert row["lookup_hit_rate"] > 0.8 and row["replayed_speedup"] > 3.0, row
        assert row["rounds"].get("lookup16", 0) >= 10, row
        assert row["measured_speedup"] == pytest.approx(1.5)
    # the first call's first 16 tokens decode plain: its shadow is heard once its 16 drafts have all matched (the
    # second call starts from what the first taught the policy)
    assert replay["samples"][0]["rounds"].get("ar", 0) >= 16
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


def test_replayed_shadow_reports_skip_the_roots_inside_a_matched_run(load_benchmark):
    """As the engine's `LookupShadow`: a plain round's root inside the run an earlier report's lookup would have
    accepted reports nothing, and a report is heard once the text has decided it (the token after its last
    matched draft), a round late; a drafter round after plain ones pays the catch-up."""
    replay = load_benchmark("policy_replay")
    heard = []

    class Plain:
        lookups = (Lookup(16),)

        def choose(self, context_len):
            return ()

        def observe(self, widths, ranks, context_len=None):
            pass

        def observe_shadow(self, matched):
            heard.append(list(matched))

    class Costs:
        def cost(self, widths, context_len):
            return 1.0 if not widths else 2.0

    # per position, the drafts a lookup there matches: a run of 3 from position 1, then nothing
    outcomes = [[0], [3], [2], [1], [0], [0]]
    heard_at = []
    Plain.choose = lambda self, context_len: heard_at.append(len(heard)) or ()
    replay.replay_call(Plain(), random.Random(0), 10, outcomes, [], Costs())
    # positions 0, 1, then 5: a lookup round at 1 would have emitted its 3 drafts and a bonus (positions 2-5)
    assert heard == [[0], [3], [0]]
    # root 0's miss is decided by round 0's token, heard at round 2; root 1's run of 3 by round 4's token (the
    # mismatch at position 5), heard at round 6 (after the last round: the call's last lessons)
    assert heard_at == [0, 0, 1, 1, 1, 1]
    heard.clear()  # a run of all 16 drafts is decided by its last one: the root right after it reports again
    replay.replay_call(Plain(), random.Random(0), 10, [[16]] + [[0]] * 17, [], Costs(), shadow_length=16)
    assert heard == [[16], [0], [0]]

    class Chain(Plain):
        def choose(self, context_len):
            self.calls = getattr(self, "calls", 0) + 1
            return () if self.calls % 2 else (1,)

    result = replay.replay_call(Chain(), random.Random(0), 10, [[0]] * 4, [0.0], Costs(), catch_up_s=0.5)
    assert result["speedup"] == pytest.approx(4 / (1 + 2.5 + 1 + 2.5))
