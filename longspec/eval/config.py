"""Typed schema of `python -m longspec.eval` (composed by Hydra from configs/eval.yaml, converted once in
main).

    python -m longspec.eval target=llama31_8b drafter.path=runs/llama31_8b/export data.name=gov_report \
        method=[longspec,vanilla_fa,pld] output_dir=outputs/eval/llama31_8b

The `target` group is the training configs' (configs/target/*.yaml, schema longspec.config.TargetConfig).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from longspec.config import Schema, TargetConfig, check, compose, drafter_window
from longspec.eval.datasets import KNOWN_DATASETS
from longspec.eval.summary import MAX_TIMING_SPREAD
from longspec.infer.config import GenerationConfig
from longspec.infer.methods import ALL_METHODS

__all__ = [
    "EvalConfig", "DrafterEvalConfig", "DataEvalConfig", "GENERATION_FIELDS", "load_eval_config", "nest_generation",
    "split_config_name",
]  # fmt: skip


@dataclass(kw_only=True)
class DrafterEvalConfig(Schema):
    """Which drafter the `longspec` method uses."""

    path: str | None = None  # directory written by Drafter.save_pretrained / longspec.export
    init: str = "pretrained"  # pretrained (load `path`) | random (no training: lossless still, τ ~ 1)
    # ring-buffer window: a random drafter's (None: longspec.drafter.DEFAULT_WINDOW); a loaded drafter keeps the
    # window it was trained with, so a value given with `path` must agree with it (an error, not silently ignored)
    window: int | None = None
    seed: int = 0  # random init seed

    def validate(self) -> None:
        check(
            self.init in ("pretrained", "random"),
            f"drafter.init must be pretrained or random, got {self.init!r}",
        )
        saved = self.path if self.init == "pretrained" else None
        drafter_window(self.window, saved, field="drafter.window")  # checks it agrees with a loaded drafter

    @property
    def random_window(self) -> int:
        """The window of a random drafter (drafter.init=random)."""
        return drafter_window(self.window, None, field="drafter.window")


@dataclass(kw_only=True)
class DataEvalConfig(Schema):
    """What to evaluate on. `path` wins over `name`; `path` may also be a dataset name."""

    name: Any = "gov_report"  # a LongBench task / math set, or a list of them: KNOWN_DATASETS
    path: str | None = None  # a local JSONL in LongBench's row schema (_id, context, input, answers, dataset)
    template: str | None = (
        None  # LongBench task whose prompt template formats JSONL rows (default: row's dataset)
    )
    min_prompt_tokens: int | None = None  # keep prompts longer than this (None: 1200 LongBench/JSONL, 0 math)
    context_margin: int = 2000  # and at most context_len - this many tokens (room to generate)
    context_len: int | None = None  # the target's context length (None: its max_position_embeddings)

    def validate(self) -> None:
        check(self.context_margin >= 0, f"data.context_margin must be >= 0, got {self.context_margin}")
        check(
            self.min_prompt_tokens is None or self.min_prompt_tokens >= 0,
            f"data.min_prompt_tokens must be >= 0, got {self.min_prompt_tokens}",
        )
        if self.context_len is not None:
            check(self.context_len >= 1, f"data.context_len must be >= 1, got {self.context_len}")
            check(
                self.context_margin < self.context_len,
                f"data.context_margin={self.context_margin} must be smaller than data.context_len="
                f"{self.context_len}: it is the room kept for generation",
            )
            check(
                (self.min_prompt_tokens or 0) < self.context_len - self.context_margin,
                f"no prompt length passes the filter {self.min_prompt_tokens} < tokens <= "
                f"{self.context_len - self.context_margin} (data.context_len - data.context_margin)",
            )
        for source in self.sources:
            if source not in KNOWN_DATASETS and not os.path.isfile(source):
                raise (FileNotFoundError if self.path else ValueError)(
                    f"data source {source!r} is neither a file nor a known dataset ({', '.join(KNOWN_DATASETS)})"
                )

    @property
    def sources(self) -> list[str]:
        if self.path:
            return [self.path]
        names = [self.name] if isinstance(self.name, str) else list(self.name)
        check(bool(names), "data.name must name at least one dataset")
        return [str(n) for n in names]


@dataclass(kw_only=True)
class EvalConfig(Schema):
    """One evaluation run: every method on every sample, measured side by side."""

    target: TargetConfig = field(default_factory=TargetConfig)
    drafter: DrafterEvalConfig = field(default_factory=DrafterEvalConfig)
    data: DataEvalConfig = field(default_factory=DataEvalConfig)
    method: Any = field(default_factory=lambda: ["longspec", "vanilla_fa"])  # one of ALL_METHODS or a list
    # How to decode: the engine's own schema (longspec.infer.config.GenerationConfig), so every decode setting
    # has one home and one check. A flat override naming one of its fields sets it here (temperature=1 is
    # generation.temperature=1: `load_eval_config`). eos_token_ids come from the target's tokenizer.
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    max_samples: int | None = None  # per data source, after the length filter
    # samples decoded together: by the engine methods (longspec, ar, pld: `SpeculativeEngine.generate_batch`) and
    # the HF baselines vanilla_hf / vanilla_fa (left-padded, `baselines.hf_generate_batch`); hf_compile runs one
    # sample at a time. 1 = one at a time
    batch_size: int = 1
    warmup: bool = True  # one short untimed generation per method first (lazy init, kernel autotuning)
    # Timed runs per sample and method, interleaved (each repeat rotates the methods' order, and longspec's tree
    # policy restarts from the same learned state); each sample keeps its fastest run, as timeit does. For a
    # machine whose timing spread between identical runs is larger than the differences measured (a shared
    # or loaded machine); 1 = one run.
    timing_repeats: int = 1
    # With timing_repeats > 1: a sample whose runs of one method spread more than this (slowest / fastest decode
    # time) marks its cells' speedups unstable; the report prints none from them.
    max_timing_spread: float = MAX_TIMING_SPREAD
    device: str = "auto"  # auto (cuda if available) | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto (bfloat16 on GPU, float32 on CPU) | float32 | bfloat16 | float16
    output_dir: str = "outputs/eval"  # results.json, report.md, *.png

    def validate(self) -> None:
        methods = self.methods
        check(bool(methods), f"method must name at least one method of {', '.join(ALL_METHODS)}")
        unknown = [m for m in methods if m not in ALL_METHODS]
        check(not unknown, f"unknown method(s) {unknown}; choose from {', '.join(ALL_METHODS)}")
        check(len(set(methods)) == len(methods), f"method lists a method twice: {methods}")
        check(
            self.max_samples is None or self.max_samples >= 1,
            f"max_samples must be >= 1, got {self.max_samples}",
        )
        check(self.batch_size >= 1, f"batch_size must be >= 1, got {self.batch_size}")
        check(self.timing_repeats >= 1, f"timing_repeats must be >= 1, got {self.timing_repeats}")
        check(self.max_timing_spread >= 1, f"max_timing_spread must be >= 1, got {self.max_timing_spread}")
        check(self.dtype in ("auto", "float32", "bfloat16", "float16"), f"unknown dtype {self.dtype!r}")
        self._check_device()
        self._check_output_dir()
        check(
            not self.generation.eos_token_ids,
            "generation.eos_token_ids come from the target's tokenizer: drop the override",
        )
        if "longspec" in methods and self.drafter.init == "pretrained":
            check(
                bool(self.drafter.path),
                "method longspec needs a drafter: pass drafter.path=DIR, or drafter.init=random for an untrained one",
            )
            if not os.path.isdir(self.drafter.path):
                raise FileNotFoundError(f"drafter.path={self.drafter.path!r} is not a directory")

    def _check_device(self) -> None:
        """An unknown device, or a GPU this machine does not have, is one error now: it was a traceback from
        torch after the data had been read and tokenised."""
        from longspec.target_source import resolve_device

        if self.device == "auto":
            return
        device = resolve_device(self.device)  # the loaders' own check: one message for every entry point
        check(
            device.type in ("cpu", "cuda"), f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}"
        )

    def _check_output_dir(self) -> None:
        """output_dir must be a directory that can be made and written: it was first written after the target had
        loaded and warmed up (minutes for a large one), and the error then was a bare OSError not naming the
        option. Nothing is created here: a run refused later leaves no empty folder."""
        existing = os.path.abspath(self.output_dir)
        while not os.path.exists(existing):
            existing = os.path.dirname(existing)
        check(
            os.path.isdir(existing),
            f"output_dir={self.output_dir!r} cannot be created: {existing} is not a directory",
        )
        check(
            os.access(existing, os.W_OK | os.X_OK),
            f"output_dir={self.output_dir!r} is not writable ({existing} does not let this user write)",
        )

    def generation_config(self, *, eos_token_ids: tuple[int, ...]) -> GenerationConfig:
        """The engine's GenerationConfig of this run: `generation` with the tokenizer's stop tokens."""
        return dataclasses.replace(self.generation, eos_token_ids=eos_token_ids)

    @property
    def methods(self) -> list[str]:
        return [self.method] if isinstance(self.method, str) else [str(m) for m in self.method]


# The decode settings keep their flat override names (temperature=1, tree_widths=[4,16,16,16,16], tree=lookup16):
# a key whose first part is one of these is that field of `generation`.
GENERATION_FIELDS = frozenset(f.name for f in dataclasses.fields(GenerationConfig))


def nest_generation(overrides: list[str]) -> list[str]:
    """`overrides` with each flat decode setting spelt as its field of `generation` (`+top_k=5` ->
    `+generation.top_k=5`); one setting given both ways is a ValueError (neither would silently win)."""
    nested, spellings = [], {}
    for override in overrides:
        rest = override.lstrip("+~")
        prefix, (key, sep, value) = override[: len(override) - len(rest)], rest.partition("=")
        if key.split(".", 1)[0] in GENERATION_FIELDS:
            key = f"generation.{key}"
        spellings.setdefault(key, set()).add(rest.partition("=")[0])
        nested.append(f"{prefix}{key}{sep}{value}")
    twice = sorted(min(names) for names in spellings.values() if len(names) > 1)
    check(not twice, f"invalid eval config: {', '.join(twice)} given twice (X= is generation.X=); keep one")
    return nested


def load_eval_config(
    overrides: list[str] | None = None, *, config_name: str = "eval", config_dir: str | None = None
) -> EvalConfig:
    """Compose configs/<config_name>.yaml (eval.yaml, or a preset such as eval/math_qwq) with Hydra
    overrides (the decode settings by their flat names or as generation.X: `nest_generation`) and validate it
    into an EvalConfig."""
    return compose(
        EvalConfig,
        schema_name="eval_schema",
        config_name=config_name,
        overrides=nest_generation(list(overrides or [])),
        config_dir=config_dir,
        what="eval config",
    )


def split_config_name(args: list[str]) -> tuple[str, list[str]]:
    """Hydra's own flag, kept for familiarity: --config-name NAME / --config-name=NAME -> (name, the rest)."""
    args = list(args)
    for i, arg in enumerate(args):
        if arg.startswith("--config-name"):
            name = arg.split("=", 1)[1] if "=" in arg else args[i + 1]
            del args[i : i + (1 if "=" in arg else 2)]
            return name, args
    return "eval", args
