"""`python -m longspec.pipeline` validates every field before its first step: each bad value is one line, exit
status 2, in about a second, and nothing is written (a bad eval setting failed at the last step, after all the
preparation and training; `eval_max_samples=0`, `regen_batch_size=0`, `stage2_min_tokens=-5` and a missing
target were accepted).

The preset's own fields by their schema's ranges (presets.py `RANGES`, which must list every numeric field); each
stage's `train` settings by the trainer's own rules, on the config its step composes, when the preset loads; the
target's existence and every training / evaluation step's composed config by the pipeline's preflight."""

from __future__ import annotations

import dataclasses
import time

import pytest
from fault_helpers import assert_one_line_error, assert_only_changed, run_in_process, tree_checksums

from longspec.pipeline.__main__ import main
from longspec.pipeline.presets import EvalPlan, PipelineConfig, load_preset

# schema -> the override prefix that reaches an instance of it in the demo_tiny preset (a StagePlan's settings are
# the trainer's: its own schema checks them)
SCHEMAS = {PipelineConfig: "", EvalPlan: "evals.0."}
NUMERIC = ("int", "int | None", "float", "float | None")


def _out_of_range(rule: str) -> str:
    """A value just outside `rule` (">= 1" -> 0, "> 0" -> 0)."""
    op, bound = rule.split()
    return str(int(float(bound)) - 1) if op == ">=" else bound


RANGED = [
    pytest.param(prefix, name, rule, id=f"{prefix}{name}")
    for schema, prefix in SCHEMAS.items()
    for name, rule in schema.RANGES.items()
]


def test_every_numeric_field_has_a_range():
    for schema in SCHEMAS:
        numeric = {f.name for f in dataclasses.fields(schema) if f.type in NUMERIC}
        assert numeric == set(schema.RANGES), (
            f"{schema.__name__}: fields without a range or ranges without a field"
        )


@pytest.mark.parametrize("prefix, name, rule", RANGED)
def test_a_value_outside_a_fields_range_is_refused(prefix, name, rule):
    override = f"{prefix}{name}={_out_of_range(rule)}"
    with pytest.raises(ValueError, match=rf"{name} must be {rule}, got "):
        load_preset("demo_tiny", [override])


@pytest.mark.parametrize(
    "override", ["stage1.train.optim.lr=nan", "distill_weight=inf", "evals.0.temperature=nan"]
)
def test_a_non_finite_number_is_refused(override):
    name = override.split("=")[0].split(".")[-1]
    with pytest.raises(ValueError, match=rf"{name} must be .*, got (nan|inf)"):
        load_preset("demo_tiny", [override])


# (override, the error line): the five first; every one fails before any step, from the real CLI
SCHEMA_CASES = [
    ("eval_max_new_tokens=0", r"eval_max_new_tokens must be >= 1, got 0"),
    ("eval_max_samples=0", r"eval_max_samples must be >= 1, got 0"),
    ("regen_batch_size=0", r"regen_batch_size must be >= 1, got 0"),
    ("stage2_min_tokens=-5", r"stage2_min_tokens must be >= 1, got -5"),
    ("prompt_chars=0", r"prompt_chars must be >= 1 when the stage-3 prompts are cut from the corpus, got 0"),
    ("lcc_max_context_chars=0", r"lcc_max_context_chars must be >= 1 when the corpus is built \(no --data\)"),
]
PLAN_CASES = [
    (
        "target_path=/nonexistent",
        r"target_path='/nonexistent': target model directory '/nonexistent' does not exist",
    ),
    ("target_path={empty}", r"target_path='.*empty' holds no config.json: not a model directory"),
    (
        "target_gguf=/no/model.gguf",
        r"target_gguf='/no/model.gguf': GGUF file '/no/model.gguf' does not exist",
    ),
    # a stage's training settings: the trainer's rules, when the preset loads
    ("stage1.train.optim.weight_decay=-1", r"stage1.train: optim.weight_decay must be >= 0, got -1"),
    (
        "stage2.train.stage.micro_batch_size=3",
        r"stage2.train: stage.global_batch_size \(8\) must be a multiple",
    ),
    ("stage3.train.optim.lrr=1", r"stage3.train.optim.lrr is not a training setting"),
    ("evals.0.extra=['top_p=2']", r"step eval: top_p must be in \(0, 1\], got 2"),
    ("evals.0.extra=['max_new_tokens=0']", r"step eval: max_new_tokens must be >= 1, got 0"),
]


def _refused(tmp_path, capsys, override: str, pattern: str) -> float:
    """Run the pipeline with `override` -> the CPU seconds it took to refuse it (exit 2, one line, no change)."""
    (tmp_path / "empty").mkdir()
    overrides = [o.format(empty=tmp_path / "empty") for o in override.split()]
    if any(o.startswith("target_gguf=") for o in overrides):
        overrides.insert(0, "target_path=null")  # one target at a time
    before = tree_checksums(tmp_path)
    start = time.process_time()  # this process's CPU: a shared machine's load does not count
    status, err = run_in_process(
        main, ["--preset", "demo_tiny", "--out", str(tmp_path / "out"), *overrides], capsys
    )
    seconds = time.process_time() - start
    assert status == 2
    assert_one_line_error(err, pattern)
    assert_only_changed(tmp_path, before)  # no --out, no step ran
    return seconds


@pytest.mark.parametrize("override, pattern", SCHEMA_CASES, ids=[c[0] for c in SCHEMA_CASES])
def test_a_bad_preset_field_is_refused_in_a_second(tmp_path, capsys, override, pattern):
    assert _refused(tmp_path, capsys, override, pattern) < 1.0


@pytest.mark.parametrize("override, pattern", PLAN_CASES, ids=[c[0] for c in PLAN_CASES])
def test_a_bad_target_or_step_setting_is_refused_before_the_first_step(tmp_path, capsys, override, pattern):
    # The steps' configs are composed as each step composes its own (Hydra, a few tenths of a second each)
    assert _refused(tmp_path, capsys, override, pattern) < 5.0
