"""Drafter training throughput at Llama-3.1-8B shapes (random weights): the trainer's per-micro-batch work through
the real DeepSpeed engine -- frozen target forward -> drafter forward (flash-noisy lag) -> fused CE -> backward ->
AdamW step.

    PYTHONPATH=. python benchmarks/train_throughput.py                  # one GPU: stage 1 at 4K, stage 2 at 32K/64K
    PYTHONPATH=. torchrun --nproc_per_node 2 benchmarks/train_throughput.py --zero-stage 3 --only stage2
    PYTHONPATH=. python benchmarks/train_throughput.py --tiny           # CPU smoke run (tiny shapes, fp32)

Cases: stage 1 = 4 rows x 1024 tokens (4K tokens per step, anchor-offset positions); stage 2 = one row of 32K and
of 64K tokens (plain positions), one timed step each ("does it fit"). The target's cost does not depend on its
weights, so it is built on the meta device and materialised on the GPU with random values (no 16 GB download).
MFU = (target forward + drafter forward/backward FLOPs) / step time / 754 TFLOP/s (the H200's measured bf16
matmul ceiling); FLOPs count matmuls only: 2 x params x tokens for linear layers, causal attention
2 x T^2 x H x D per layer forward (half the square), sliding-window attention 4 x T x W x H x D, the LM head
2 x T x V x Dm forward + the same backward (hidden-state gradient only: the head is frozen); backward = 2 x forward.
Prints a markdown table last; writes JSON to $OUT/train_throughput.json when OUT is set, else to --json.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from longspec.atomic import write_json_atomic
from longspec.provenance import run_info

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # shapes.py beside it
from shapes import llama31_8b_config, random_target, smollm2_135m_config  # noqa: E402

MATMUL_FLOPS_PER_S = 754e12


def flops_per_step(cfg, *, tokens: int, seq_len: int, window: int) -> dict[str, float]:
    """Matmul FLOPs of one micro-batch of `tokens` tokens in rows of `seq_len` (see the module docstring)."""
    Dm, F, L, V = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.vocab_size
    H, Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    D = getattr(cfg, "head_dim", None) or Dm // H
    layer_params = Dm * H * D + 2 * Dm * Hkv * D + H * D * Dm + 3 * Dm * F  # q, k, v, o, gate/up/down
    rows = tokens // seq_len
    causal_attn = 2 * seq_len * seq_len * H * D * rows  # QK^T + PV over the causal half, per layer
    target = L * (2 * layer_params * tokens + causal_attn)
    drafter_params = layer_params + 2 * Dm * H * D  # self-attn q/k/v/o + mlp, cross-attn q/o
    window_attn = 4 * tokens * min(window + 1, seq_len) * H * D
    drafter_fwd = 2 * drafter_params * tokens + window_attn + causal_attn
    head = 2 * tokens * V * Dm
    return {"target": float(target), "drafter": float(3 * drafter_fwd + 2 * head)}


SHAPES = {
    "8b": (llama31_8b_config, (4, 1024), [32768, 65536]),
    "smollm2": (smollm2_135m_config, (16, 2048), [8192]),
}


def build_engine(
    hf_config,
    *,
    device,
    dtype,
    zero_stage: int,
    micro_batch: int,
    world_size: int,
    precision: str,
    window: int | None = None,
    loss_overrides: tuple[str, ...] = (),
):
    import deepspeed

    from longspec.drafter import Drafter, DrafterConfig
    from longspec.train.build import decay_groups, loss_settings
    from longspec.train.config import load_config
    from longspec.train.deepspeed_config import build_deepspeed_config
    from longspec.train.model import DraftingModel

    cfg = load_config(
        [
            "stage=stage1_slimpajama",
            "data.path=unused",
            f"stage.micro_batch_size={micro_batch}",
            f"stage.global_batch_size={micro_batch * world_size}",
            f"deepspeed.zero_stage={zero_stage}",
            f"deepspeed.precision={precision}",
            *loss_overrides,
        ]
    )
    drafter_kwargs = {} if window is None else {"window": window}
    ds_config = build_deepspeed_config(cfg, world_size=world_size)
    # as longspec.train.build.build_model: MAX_LEN from the target's context (30000 for Llama-3.1-8B)
    cfg.stage.anchor_max_len = cfg.stage.resolve_anchor_max_len(hf_config.max_position_embeddings)
    if zero_stage == 3:
        from transformers import AutoModelForCausalLM

        from longspec.target import TargetModel
        from longspec.train.build import import_model_class

        import_model_class(hf_config)
        # Sharded as the trainer does: the whole wrapper inside zero.Init, random init on the shards.
        hf_config = copy.deepcopy(hf_config)
        hf_config.pad_token_id = None  # HF's init would zero the padding row of an (empty) embedding shard
        with deepspeed.zero.Init(config_dict_or_path=ds_config, dtype=dtype):
            target = TargetModel(AutoModelForCausalLM.from_config(hf_config, dtype=dtype))
        generator = torch.Generator(device=device).manual_seed(dist.get_rank())
        with torch.no_grad():
            for param in target.parameters():  # random values straight into each rank's shard
                if param.dim() == 1:
                    param.ds_tensor.fill_(1.0)
                else:
                    param.ds_tensor.normal_(0.0, 0.02, generator=generator)
        with deepspeed.zero.Init(config_dict_or_path=ds_config, dtype=dtype):
            drafter = Drafter(
                DrafterConfig.from_target_config(hf_config, **drafter_kwargs),
                target.embed_tokens,
                target.lm_head,
            )
            model = DraftingModel(target, drafter, **loss_settings(cfg))
    else:
        target = random_target(hf_config, device, dtype)
        drafter = Drafter(
            DrafterConfig.from_target_config(hf_config, **drafter_kwargs), target.embed_tokens, target.lm_head
        )
        model = DraftingModel(target, drafter, **loss_settings(cfg)).to(device)
        drafter.to(dtype)
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=decay_groups(model.drafter, cfg.optim.weight_decay), config=ds_config
    )
    if zero_stage == 3:
        model.replicate_head()
    model.target.pack_weights()  # as the trainer (a no-op on ZeRO-3 shards)
    return engine, model, cfg


def train_step(engine, ids, positions, labels, valid_rows, *, lag: int, count_correct: bool):
    out = engine(ids, positions, labels, valid_rows, lag=lag, count_correct=count_correct)
    with torch.profiler.record_function("backward"):
        engine.backward(out.loss / valid_rows.numel(), scale_wrt_gas=False)
    with torch.profiler.record_function("optimizer_step"):
        engine.step()
    return out


def profile_step(step, device, *, top: int = 15) -> dict:
    """One more step under torch.profiler: device time per named phase (the record_function ranges of
    DraftingModel.forward and train_step) and the `top` device kernels by total time, in ms."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    events = prof.key_averages()
    cuda = device.type == "cuda"
    total, own = (
        ("device_time_total", "self_device_time_total") if cuda else ("cpu_time_total", "self_cpu_time_total")
    )
    phases = {
        e.key: getattr(e, total) / 1e3
        for e in events
        if e.key in ("target", "drafter", "loss_ce", "loss_ce_kl", "top1", "backward", "optimizer_step")
    }
    kernels = sorted(
        (e for e in events if not cuda or e.device_type.name == "CUDA"),
        key=lambda e: getattr(e, own),
        reverse=True,
    )
    return {
        "phase_ms": phases,
        "top_kernels": [
            {"name": e.key[:90], "ms": getattr(e, own) / 1e3, "calls": e.count} for e in kernels[:top]
        ],
    }


def run_case(
    engine, model, cfg, *, name, rows, seq_len, anchor, steps, warmup, device, vocab, rank,
    count_correct=False, profile=False,
):  # fmt: skip
    from longspec.positions import anchor_offset_position_ids

    generator = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, vocab, (rows, seq_len), generator=generator)
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = -100
    if anchor:
        positions = anchor_offset_position_ids(
            rows, seq_len, max_len=cfg.stage.anchor_max_len, generator=generator
        )
    else:
        positions = torch.arange(seq_len).expand(rows, seq_len)
    valid_rows = (labels.view(-1) != -100).nonzero().squeeze(-1)
    ids, labels, positions, valid_rows = (t.to(device) for t in (ids, labels, positions, valid_rows))
    times = []
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    try:
        for i in range(warmup + steps):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            out = train_step(
                engine, ids, positions, labels, valid_rows, lag=1 + i % 4, count_correct=count_correct
            )
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i >= warmup:
                times.append(time.perf_counter() - start)
        loss = float(out.ce_sum) / valid_rows.numel()
        error = None
    except torch.OutOfMemoryError as e:  # "does it fit" is a result for the long cases
        loss, error = None, f"OOM: {str(e).splitlines()[0][:160]}"
        engine.optimizer.zero_grad()
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    tokens = rows * seq_len
    result = {
        "case": name,
        "rows": rows,
        "seq_len": seq_len,
        "tokens": tokens,
        "fits": error is None,
        "error": error,
        "peak_mem_gib": peak,
        "loss": loss,
    }
    if error is None:
        step_s = statistics.median(times)
        flops = flops_per_step(
            model.target.config, tokens=tokens, seq_len=seq_len, window=model.drafter.config.window
        )
        result.update(
            step_ms=step_s * 1000,
            tokens_per_s=tokens / step_s,
            target_tflop=flops["target"] / 1e12,
            drafter_tflop=flops["drafter"] / 1e12,
            mfu=(flops["target"] + flops["drafter"]) / step_s / MATMUL_FLOPS_PER_S,
        )
        if profile:
            result["profile"] = profile_step(
                lambda: train_step(
                    engine, ids, positions, labels, valid_rows, lag=2, count_correct=count_correct
                ),
                device,
            )
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny Llama config on CPU (smoke test)")
    parser.add_argument("--zero-stage", type=int, default=1, choices=(1, 3))
    parser.add_argument("--only", choices=("stage1", "stage2"), default=None)
    parser.add_argument(
        "--steps", type=int, default=None, help="timed steps for stage 1 (default 10; tiny 2)"
    )
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--json", default="train_throughput.json")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b", help="random-weight target shape")
    parser.add_argument(
        "--stage1", default=None, help="stage-1 rows x tokens, e.g. 16x2048 (default: the shape's)"
    )
    parser.add_argument("--window", type=int, default=None, help="drafter window (default: the drafter's)")
    parser.add_argument(
        "--loss",
        nargs="*",
        default=[],
        help="loss overrides, e.g. loss.distill_weight=1.0 loss.chunk_size=1024 (as the trainer's config)",
    )
    parser.add_argument(
        "--count-correct",
        action="store_true",
        help="count top-1 hits every step (the trainer does on log steps)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="one more stage-1 step under torch.profiler: device ms per phase (target, drafter, losses, "
        "backward, optimizer) and the top kernels",
    )
    args = parser.parse_args(argv)

    from longspec.train.build import loss_settings
    from longspec.train.distributed import init_distributed

    dist_info = init_distributed()
    device = dist_info.device
    if args.tiny:
        from longspec.testing import tiny_hf_config

        hf_config, dtype, precision = tiny_hf_config("llama"), torch.float32, "fp32"
        stage1, stage2 = (4, 64), [256, 512]
    else:
        if device.type != "cuda":
            raise SystemExit("the full-size benchmark needs a CUDA GPU; use --tiny for a CPU smoke run")
        make_config, stage1, stage2 = SHAPES[args.shape]
        hf_config, dtype, precision = make_config(), torch.bfloat16, "bf16"
    if args.stage1:
        stage1 = tuple(int(x) for x in args.stage1.lower().split("x"))
    steps = args.steps or (2 if args.tiny else 10)
    warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 3)
    engine, model, cfg = build_engine(
        hf_config,
        device=device,
        dtype=dtype,
        zero_stage=args.zero_stage,
        micro_batch=stage1[0],
        world_size=dist_info.world_size,
        precision=precision,
        window=args.window,
        loss_overrides=tuple(args.loss),
    )
    cases = []  # (name, rows, seq_len, anchor-offset positions, timed steps, warm-up steps)
    if args.only in (None, "stage1"):
        cases.append(("stage1 (anchor offsets)", stage1[0], stage1[1], True, steps, warmup))
    if args.only in (None, "stage2"):
        for seq_len in stage2:
            # One row (micro-batch 1, as stage 2); one warm-up + one timed step: the question is whether it fits.
            name = f"stage2 {seq_len // 1024}K" if seq_len >= 1024 else f"stage2 {seq_len}"
            cases.append((name, 1, seq_len, False, 1, 1))
    report = {
        **run_info(device=device, argv=argv),
        "world_size": dist_info.world_size,
        "zero_stage": args.zero_stage,
        "precision": precision,
        "tiny": args.tiny,
        "shape": "tiny" if args.tiny else args.shape,
        "window": model.drafter.config.window,
        "loss": loss_settings(cfg),
        "results": [],
    }
    out_dir = os.environ.get("OUT")
    path = os.path.join(out_dir, "train_throughput.json") if out_dir else args.json
    for name, rows, seq_len, anchor, case_steps, case_warmup in cases:
        try:
            result = run_case(
                engine,
                model,
                cfg,
                name=name,
                rows=rows,
                seq_len=seq_len,
                anchor=anchor,
                steps=case_steps,
                warmup=case_warmup,
                device=device,
                vocab=hf_config.vocab_size,
                rank=dist_info.rank,
                count_correct=args.count_correct,
                profile=args.profile and name.startswith("stage1"),
            )
        except Exception as e:  # one GPU run: a failing case must not lose the others' numbers
            result = {
                "case": name,
                "rows": rows,
                "seq_len": seq_len,
                "tokens": rows * seq_len,
                "fits": False,
                "error": f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}",
                "peak_mem_gib": float("nan"),
                "loss": None,
            }
        report["results"].append(result)
        if dist_info.rank == 0:  # rewritten after every case: a crash later still leaves these results
            write_json_atomic(path, report)
    if dist_info.rank == 0:
        print(
            f"\n{report['device']}, {dist_info.world_size} process(es), ZeRO-{args.zero_stage}, {precision}\n"
        )
        print("| case | tokens/step | step ms | tokens/s | MFU | peak GiB | fits |")
        print("|---|---|---|---|---|---|---|")
        for r in report["results"]:
            if r["fits"]:
                print(
                    f"| {r['case']} | {r['tokens']} | {r['step_ms']:.1f} | {r['tokens_per_s']:,.0f} | "
                    f"{r['mfu']:.1%} | {r['peak_mem_gib']:.1f} | yes |"
                )
            else:
                print(
                    f"| {r['case']} | {r['tokens']} | - | - | - | {r['peak_mem_gib']:.1f} | no ({r['error']}) |"
                )
        for r in report["results"]:
            if "profile" in r:
                prof = r["profile"]
                print(
                    f"\nprofiled step ({r['case']}), device ms per phase: "
                    + ", ".join(f"{k} {v:.1f}" for k, v in prof["phase_ms"].items())
                )
                print("| kernel | ms | calls |\n|---|---|---|")
                for k in prof["top_kernels"]:
                    print(f"| {k['name']} | {k['ms']:.2f} | {k['calls']} |")
    return report


if __name__ == "__main__":
    main()
