"""benchmarks/train_throughput.py: the FLOP model matches the real modules, and `--tiny` runs on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from longspec.drafter import Drafter, DrafterConfig
from longspec.testing import make_tiny_hf_model, make_tiny_target

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "train_throughput.py"


@pytest.fixture(scope="module")
def bench(load_benchmark):
    return load_benchmark("train_throughput")


def _linear_params(module: torch.nn.Module) -> int:
    return sum(m.weight.numel() for m in module.modules() if isinstance(m, torch.nn.Linear))


def test_flop_model_counts_the_real_linear_layers(bench):
    hf = make_tiny_hf_model("llama")
    cfg = hf.config
    tokens, H, D, L = 64, cfg.num_attention_heads, cfg.head_dim, cfg.num_hidden_layers
    # seq_len 1: each row attends to itself only, so the attention term is 2 * H * D per token and layer.
    flops = bench.flops_per_step(cfg, tokens=tokens, seq_len=1, window=1)
    assert flops["target"] == 2 * _linear_params(hf.model.layers) * tokens + L * 2 * H * D * tokens
    target = make_tiny_target("llama")
    drafter = Drafter(DrafterConfig.from_target_config(cfg, window=1), target.embed_tokens, target.lm_head)
    attention = 2 * H * D * tokens + 4 * tokens * 1 * H * D  # cross (causal, 1 key) + window (1 key)
    head = 2 * tokens * cfg.vocab_size * cfg.hidden_size
    assert flops["drafter"] == 3 * (2 * _linear_params(drafter) * tokens + attention) + 2 * head


@pytest.mark.slow
def test_tiny_benchmark_runs_on_cpu(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--steps", "1", "--warmup", "0"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads((tmp_path / "train_throughput.json").read_text())
    assert [r["case"] for r in report["results"]] == ["stage1 (anchor offsets)", "stage2 256", "stage2 512"]
    for result in report["results"]:
        assert result["fits"] and result["tokens_per_s"] > 0 and 0 < result["mfu"] < 1
        assert result["loss"] == pytest.approx(5.7, abs=0.3)  # ~ln(300): a random drafter over the tiny vocab
    assert "| stage1 (anchor offsets) | 256 |" in proc.stdout


@pytest.mark.slow
def test_tiny_profile_names_the_phases_of_a_distilled_step(tmp_path):
    """--profile splits one step into the trainer's phases (on CPU: host time), with the fused CE + KL loss."""
    env = {**os.environ, "OUT": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--only", "stage1", "--steps", "1", "--warmup", "0",
         "--loss", "loss.distill_weight=1.0", "--count-correct", "--profile"],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads((tmp_path / "train_throughput.json").read_text())
    assert report["loss"]["distill_weight"] == 1.0
    (result,) = report["results"]
    phases = result["profile"]["phase_ms"]
    assert set(phases) == {"target", "drafter", "loss_ce_kl", "backward", "optimizer_step"}
    assert all(ms > 0 for ms in phases.values())
    assert result["profile"]["top_kernels"] and "profiled step" in proc.stdout
