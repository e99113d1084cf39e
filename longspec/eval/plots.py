"""τ and tokens/s by context-length bucket (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import math
import os

__all__ = ["BUCKET_EDGES", "bucket_label", "plot_by_context_length"]

# Prompt-length bucket upper edges (tokens); the last bucket is open.
BUCKET_EDGES = (1024, 2048, 4096, 8192, 16384, 32768, 65536)


def bucket_label(prompt_len: int) -> str:
    lower = 0
    for edge in BUCKET_EDGES:
        if prompt_len <= edge:
            return f"{_k(lower)}–{_k(edge)}"
        lower = edge
    return f">{_k(lower)}"


def _k(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 else str(n)


def _bucket_order(label: str) -> int:
    labels = [bucket_label(edge) for edge in BUCKET_EDGES] + [bucket_label(BUCKET_EDGES[-1] + 1)]
    return labels.index(label)


def plot_by_context_length(methods: dict[str, dict[str, list[dict]]], output_dir: str) -> list[str]:
    """Two PNGs (all datasets pooled): τ per bucket for the drafting methods, tokens/s per bucket for all.
    Returns the file names written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    per_method: dict[str, dict[str, list[dict]]] = {}
    for method, per_dataset in methods.items():
        for records in per_dataset.values():
            for r in records:
                per_method.setdefault(method, {}).setdefault(bucket_label(r["prompt_len"]), []).append(r)
    buckets = sorted({b for by_bucket in per_method.values() for b in by_bucket}, key=_bucket_order)

    def tau(records):
        rounds = sum(r["rounds"] for r in records)
        return (sum(sum(r["accepted"]) for r in records) + rounds) / rounds if rounds else math.nan

    def tps(records):
        decode = sum(r["decode_s"] for r in records)
        return sum(max(r["num_new_tokens"] - 1, 0) for r in records) / decode if decode > 0 else math.nan

    written = []
    for name, metric, ylabel, only in (
        ("accept_length_by_context.png", tau, "mean acceptance length τ", ("longspec", "pld")),
        ("tokens_per_s_by_context.png", tps, "decode tokens/s (prefill excluded)", None),
    ):
        fig, ax = plt.subplots(figsize=(7, 4))
        shown = [m for m in per_method if only is None or m in only]
        width = 0.8 / max(len(shown), 1)
        for i, method in enumerate(shown):
            values = [metric(per_method[method].get(b, [])) for b in buckets]
            ax.bar([x + i * width for x in range(len(buckets))], values, width, label=method)
        ax.set_xticks([x + width * (len(shown) - 1) / 2 for x in range(len(buckets))], buckets)
        ax.set_xlabel("prompt length (tokens)")
        ax.set_ylabel(ylabel)
        if shown:
            ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(output_dir, name), dpi=120)
        plt.close(fig)
        written.append(name)
    return written
