"""Host time of tree="auto"'s shadow lookup (`longspec.infer.pld.LookupShadow`) on this machine's CPU: indexing a
call's prompt (before its first round, counted in the call's prefill time) and the work per round (a lookup's
draft at a root, and a token joining the index), per prompt length.

    PYTHONPATH=. python benchmarks/shadow_index.py [--lengths 1024 8192 131072] [--vocab 49152]

Prompts of random token ids (every n-gram of a random prompt is rare, as most of a real one's are) plus, to give
the draft something to find, a copy of the prompt's last 64 tokens placed in its middle. Each figure is the fastest
of --repeats runs. Writes $OUT/shadow_index.json (or --json) when given.
"""

from __future__ import annotations

import argparse
import os
import random
import time

from longspec.atomic import write_json_atomic
from longspec.infer.candidates import AUTO_LOOKUPS
from longspec.infer.policy.shadow import LookupShadow
from longspec.provenance import run_info


def prompt(length: int, vocab: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    tokens = [rng.randrange(vocab) for _ in range(length)]
    tail = tokens[-64:]
    middle = length // 2
    tokens[middle : middle + len(tail)] = tail
    return tokens[:length]


def time_shadow(
    tokens: list[int], *, length: int, branches: int, max_ngram: int, rounds: int, repeats: int
) -> dict:
    """Fastest of `repeats`: building the index for `tokens`; then per round, a draft and one appended token."""
    build, per_round, found = float("inf"), float("inf"), 0
    for _ in range(repeats):
        start = time.perf_counter()
        shadow = LookupShadow(tokens, length, max_ngram, branches)
        build = min(build, time.perf_counter() - start)
        start = time.perf_counter()
        for token in tokens[:rounds]:
            found += bool(shadow.draft())
            shadow._append(token)
        per_round = min(per_round, (time.perf_counter() - start) / rounds)
    return {"build_ms": build * 1e3, "round_us": per_round * 1e6, "rounds_with_a_draft": found / repeats}


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 8192, 32768, 131072])
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--max-ngram", type=int, default=3, help="GenerationConfig.pld_max_ngram")
    parser.add_argument("--rounds", type=int, default=200, help="rounds timed per run (draft + append)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None, help="output path when $OUT is not set")
    args = parser.parse_args(argv)
    # the shadow tree="auto" runs: the longest and widest of its lookup candidates
    length = max(c.length for c in AUTO_LOOKUPS)
    branches = max(c.branches for c in AUTO_LOOKUPS)
    rows = []
    for n in args.lengths:
        figures = time_shadow(
            prompt(n, args.vocab), length=length, branches=branches, max_ngram=args.max_ngram,
            rounds=min(args.rounds, n), repeats=args.repeats,
        )  # fmt: skip
        rows.append({"prompt_tokens": n, **figures})
        print(
            f"prompt {n:>7} tokens: index {figures['build_ms']:8.2f} ms, "
            f"per round {figures['round_us']:7.1f} us (draft + append)",
            flush=True,
        )
    out = os.path.join(os.environ["OUT"], "shadow_index.json") if os.environ.get("OUT") else args.json
    if out:
        write_json_atomic(out, {**run_info(), "args": vars(args), "rows": rows})
    return rows


if __name__ == "__main__":
    main()
