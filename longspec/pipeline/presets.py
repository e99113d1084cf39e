"""Pipeline presets: the typed schema (`PipelineConfig`) of what the end-to-end run varies between machines.

The presets themselves are YAML files shipped with the package, configs/pipeline/<name>.yaml (each headed by
the command that launches it and explaining its numbers), composed by Hydra through the same
`longspec.config.compose` as the training and eval configs:

    python -m longspec.pipeline --preset cpu --out DIR stage1.train.max_steps=5 eval_max_samples=1

Overrides are Hydra override strings (`--set FIELD=VALUE` is an alias that adds one to the same list); an unknown
field or a bad value is one ValueError. `longspec.pipeline.plan` turns the validated config into the CLI steps.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field

from omegaconf import MISSING

from longspec.cli import one_line
from longspec.config import Schema, check, compose, config_root
from longspec.infer.methods import ALL_METHODS
from longspec.pipeline.stages import MOVED_KEYS, PIPELINE_SET, StagePlan, check_group
from longspec.target_source import PACKAGE_SCHEME, resolve_package_file
from longspec.train.config import load_config

__all__ = [
    "CODE_TARGET", "PIPELINE_SET", "StagePlan", "EvalPlan", "PipelineConfig", "preset_names", "load_preset",
    "target_overrides",
]  # fmt: skip

# The shipped code target's directory (the cpu preset names it portably: pkg://longspec/assets/code_target).
CODE_TARGET = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "code_target"
)
PRESET_GROUP = "pipeline"  # configs/pipeline/<preset>.yaml


@dataclass(kw_only=True)
class EvalPlan(Schema):
    """One `python -m longspec.eval` run."""

    name: str = ""  # output subdirectory OUT/eval_<name> (OUT/eval when empty)
    methods: list[str] = (
        MISSING  # decoding methods measured side by side (longspec.infer.methods.ALL_METHODS)
    )
    temperature: float = 0.0  # 0 = greedy, lossless-checked against the target's greedy output
    max_samples: int | None = None  # samples per data source; null: the preset's eval_max_samples
    extra: list[str] = field(default_factory=list)  # further eval overrides (cuda_graphs=true, ...)
    # the preset's eval_suite files this run reads ([]: all). One run per context bucket keeps each run short
    # enough for a time-limited job: a run that finished is skipped when the pipeline is run again.
    suite: list[str] = field(default_factory=list)
    required: bool = True  # a failed optional run is reported but does not stop the pipeline

    RANGES = {"temperature": ">= 0", "max_samples": ">= 1"}

    def validate(self) -> None:
        check(bool(self.methods), f"eval plan {self.name!r}: methods must name at least one method")
        unknown = [m for m in self.methods if m not in ALL_METHODS]
        check(not unknown, f"eval plan {self.name!r}: unknown method(s) {unknown}; choose from {ALL_METHODS}")
        check_ranges(self, f"eval plan {self.name!r}: ")


@dataclass(kw_only=True)
class PipelineConfig(Schema):
    """Everything the pipeline varies between machines (one preset YAML, plus the command line's overrides)."""

    name: str = MISSING  # the preset's name (the YAML's file name): report title and run-record key
    # The target: target_path, or target_gguf, or (both null) target_config's own model.
    # (`target_path`, not `target`: that is the training / eval configs' target group, which Hydra would load.)
    target_config: str = (
        "tiny_llama"  # the target YAML (configs/target/) train / eval compose; tiny_llama: any dir
    )
    target_path: str | None = (
        None  # the target's HF directory, or pkg://PACKAGE/DIR inside an installed package
    )
    # a GGUF file de-quantized once into OUT/target (python -m longspec.convert_gguf) that every step then loads
    target_gguf: str | None = None
    target_dtype: str = "float32"  # the converted target's stored dtype (training and eval pick their own)
    # MAX_LEN of stage-1 anchor-offset positions (training's stage.anchor_max_len); null: derived from the
    # target's context (longspec.positions.default_max_len)
    anchor_max_len: int | None = None
    lcc_max_context_chars: int = MISSING  # longest LCC context the corpus builder writes (eval prompt length)
    num_procs: int = MISSING  # training processes (torchrun --nproc_per_node)
    cpu: bool = MISSING  # DeepSpeed on CPU (DS_ACCELERATOR=cpu, gloo)
    window: int = MISSING  # drafter sliding window (tokens before each token it self-attends to)
    distill_weight: float = (
        0.0  # KL(target || drafter) added to the CE in every stage (0 = the paper's CE only)
    )
    # a reduced draft vocabulary of this many ids (docs/ALGORITHM.md §3.6), chosen in stage 1 from the token counts
    # of the stage-1 and stage-3 data and kept by the later stages; null: the target's whole vocabulary
    draft_vocab_size: int | None = None
    stage1_max_rows: int | None = MISSING  # source documents read for stage 1 (null: the whole train split)
    stage2_max_rows: int | None = MISSING  # the same for stage 2
    stage2_min_tokens: int = MISSING  # stage-2 documents shorter than this are rejected
    stage1: StagePlan = MISSING
    stage2: StagePlan = MISSING
    stage3: StagePlan = MISSING
    # Data sources (a file, directory or HF dataset id; a relative path is inside --data when given). null / []:
    # corpus/train.jsonl, the stdlib corpus built in OUT/corpus (or found in --data)
    stage1_source: str | None = None  # short documents for stage 1 (packed rows)
    stage2_sources: list[str] = field(default_factory=list)  # long documents for stage 2 (JSONL with "text")
    stage3_source: str | None = None  # SFT rows {context, prompt, response}; null: the target answers prompts
    stage3_prompts: str | None = (
        None  # stage-3 instruction prompts in --data (null: code prefixes of the corpus)
    )
    stage3_template: str = "plain"  # how prompts are rendered for the target: plain text or its chat template
    eval_suite: list[str] = field(default_factory=list)  # evaluation JSONL files in --data instead of LCC
    num_prompts: int = MISSING  # stage-3 prompts: code prefixes of this many training files
    prompt_chars: int = MISSING  # longest prefix (characters, cut at a line end)
    regen_max_new_tokens: int = MISSING  # the target's continuation of each prefix (the stage-3 response)
    regen_batch_size: int = MISSING  # prompts per target generate() call
    evals: list[EvalPlan] = MISSING  # the evaluation runs, most important first ([]: train and export only)
    eval_max_new_tokens: int = MISSING  # tokens generated per evaluation sample
    eval_max_samples: int = MISSING  # per data source
    eval_min_prompt_tokens: int = MISSING  # shorter LCC prompts are skipped
    eval_context_len: int | None = (
        None  # the suite's longest prompt + generation (null: the target's context)
    )
    # [] = the eval's default, tree=auto (the tree, or no speculation, picked each round); widths fix the tree
    tree_widths: list[int] = field(default_factory=list)
    # An exported drafter (a directory with config.json) to evaluate instead of training one: the plan keeps only
    # the corpus (when the evaluation reads it), the target's conversion and the evaluations.
    drafter_path: str | None = None

    # 0 = unused in lcc_max_context_chars (no corpus built: plan checks it when it is), num_prompts, prompt_chars
    # and regen_max_new_tokens (stage-3 rows given: validate checks them when the target answers prompts)
    RANGES = {
        "anchor_max_len": ">= 1",
        "lcc_max_context_chars": ">= 0",
        "num_procs": ">= 1",
        "window": ">= 1",
        "distill_weight": ">= 0",
        "draft_vocab_size": ">= 1",
        "stage1_max_rows": ">= 1",
        "stage2_max_rows": ">= 1",
        "stage2_min_tokens": ">= 1",
        "num_prompts": ">= 0",
        "prompt_chars": ">= 0",
        "regen_max_new_tokens": ">= 0",
        "regen_batch_size": ">= 1",
        "eval_max_new_tokens": ">= 1",
        "eval_max_samples": ">= 1",
        "eval_min_prompt_tokens": ">= 0",
        "eval_context_len": ">= 1",
    }

    def validate(self) -> None:
        check(
            self.target_path is None or self.target_gguf is None,
            "a pipeline preset takes one of target_path= (a model dir) and target_gguf= (or neither: target_config)",
        )
        check_group("target", self.target_config, "target_config")  # as the stage names (StagePlan)
        check_ranges(self)
        check(
            self.stage3_template in ("plain", "chat"),
            f"stage3_template must be plain or chat, got {self.stage3_template!r}",
        )
        check(
            self.stage3_source is not None or (self.num_prompts >= 1 and self.regen_max_new_tokens >= 1),
            "no stage-3 data: set stage3_source=FILE (SFT rows), or num_prompts and regen_max_new_tokens >= 1 for "
            "the target to write the answers",
        )
        check(
            self.stage3_source is not None or self.stage3_prompts is not None or self.prompt_chars >= 1,
            f"prompt_chars must be >= 1 when the stage-3 prompts are cut from the corpus, got {self.prompt_chars}",
        )
        names = [ev.name for ev in self.evals]
        check(len(set(names)) == len(names), f"eval plan names must differ, got {names}")
        for ev in self.evals:
            unknown = [name for name in ev.suite if name not in self.eval_suite]
            check(not unknown, f"eval plan {ev.name!r}: suite file(s) {unknown} are not in eval_suite")
        check(all(w >= 1 for w in self.tree_widths), f"tree_widths must be positive, got {self.tree_widths}")
        check(
            self.drafter_path is None or os.path.isfile(os.path.join(self.drafter_path, "config.json")),
            f"drafter_path={self.drafter_path}: no exported drafter there (no config.json)",
        )
        if self.target_path is not None and self.target_path.startswith(PACKAGE_SCHEME):
            self.target_dir()  # a missing package directory is one clear line now, not at the first step
        # Last: each stage's training config is composed (Hydra, tenths of a second); the rules above are cheap
        for index, stage in enumerate((self.stage1, self.stage2, self.stage3), 1):
            self.check_stage(f"stage{index}", stage)

    def check_stage(self, name: str, stage: StagePlan) -> None:
        """The stage's `train` tree (`StagePlan.check_train`), then its training config composed from the overrides
        its step will run (the paths the plan fills in stood in for) and validated by the trainer's own rules: a
        mistake is one line now, before any data is prepared."""
        stage.check_train(name)
        stand_in = "stage-run"  # no file is read: the paths' checks come at the step (preflight)
        target = self.target_dir() or os.path.basename(self.target_gguf or "target").removesuffix(".gguf")
        try:
            cfg = load_config(
                self.train_overrides(
                    stage,
                    target=target_overrides(self, target),
                    data_path=stand_in + "-data",
                    run_dir=stand_in,
                )
            )
        except ValueError as e:
            raise ValueError(f"{name}.train: {one_line(e)}") from None
        batch, micro = cfg.stage.global_batch_size, cfg.stage.micro_batch_size
        check(
            batch % (micro * self.num_procs) == 0,
            f"{name}.train: stage.global_batch_size ({batch}) must be a multiple of stage.micro_batch_size x "
            f"num_procs ({micro} x {self.num_procs})",
        )

    def train_overrides(
        self,
        stage: StagePlan,
        *,
        target: list[str],
        data_path: str,
        run_dir: str,
        init_from: str | None = None,
    ) -> list[str]:
        """The `python -m longspec.train` overrides of one stage: `target` (`target_overrides`, plus the draft
        vocabulary in stage 1), the stage's own (`StagePlan.overrides`), then what the pipeline sets for every
        stage (PIPELINE_SET)."""
        anchor = [] if self.anchor_max_len is None else [f"stage.anchor_max_len={self.anchor_max_len}"]
        # A stage that checkpoints as it goes continues a half-finished run of its own command from the latest
        # checkpoint; any other half-finished run restarts from scratch (plan's `_prepare_run_dir`).
        return [*target, *anchor, *stage.overrides(), f"drafter.window={self.window}",
                f"loss.distill_weight={self.distill_weight}", f"data.path={data_path}", f"output_dir={run_dir}",
                f"checkpoint.resume={'auto' if stage.resumable else 'never'}",
                *([f"init_from={init_from}"] if init_from else [])]  # fmt: skip

    @property
    def uses_corpus(self) -> bool:
        """Whether a step reads the stdlib corpus (built in OUT/corpus unless --data brings one)."""
        return (
            self.stage1_source is None
            or not self.stage2_sources
            or (self.stage3_source is None and self.stage3_prompts is None)
            or (bool(self.evals) and not self.eval_suite)
        )

    def target_dir(self) -> str | None:
        """The target's HF directory as an absolute path (pkg:// resolved); None when target_gguf is converted."""
        if self.target_path is None:
            return None
        if self.target_path.startswith(PACKAGE_SCHEME):
            try:  # the directory of a shipped model is the one that holds its config.json
                return os.path.dirname(resolve_package_file(self.target_path.rstrip("/") + "/config.json"))
            except FileNotFoundError as e:
                raise ValueError(f"target_path: {e}") from None
        return os.path.abspath(self.target_path)


def target_overrides(preset: PipelineConfig, target: str) -> list[str]:
    """Hydra overrides naming the target for `longspec.train` / `longspec.eval`."""
    overrides = [f"target={preset.target_config}"]
    if preset.target_path is not None or preset.target_gguf is not None:
        # the target group (tiny_llama: a generic HF directory) pointed at our model, no hub id involved
        overrides += [f"target.path={target}", f"target.name={os.path.basename(target.rstrip('/'))}"]
    return overrides


def check_ranges(schema, prefix: str = "") -> None:
    """Every field named in `schema.RANGES` ("FIELD": ">= 1" | "> 0") is null or a finite number in its range (a
    bool is no number). The ranges list every numeric field of the pipeline's schemas (tests/faults)."""
    for name, rule in schema.RANGES.items():
        value = getattr(schema, name)
        if value is None:
            continue
        op, bound = rule.split()
        ok = (
            isinstance(value, (int, float))
            and not isinstance(value, bool)
            and math.isfinite(value)
            and (value >= float(bound) if op == ">=" else value > float(bound))
        )
        check(ok, f"{prefix}{name} must be {rule}, got {value!r}")


def preset_names(config_dir: str | None = None) -> list[str]:
    """The presets shipped (configs/pipeline/*.yaml), sorted."""
    directory = os.path.join(config_dir or config_root(), PRESET_GROUP)
    return sorted(name[: -len(".yaml")] for name in os.listdir(directory) if name.endswith(".yaml"))


def load_preset(
    name: str, overrides: list[str] | None = None, *, config_dir: str | None = None
) -> PipelineConfig:
    """Compose configs/pipeline/<name>.yaml with Hydra overrides (`stage1.train.max_steps=5`) and validate it
    into a PipelineConfig; a bad override, unknown field or failed rule is a ValueError."""
    names = preset_names(config_dir)
    if name not in names:
        raise ValueError(f"unknown pipeline preset {name!r}; choose from {', '.join(names)}")
    return compose(
        PipelineConfig,
        schema_name="pipeline_schema",
        config_name=f"{PRESET_GROUP}/{name}",
        overrides=[_open_train_key(o) for o in overrides or []],
        config_dir=config_dir,
        what=f"pipeline preset {name!r}",
        moved=MOVED_KEYS,
    )


def _open_train_key(override: str) -> str:
    """`stageN.train.KEY=VALUE` as `++stageN.train.KEY=VALUE`: a training setting the preset does not set yet is
    added, as on the trainer's own command line (`train` is an open tree, checked against TrainConfig once
    composed)."""
    if re.match(r"stage[123]\.train\.[^=]*=", override):
        return "++" + override
    return override
