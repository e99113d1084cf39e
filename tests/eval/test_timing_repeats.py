"""`timing_repeats`: interleaved timed runs per sample, the fastest kept; the tree policy restarts from the same
state in every repeat and continues as after one run."""

from types import SimpleNamespace

import pytest
import torch

from longspec.drafter import Drafter, DrafterConfig
from longspec.eval import sample_runs
from longspec.eval.config import load_eval_config
from longspec.eval.harness import run_eval
from longspec.infer.engine import GenerationConfig, SpeculativeEngine
from longspec.testing import make_tiny_target


def test_repeats_keep_the_fastest_run_and_change_no_output(eval_overrides, tmp_path):
    common = [*eval_overrides(None), "method=[longspec,ar,pld]"]
    once = run_eval(load_eval_config([*common, f"output_dir={tmp_path / 'once'}"]))
    thrice = run_eval(load_eval_config([*common, "timing_repeats=3", f"output_dir={tmp_path / 'thrice'}"]))
    for method, per_dataset in thrice["methods"].items():
        for record, single in zip(per_dataset["rows"], once["methods"][method]["rows"], strict=True):
            assert record["output_ids"] == single["output_ids"], method  # T=0: the greedy output every run
            runs = record["timing_runs"]
            assert len(runs) == 3 and record["decode_s"] == min(run["decode_s"] for run in runs)
            assert record["tokens_per_s"] in [run["tokens_per_s"] for run in runs]
        assert "timing_runs" not in once["methods"][method]["rows"][0]
    assert thrice["summary"]["rows"]["longspec"]["identical_to_greedy"] == 1.0
    report = (tmp_path / "thrice" / "report.md").read_text()
    assert (
        "## Timing (3 interleaved runs per sample, the fastest kept)" in report
        and "- pld: a sample's" in report
    )
    assert "## Timing" not in (tmp_path / "once" / "report.md").read_text()


class _Spy:
    """An engine stand-in that records the policy-state calls between runs."""

    def __init__(self):
        self.events, self.state = [], 0

    def policy_state(self):
        self.events.append(("save", self.state))
        return self.state

    def restore_policies(self, state):
        self.events.append(("restore", state))
        self.state = state


def test_repeats_rotate_the_methods_and_restart_the_policy(monkeypatch):
    spy, calls = _Spy(), []

    def generate(method, samples, config, batch_size, *, target, engine):
        calls.append(method)
        engine.state += method == "longspec"  # what a run teaches the policy: only longspec's rounds do
        seconds = {"longspec": 3.0, "ar": 2.0, "pld": 1.0}[method] + len(calls) / 100
        return [
            {"decode_s": seconds, "tokens_per_s": 1 / seconds, "mean_accept_length": 1.0, "run": len(calls)}
        ]

    monkeypatch.setattr(sample_runs, "generate", generate)
    cfg = SimpleNamespace(timing_repeats=3, batch_size=1)
    methods = ["longspec", "ar", "pld"]
    kept = sample_runs.timed_runs(methods, [object()], None, cfg, target=None, engine=spy)
    # no method always first after a new prompt
    assert calls == ["longspec", "ar", "pld", "ar", "pld", "longspec", "pld", "longspec", "ar"]
    # the first repeat starts from state 0 and leaves 1; longspec's later runs start from 0 again; then back to 1
    restores = [state for kind, state in spy.events if kind == "restore"]
    assert restores == [0, 0, 1] and spy.state == 1
    assert [kept[m][0]["run"] for m in methods] == [1, 2, 3]  # each method's fastest: its first run here


def test_policy_state_restores_what_was_learned_and_shares_the_cost_tables():
    torch.manual_seed(0)
    target = make_tiny_target("llama")
    drafter = Drafter(
        DrafterConfig.from_target_config(target.config, window=8), target.embed_tokens, target.lm_head
    )
    engine = SpeculativeEngine(target, drafter.eval().requires_grad_(False))
    config = GenerationConfig(max_new_tokens=12)
    prompt = torch.randint(0, target.vocab_size, (40,))
    engine.generate(prompt, config)
    state = engine.policy_state()
    (key,) = engine.policies

    def learned():  # what rounds teach: the round times (and, where it speculated, acceptance per depth)
        policy = engine.policies[key]
        return policy.costs._observations, [list(row) for row in policy.acceptance.trials]

    before = learned()
    assert before[0] > 0
    engine.generate(torch.randint(0, target.vocab_size, (40,)), config)
    assert learned() != before  # the second call taught it something
    engine.restore_policies(state)
    assert learned() == before
    (table,) = engine.cost_tables.values()
    assert engine.policies[key].costs.base is table  # the device's measured costs are not copied
    engine.restore_policies(state)  # `state` stays reusable
    assert learned() == before and engine.policies is not state


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
