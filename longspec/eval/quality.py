"""Is the target's own output text at all? A guard against τ measured on degenerate references.

A target that answers `#\\n#\\n#...` makes any drafter look excellent: repeating one token is trivially predictable,
so τ and speedup soar while measuring nothing. Every eval report therefore scores the target's reference output
of each sample and reports degenerate samples apart from the headline figures.

A reference is degenerate when either
- its distinct-token ratio (distinct tokens / tokens) is below MIN_DISTINCT_RATIO: real code and prose of a few
  hundred to a thousand tokens measure 0.15-0.6 (SmolLM2-135M-Instruct on long Python files: 0.18-0.31), a
  one-token loop ~0.01; or
- its last LOOP_TAIL_FRACTION or more is one short n-gram (period <= MAX_LOOP_PERIOD tokens) repeated: a loop
  of a few distinct tokens that the ratio alone misses on short outputs; or
- MAX_REPEATED_SHARE or more of its second half repeats itself: the REPEAT_NGRAM-gram starting there already
  occurred earlier in the output. This catches the loops a small model falls into at long context that are
  neither exactly periodic nor short: one sentence or paragraph again and again ("The document is a one-page
  summary of ... " x 5, SmolLM2-135M-Instruct on a 4K-token summarisation prompt), lists that enumerate one
  line with a counter. The threshold sits above what ordinary code and prose score and below what real loops
  score (`benchmarks/quality_calibration.py` scores windows of the standard library's code and prose). A list
  that repeats one line with a counter and then moves on can stay below it: the guard catches what loops, not
  everything repetitive.
Outputs shorter than MIN_TOKENS are never flagged (a one-line answer has too few tokens to judge).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "MIN_DISTINCT_RATIO",
    "MAX_LOOP_PERIOD",
    "LOOP_TAIL_FRACTION",
    "REPEAT_NGRAM",
    "MAX_REPEATED_SHARE",
    "MIN_TOKENS",
    "Quality",
    "assess",
    "repeated_share",
]

MIN_DISTINCT_RATIO = 0.1
MAX_LOOP_PERIOD = 16
LOOP_TAIL_FRACTION = 0.5
REPEAT_NGRAM = 8
MAX_REPEATED_SHARE = 0.5
MIN_TOKENS = 32


@dataclass(frozen=True)
class Quality:
    num_tokens: int
    distinct_ratio: float | None  # None for an empty output
    loop_period: int | None  # the repeated n-gram's length when the tail loops
    loop_fraction: float  # share of the output covered by that loop (0 when none)
    repeated_share: float  # share of the second half's n-grams seen earlier in the output
    degenerate: bool
    reason: str | None  # "low_distinct_ratio" | "loop" | "repetition" | None

    def to_dict(self) -> dict:
        return {
            "num_tokens": self.num_tokens,
            "distinct_ratio": self.distinct_ratio,
            "loop_period": self.loop_period,
            "loop_fraction": self.loop_fraction,
            "repeated_share": self.repeated_share,
            "degenerate": self.degenerate,
            "reason": self.reason,
        }


def periodic_tail(tokens: list[int], max_period: int = MAX_LOOP_PERIOD) -> tuple[int | None, int]:
    """(period, length) of the longest tail of `tokens` that repeats a block of <= max_period tokens at least
    twice: tokens[i] == tokens[i - period] all through it. (None, 0) when no tail repeats."""
    best_period, best_len = None, 0
    n = len(tokens)
    for period in range(1, min(max_period, n // 2) + 1):
        i = n - 1
        while i >= period and tokens[i] == tokens[i - period]:
            i -= 1
        length = (n - 1 - i) + period  # the matching run plus the block it copies
        if length >= 2 * period and length > best_len:
            best_period, best_len = period, length
    return best_period, best_len


def repeated_share(tokens: list[int], n: int = REPEAT_NGRAM) -> float:
    """Share of the n-grams starting in the second half of `tokens` that already started somewhere earlier."""
    seen: set[tuple[int, ...]] = set()
    repeats = []
    for i in range(len(tokens) - n + 1):
        gram = tuple(tokens[i : i + n])
        repeats.append(gram in seen)
        seen.add(gram)
    half = repeats[len(repeats) // 2 :]
    return sum(half) / len(half) if half else 0.0


def assess(tokens: list[int], *, min_distinct_ratio: float = MIN_DISTINCT_RATIO,
           max_loop_period: int = MAX_LOOP_PERIOD, loop_tail_fraction: float = LOOP_TAIL_FRACTION,
           min_tokens: int = MIN_TOKENS) -> Quality:  # fmt: skip
    n = len(tokens)
    ratio = len(set(tokens)) / n if n else None
    period, tail = periodic_tail(tokens, max_loop_period)
    fraction = tail / n if n else 0.0
    repeated = repeated_share(tokens)
    reason = None
    if n >= min_tokens:
        if ratio < min_distinct_ratio:
            reason = "low_distinct_ratio"
        elif period is not None and fraction >= loop_tail_fraction:
            reason = "loop"
        elif repeated >= MAX_REPEATED_SHARE:
            reason = "repetition"
    return Quality(n, ratio, period, fraction, repeated, reason is not None, reason)
