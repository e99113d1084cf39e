import json
import os

import pytest

from longspec.drafter import Drafter, DrafterConfig
from longspec.eval.__main__ import main, run_eval
from longspec.eval.config import load_eval_config
from longspec.infer.candidates import DrafterTree, Lookup
from longspec.testing import make_tiny_target


def test_eval_cli_end_to_end(eval_overrides, tmp_path):
    out = tmp_path / "out"
    code = main(eval_overrides(out, "method=[longspec,vanilla_fa,ar,pld]"))
    assert code == 0
    for name in ("results.json", "report.md", "accept_length_by_context.png", "tokens_per_s_by_context.png"):
        assert (out / name).stat().st_size > 0, name
    results = json.loads((out / "results.json").read_text())

    (data_report,) = results["data"]
    assert data_report["num_kept"] == 2 and data_report["num_malformed"] == 3
    assert [m["line"] for m in data_report["malformed"]] == [3, 4, 6]

    summary = results["summary"]["rows"]
    assert set(summary) == {"longspec", "vanilla_fa", "ar", "pld"}
    for method, agg in summary.items():
        assert agg["identical_to_greedy"] == 1.0, method  # lossless, random drafter included
        assert agg["tokens_per_s"] > 0
        assert set(agg["speedup"]) == {"vanilla_fa", "ar", "pld"} - {method}
    assert summary["ar"]["mean_accept_length"] == 1.0
    assert summary["longspec"]["mean_accept_length"] >= 1.0

    samples = results["methods"]["longspec"]["rows"]
    assert [s["id"] for s in samples] == ["code-0", "meet-1"]
    for s in samples:
        assert len(s["output_ids"]) == 10 or s["output_ids"][-1] == 257  # max_new_tokens or EOS
        assert s["rounds"] == len(s["accepted"]) >= 1 and s["prompt_len"] > 0

    report = (out / "report.md").read_text()
    assert "| longspec |" in report and "rows τ" in report and "3 malformed" in report
    # tree=auto (the default): costs measured at warm-up, the trees that ran counted and reported
    assert (
        results["round_costs_s"]
        and sum(summary["longspec"]["trees"].values()) == summary["longspec"]["rounds"]
    )
    assert "## Trees run" in report and "- rows / longspec: `" in report
    # and what drafting costs here: the chain of one and the largest tree against a plain step, per bucket
    assert results["draft_vocab"]["size"] == results["draft_vocab"]["target_vocab"]
    assert "## Round costs (measured before decoding; the drafter drafts over the target's whole" in report
    plain, chain = (results["round_costs_s"][f"{min_bucket(results)}:{n}"] for n in ("ar", "1"))
    assert f"| {plain * 1e3:.3f} | {chain * 1e3:.3f} | {chain / plain:.2f} | `4-16-16-16-16` |" in report
    # and what the policy believed at the end, per candidate (the samples' and the summary's last)
    assert samples[-1]["policy"]["ar"]["expected_tokens"] == 1.0
    assert summary["longspec"]["policy"] == samples[-1]["policy"]
    assert (
        "; the policy's view at the end: plain decoding " in report
        and "its best speculating round `" in report
    )
    # where the run's time went, phase by phase
    assert list(results["phases_s"]) == ["data", "load", "warm_up", "samples"]
    phases = results["phases_s"]
    assert all(seconds >= 0 for seconds in phases.values()) and phases["samples"] > 0


def min_bucket(results: dict) -> int:
    return min(int(key.split(":")[0]) for key in results["round_costs_s"])


def test_single_method_and_sampling(eval_overrides, tmp_path):
    cfg = load_eval_config(
        eval_overrides(
            tmp_path / "out",
            "method=longspec",
            "temperature=0.8",
            "top_p=0.9",
            "max_samples=1",
            "warmup=false",
        )
    )
    results = run_eval(cfg)
    agg = results["summary"]["rows"]["longspec"]
    assert agg["num_samples"] == 1 and agg["identical_to_greedy"] is None  # no greedy check when sampling


def test_mismatched_drafter_is_one_clear_error(eval_overrides, tmp_path, caplog):
    other = make_tiny_target("qwen2")
    drafter = Drafter(
        DrafterConfig.from_target_config(other.config, window=8), other.embed_tokens, other.lm_head
    )
    drafter.save_pretrained(tmp_path / "drafter")
    overrides = eval_overrides(tmp_path / "out", "method=longspec")
    overrides = [o for o in overrides if not o.startswith("drafter.")] + [
        f"drafter.path={tmp_path / 'drafter'}"
    ]
    with pytest.raises(ValueError, match="does not match this target"):
        run_eval(load_eval_config(overrides))
    assert main(overrides) == 2  # the CLI: one logged error line, exit code 2, no results
    assert not os.path.exists(tmp_path / "out" / "results.json")


@pytest.mark.parametrize(
    "extra, error",
    [
        (["method=medusa"], ValueError),
        (["method=longspec", "drafter.init=pretrained"], ValueError),  # no drafter.path
        (["drafter.path=/nonexistent", "drafter.init=pretrained", "method=longspec"], FileNotFoundError),
        (["data.path=/nonexistent.jsonl"], FileNotFoundError),
        (["temperature=-1"], ValueError),
        (["timing_repeats=0"], ValueError),
        (["tree=lookup16x0"], ValueError),
        (["tree=big"], ValueError),
        (["method=[]"], ValueError),  # was a ZeroDivisionError in the timing loop
        (["device=tpu"], ValueError),  # was torch's RuntimeError traceback
        (["device=cuda:x"], ValueError),
    ],
)
def test_config_errors(eval_overrides, tmp_path, extra, error):
    with pytest.raises(error):
        load_eval_config(eval_overrides(tmp_path) + extra)


def test_a_gpu_the_machine_lacks_is_one_error_line(eval_overrides, tmp_path, monkeypatch, capsys):
    """device=cuda where torch sees no GPU (a CPU build, a node without one) was torch's AssertionError
    traceback after the data had been read; device=cuda:N past the GPUs it has, a traceback at load."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(eval_overrides(tmp_path / "out", "device=cuda")) == 2
    assert "no usable CUDA GPU" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match="has 2 CUDA GPU"):
        load_eval_config(eval_overrides(tmp_path, "device=cuda:2"))
    assert load_eval_config(eval_overrides(tmp_path, "device=cuda:1")).device == "cuda:1"
    assert not (tmp_path / "out").exists()


def test_tree_may_name_one_round_shape(eval_overrides, tmp_path):
    """tree=lookup16x4 (a lookup forest every round) or tree=4-16-16: checked at load, run as the fixed round."""
    for name, fixed in (("lookup16x4", Lookup(16, 4)), ("4-16-16", DrafterTree((4, 16, 16))), ("auto", None)):
        cfg = load_eval_config(eval_overrides(tmp_path) + [f"tree={name}"])
        assert cfg.generation_config(eos_token_ids=()).fixed_tree == fixed


def test_data_path_may_name_a_dataset(eval_overrides, tmp_path):
    cfg = load_eval_config(eval_overrides(tmp_path, data="lcc"))
    assert cfg.data.sources == ["lcc"]
    cfg = load_eval_config(
        ["target=tiny_llama", "target.path=x", "data.name=[gov_report,aime24]", "method=ar"]
    )
    assert cfg.data.sources == ["gov_report", "aime24"] and cfg.methods == ["ar"]


def test_math_preset_composes():
    cfg = load_eval_config(["drafter.init=random"], config_name="eval/math_qwq")
    assert cfg.target.name == "qwq_32b" and cfg.generation.max_new_tokens == 32768
    assert cfg.data.sources == ["aime24", "amc", "math500", "minerva_math"]


def test_results_json_is_strict_json(eval_overrides, tmp_path):
    """One new token: no decode phase, τ and tokens/s undefined -> null, never NaN."""
    overrides = eval_overrides(tmp_path / "out", "method=ar", "warmup=false")
    run_eval(load_eval_config([o for o in overrides if not o.startswith("max_new")] + ["max_new_tokens=1"]))

    def reject(constant):
        raise AssertionError(f"non-standard JSON constant {constant}")

    results = json.loads((tmp_path / "out" / "results.json").read_text(), parse_constant=reject)
    assert results["summary"]["rows"]["ar"]["tokens_per_s"] is None


def test_a_longrope_target_needs_each_batch_on_one_side_of_its_original_context(eval_overrides, tmp_path):
    """LongRoPE switches factors at its original context (32 here): a sample that would cross it while
    generating, or a batch with prompts on both sides, is refused before any generation; prompts above it run."""
    from types import SimpleNamespace

    from longspec.cli import UserError
    from longspec.eval import harness
    from longspec.testing import tiny_hf_config

    hf_config = tiny_hf_config(
        "llama",
        max_position_embeddings=128,
        rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 8,
                         "long_factor": [4.0] * 8, "original_max_position_embeddings": 32},
    )  # fmt: skip

    def check(lengths, batch_size=1):
        cfg = load_eval_config(eval_overrides(tmp_path, "max_new_tokens=10", f"batch_size={batch_size}"))
        samples = [SimpleNamespace(prompt_len=n) for n in lengths]
        harness._check_positions(cfg, hf_config, [("rows", samples)])

    check([22, 40, 100])  # each alone: within (22 + 10 <= 32) or above
    with pytest.raises(UserError, match="cross this target's original context"):
        check([23])
    with pytest.raises(UserError, match="cross this target's original context"):
        check([22, 40], batch_size=2)


def test_an_unsupported_family_is_refused_first(eval_overrides, tmp_path, capsys):
    """A GPT-2 target (a 64-position context, which the default data.context_margin=2000 does not fit) is
    refused for its family, before the data checks: its first error used to be about data.context_margin."""
    from transformers import GPT2Config

    from longspec.testing import build_byte_tokenizer

    GPT2Config(vocab_size=300, n_positions=64, n_embd=32, n_layer=1, n_head=2).save_pretrained(
        tmp_path / "gpt2"
    )
    build_byte_tokenizer().save_pretrained(tmp_path / "gpt2")
    overrides = [o for o in eval_overrides(tmp_path / "out") if not o.startswith("target.path")]
    assert main([*overrides, f"target.path={tmp_path / 'gpt2'}", "data.context_margin=2000"]) == 2
    assert "unsupported target model_type 'gpt2'" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_decode_settings_are_the_nested_generation_config_by_flat_or_full_name():
    """The eval config nests the engine's GenerationConfig (one schema of decode settings); a flat override names
    its field (the names users know), the full one too, and one setting given both ways is refused."""
    from longspec.infer.config import GenerationConfig

    base = ["drafter.init=random"]
    flat = load_eval_config([*base, "temperature=1", "tree_widths=[4,16,16,16,16]", "seed=3", "+top_k=5"])
    full = load_eval_config(
        [*base, "generation.temperature=1", "generation.tree_widths=[4,16,16,16,16]", "generation.seed=3",
         "generation.top_k=5"]
    )  # fmt: skip
    assert isinstance(flat.generation, GenerationConfig) and flat.generation == full.generation
    got = flat.generation
    assert (got.temperature, got.tree_widths, got.top_k) == (1.0, (4, 16, 16, 16, 16), 5)
    assert flat.generation.max_new_tokens == 1024  # eval.yaml's, over GenerationConfig's own default
    assert flat.generation_config(eos_token_ids=(7,)).eos_token_ids == (7,)
    with pytest.raises(ValueError, match=r"temperature given twice \(X= is generation.X=\)"):
        load_eval_config([*base, "temperature=1", "generation.temperature=0"])
    with pytest.raises(ValueError, match="eos_token_ids come from the target's tokenizer"):
        load_eval_config([*base, "generation.eos_token_ids=[1]"])
