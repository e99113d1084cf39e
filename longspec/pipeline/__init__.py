"""The pipeline layer, the top floor above train / infer / eval: corpus -> stage 1/2/3 data -> three training
stages -> export -> evaluation -> report, as a plan of the real CLI steps run by a resumable runner.

    python -m longspec.pipeline --preset cpu --out outputs/quickstart

- presets: the `PipelineConfig` schema (`StagePlan`, `EvalPlan`), `load_preset()`, which composes a preset YAML
  (configs/pipeline/) with Hydra overrides, and `target_overrides()` (the target for train / eval)
- plan: `Step`, `plan()` (a preset -> ordered steps), `stage_steps()` (one training stage),
  `eval_data_overrides()` (the eval's data as the preset evaluates it),
  `eval_runs_command()` (the evaluation steps as one `python -m longspec.eval.runs` process)
- runner: `run_pipeline()` and the run record that lets a rerun continue
- report: the evaluation table, training summary and OUT/report.md

This module is the public API that benchmarks/ablations builds its runs from.
"""

from longspec.pipeline.plan import Step, eval_data_overrides, plan, stage_steps
from longspec.pipeline.presets import (
    CODE_TARGET,
    EvalPlan,
    PipelineConfig,
    StagePlan,
    load_preset,
    preset_names,
    target_overrides,
)
from longspec.pipeline.report import eval_rows, results_table, write_report
from longspec.pipeline.runner import RUN_RECORD_NAME, RunRecord, run_pipeline

__all__ = [
    "CODE_TARGET",
    "RUN_RECORD_NAME",
    "EvalPlan",
    "PipelineConfig",
    "RunRecord",
    "StagePlan",
    "Step",
    "eval_data_overrides",
    "eval_rows",
    "load_preset",
    "plan",
    "preset_names",
    "results_table",
    "run_pipeline",
    "stage_steps",
    "target_overrides",
    "write_report",
]
