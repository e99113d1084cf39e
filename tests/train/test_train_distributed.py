"""The real DeepSpeed engine on 2 CPU processes (gloo): every stage's tiny config under ZeRO-1 and ZeRO-3, bitwise
resume (clean stop and SIGKILL), stage chaining from an exported drafter, and the ZeRO-3 sharding of the target.

Launches are grouped (tests/train/multi_run.py runs many configs per launch): three launches in all.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from process_helpers import child_pids, pid_running
from safetensors.torch import load_file

from data_prep.common import load_tokenizer
from data_prep.stage1 import prepare_stage1
from data_prep.stage2 import prepare_stage2
from data_prep.stage3_sft import prepare_stage3_sft
from longspec.export import export_drafter
from longspec.testing import save_tiny_target

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

HERE = Path(__file__).parent
WORDS = "def class return import self value list dict for while if else print data model token".split()
STEPS = 6


def _torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *args]


def _launch(runs: list[list[str]], tmp: Path, name: str, *, processes: int = 2) -> None:
    spec = tmp / f"{name}.json"
    spec.write_text(json.dumps(runs))
    # One process: no launcher at all (the trainer makes itself a world of one).
    command = (
        [sys.executable, str(HERE / "multi_run.py"), str(spec)]
        if processes == 1
        else (_torchrun(str(HERE / "multi_run.py"), str(spec)))
    )
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"launch {name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


def _losses(run: Path) -> list[float]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, len(records) + 1))
    return [r["loss"] for r in records]


def _final_weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(run / "checkpoints" / f"step_{STEPS:08d}" / "drafter" / "model.safetensors")


def _assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("train")
    llama = save_tiny_target("llama", tmp / "tiny_llama")
    qwen2 = save_tiny_target("qwen2", tmp / "tiny_qwen2")
    rng = __import__("random").Random(0)

    def text(lo, hi):
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))

    (tmp / "short.jsonl").write_text("".join(json.dumps({"text": text(5, 60)}) + "\n" for _ in range(200)))
    (tmp / "long.jsonl").write_text("".join(json.dumps({"text": text(30, 120)}) + "\n" for _ in range(80)))
    sft = [
        {
            "context": text(5, 15),
            "prompt": "repeat",
            "response": " ".join(rng.choice(WORDS[:4]) for _ in range(4)),
        }
        for _ in range(40)
    ]
    (tmp / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sft))
    tok_llama, tok_qwen2 = load_tokenizer(llama), load_tokenizer(qwen2)  # as the CLI does: the target's own
    prepare_stage1(
        source=str(tmp / "short.jsonl"), tokenizer=tok_llama, out=str(tmp / "d1"), seq_len=64, progress=False
    )
    prepare_stage2(
        sources=[str(tmp / "long.jsonl")],
        tokenizer=tok_llama,
        out=str(tmp / "d2"),
        seq_len=128,
        min_tokens=64,
        progress=False,
    )
    prepare_stage3_sft(
        source=str(tmp / "sft.jsonl"), tokenizer=tok_qwen2, out=str(tmp / "d3"), max_len=128, progress=False
    )

    def cfg(stage, data, target, out, *extra):
        return [
            f"stage={stage}",
            f"target=tiny_{target}",
            f"target.path={tmp / ('tiny_' + target)}",
            f"data.path={tmp / data}",
            f"output_dir={tmp / out}",
            f"max_steps={STEPS}",
            *extra,
        ]

    s1 = lambda out, *e: cfg("tiny_stage1", "d1", "llama", out, "deepspeed.zero_stage=1", *e)  # noqa: E731
    s2z3 = lambda out, *e: cfg("tiny_stage2", "d2", "llama", out, "deepspeed.zero_stage=3", *e)  # noqa: E731
    _launch(
        [
            s1("s1_z1"),
            s1("s1_z1_stopped", "stop_at_step=3"),
            cfg("tiny_stage1", "d1", "llama", "s1_z3", "deepspeed.zero_stage=3"),
            cfg("tiny_stage2", "d2", "llama", "s2_z1", "deepspeed.zero_stage=1"),
            s2z3("s2_z3"),
            s2z3("s2_z3_stopped", "stop_at_step=3"),
            cfg("tiny_stage3", "d3", "qwen2", "s3_z1", "deepspeed.zero_stage=1"),
            cfg(
                "tiny_stage3", "d3", "qwen2", "s3_z3_kl", "deepspeed.zero_stage=3", "loss.distill_weight=0.5"
            ),
            # bf16 takes DeepSpeed's other optimizer path under ZeRO-1 (BF16_Optimizer, fp32 grad accumulation):
            # the one GPU runs use.
            s1("s1_z1_vocab", "drafter.draft_vocab_size=64"),
            s1("s1_z1_bf16", "deepspeed.precision=bf16"),
            s1("s1_z1_bf16_stopped", "deepspeed.precision=bf16", "stop_at_step=3"),
            cfg(
                "tiny_stage2",
                "d2",
                "llama",
                "s2_nolag_2proc",
                "deepspeed.zero_stage=1",
                "stage.flash_noisy=false",
            ),
        ],
        tmp,
        "first",
    )

    # A run whose torchrun launcher is killed with SIGKILL right after its step-2 checkpoint, mid-step 3 or 4.
    # Launched through the real entry point (`torchrun -m longspec.train ...`). torch elastic starts the workers in
    # sessions of their own, so killing the launcher's group does not reach them: they must die with it.
    proc = subprocess.Popen(
        _torchrun("-m", "longspec.train", *s1("s1_killed")),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    metrics = tmp / "s1_killed" / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.01)
    workers = child_pids(proc.pid)
    still_running = proc.poll() is None and len(workers) == 2
    os.killpg(proc.pid, signal.SIGKILL)  # the launcher's group (the workers are not in it)
    proc.wait()
    assert still_running, "the run finished before it could be killed; the SIGKILL test proved nothing"
    deadline = time.time() + 30
    while any(map(pid_running, workers)) and time.time() < deadline:
        time.sleep(0.05)
    survivors = [pid for pid in workers if pid_running(pid)]
    for pid in survivors:
        os.kill(pid, signal.SIGKILL)  # never leave them training next to the relaunch below
    assert not survivors, f"workers {survivors} kept training after their launcher was killed"

    # The same global batch on one process (4 micro-batches of accumulation instead of 2 x 2 ranks). Without the
    # noisy lag (drawn per micro-step index) both see identical work per step.
    _launch(
        [
            cfg(
                "tiny_stage2",
                "d2",
                "llama",
                "s2_nolag_1proc",
                "deepspeed.zero_stage=1",
                "stage.flash_noisy=false",
            )
        ],
        tmp,
        "single",
        processes=1,
    )
    export_drafter(str(tmp / "s1_z1"), str(tmp / "s1_export"))
    export_drafter(str(tmp / "s1_z1_vocab"), str(tmp / "s1_vocab_export"))
    _launch(
        [
            s1("s1_z1_stopped"),  # resume: no stop this time
            s1("s1_killed"),
            s1("s1_z1_bf16_stopped", "deepspeed.precision=bf16"),
            s2z3("s2_z3_stopped"),
            s2z3("s2_z3_chained", f"init_from={tmp / 's1_export'}"),
            # A draft vocabulary's drafter seeds a ZeRO-3 stage, whose LM head is a shard (no rows to copy).
            s2z3("s2_z3_vocab_chained", f"init_from={tmp / 's1_vocab_export'}"),
        ],
        tmp,
        "resumed",
    )
    return tmp


@pytest.mark.parametrize("run", ["s1_z1", "s1_z3", "s2_z1", "s2_z3", "s3_z1", "s3_z3_kl", "s1_z1_bf16"])
def test_each_stage_trains_and_loss_falls(runs, run):
    losses = _losses(runs / run)
    assert len(losses) == STEPS
    assert losses[-1] < losses[0] - 0.05, losses
    record = json.loads((runs / run / "metrics.jsonl").read_text().splitlines()[-1])
    for key in ("grad_norm", "lr", "tokens_per_s", "mem_gb", "acc"):
        assert key in record
    if run.endswith("_kl"):
        assert record["kl"] > 0 and record["loss"] == pytest.approx(record["ce"] + 0.5 * record["kl"])


def test_zero1_and_zero3_agree_at_the_first_step(runs):
    # Same seed, same data, same initial drafter: the first loss does not depend on how parameters are sharded.
    assert _losses(runs / "s1_z1")[0] == pytest.approx(_losses(runs / "s1_z3")[0], rel=1e-5)


def test_loss_and_gradients_do_not_depend_on_the_world_size(runs):
    """Normalising by the GLOBAL valid-token count (and DeepSpeed's mean over ranks) makes 2 ranks x 2 micro-steps
    train exactly like 1 rank x 4 micro-steps, up to float summation order."""
    two, one = (
        [json.loads(line) for line in (runs / name / "metrics.jsonl").read_text().splitlines()]
        for name in ("s2_nolag_2proc", "s2_nolag_1proc")
    )
    for a, b in zip(two, one, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)


def test_zero3_shards_the_frozen_target(runs):
    log = (runs / "s1_z3" / "train.log").read_text()
    full, local = map(
        int, re.search(r"frozen target: (\d+) parameters, (\d+) held by this rank", log).groups()
    )
    assert local < 0.6 * full  # about half on each of 2 ranks (small norms stay whole: persistence threshold)
    log = (runs / "s1_z1" / "train.log").read_text()
    full, local = map(
        int, re.search(r"frozen target: (\d+) parameters, (\d+) held by this rank", log).groups()
    )
    assert local == full


@pytest.mark.parametrize(
    "resumed, reference",
    [
        ("s1_z1_stopped", "s1_z1"),
        ("s1_killed", "s1_z1"),
        ("s2_z3_stopped", "s2_z3"),
        ("s1_z1_bf16_stopped", "s1_z1_bf16"),
    ],
)
def test_resume_is_bitwise_identical(runs, resumed, reference):
    assert _losses(runs / resumed) == _losses(runs / reference)
    _assert_same_weights(_final_weights(runs / resumed), _final_weights(runs / reference))
    assert "resumed from" in (runs / resumed / "train.log").read_text()


def test_entry_point_writes_the_resolved_config(runs):
    text = (runs / "s1_killed" / "config.yaml").read_text()
    assert text.startswith("# python -m longspec.train stage=tiny_stage1") and "zero_stage: 1" in text
    assert "anchor_max_len: 3750" in text  # derived from the tiny target's 4096 positions when it loaded


def test_checkpoints_keep_last_k_and_no_temp_dirs(runs):
    names = sorted(os.listdir(runs / "s1_killed" / "checkpoints"))
    assert names == [f"step_{4:08d}", f"step_{6:08d}"]  # keep_last=2, temp dirs of the killed save removed


def test_stage_chaining_starts_from_the_exported_drafter(runs):
    chained, scratch = _losses(runs / "s2_z3_chained"), _losses(runs / "s2_z3")
    assert chained[0] < scratch[0] - 0.05  # the stage-1 drafter already models the words
    state = json.loads(
        (runs / "s2_z3_chained" / "checkpoints" / f"step_{STEPS:08d}" / "trainer_state.json").read_text()
    )
    assert state["init_from"] == str(runs / "s1_export")


def test_a_draft_vocabulary_carries_into_a_zero3_stage(runs):
    chained, scratch = _losses(runs / "s2_z3_vocab_chained"), _losses(runs / "s2_z3")
    assert len(chained) == STEPS and chained[0] < scratch[0] - 0.05
    export_drafter(str(runs / "s2_z3_vocab_chained"), str(runs / "s2_vocab_export"))
    first, second = (
        json.loads((runs / name / "config.json").read_text())
        for name in ("s1_vocab_export", "s2_vocab_export")
    )
    assert first["draft_vocab_size"] == second["draft_vocab_size"] == 64
    assert first["draft_vocab_sha256"] == second["draft_vocab_sha256"]
