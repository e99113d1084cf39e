"""Per-generation statistics: the product metrics (acceptance histogram, mean acceptance length τ) and where the
decode time went (draft / verify / overhead)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

__all__ = ["GenerationStats", "acceptance_profile", "tree_depth"]


@dataclass
class GenerationStats:
    method: str = ""
    prompt_len: int = 0
    num_new_tokens: int = 0  # emitted tokens after truncation (the prefill's first token included)
    accepted: list[int] = field(default_factory=list)  # per round: draft tokens accepted (bonus excluded)
    prefill_s: float = 0.0  # prompt forward(s) + drafter prefill; excluded from tokens/s
    decode_s: float = 0.0  # everything after the prefill
    # The round's phases, eager: draft, verify + acceptance, commit + bookkeeping. On static shapes a round is one
    # step (one graph launch with cuda_graphs) and its whole time is verify_s.
    draft_s: float = 0.0
    verify_s: float = 0.0
    overhead_s: float = 0.0
    # Acceptance per depth over the rounds that ran a draft tree: depth_reached[d - 1] = rounds whose tree was at
    # least d deep and whose depths 1..d-1 were all accepted; depth_accepted[d - 1] = those that accepted depth d
    # too. Their ratio is P(depth d accepted | depth d-1 was): the drafter's acceptance profile on this text.
    depth_reached: list[int] = field(default_factory=list)
    depth_accepted: list[int] = field(default_factory=list)
    # tree="auto": the policy's view at the call's end, per candidate (expected tokens, cost ms, tokens per ms:
    # `AdaptivePolicy.snapshot`); empty for a fixed tree and the target-only methods
    policy: dict[str, dict[str, float]] = field(default_factory=dict)
    # Per round, in order: the tree it ran (drafting methods; "ar" = no speculation, with tree="auto" it may change
    # every round; `trees` counts them) and its wall time in ms as the policy observes it (from the previous
    # round's settle to its own; a round after plain ones includes the ring's catch-up). What a round really cost
    # where it ran, next to the warm-up's table of the same tree.
    round_trees: list[str] = field(default_factory=list)
    round_ms: list[float] = field(default_factory=list)

    def record_round(self, num_accepted: int, tree: str | None = None, seconds: float | None = None) -> None:
        self.accepted.append(int(num_accepted))
        if seconds is not None:
            self.round_ms.append(round(seconds * 1e3, 4))
        if tree is not None:
            self.round_trees.append(tree)
        depth = tree_depth(tree)
        if depth > len(self.depth_reached):
            grow = depth - len(self.depth_reached)
            self.depth_reached += [0] * grow
            self.depth_accepted += [0] * grow
        for d in range(min(depth, num_accepted + 1)):  # depths 1..min(depth, accepted + 1) were reached
            self.depth_reached[d] += 1
            self.depth_accepted[d] += d < num_accepted

    @property
    def acceptance_profile(self) -> list[float | None]:
        """Per depth d = 1, 2, ...: P(depth d accepted | depths < d were), None where no round reached d."""
        return acceptance_profile(self.depth_reached, self.depth_accepted)

    @property
    def trees(self) -> dict[str, int]:
        """Rounds per tree, in the order each first ran (from `round_trees`)."""
        counts: dict[str, int] = {}
        for tree in self.round_trees:
            counts[tree] = counts.get(tree, 0) + 1
        return counts

    @property
    def rounds(self) -> int:
        """Target forwards after the prefill (one per round; one per token for AR decoding)."""
        return len(self.accepted)

    @property
    def accept_histogram(self) -> list[int]:
        """histogram[k] = rounds that accepted exactly k draft tokens."""
        hist = [0] * (max(self.accepted, default=0) + 1)
        for k in self.accepted:
            hist[k] += 1
        return hist

    @property
    def mean_accept_length(self) -> float:
        """τ = tokens emitted per target forward = (accepted + rounds) / rounds (ALGORITHM §5)."""
        if not self.accepted:
            return float("nan")
        return (sum(self.accepted) + self.rounds) / self.rounds

    @property
    def tokens_per_s(self) -> float:
        """Decode throughput, prefill excluded: the tokens after the prefill's first one over decode time."""
        if self.decode_s <= 0 or self.num_new_tokens <= 1:
            return float("nan")
        return (self.num_new_tokens - 1) / self.decode_s

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(
            trees=self.trees,
            rounds=self.rounds,
            accept_histogram=self.accept_histogram,
            mean_accept_length=self.mean_accept_length,
            tokens_per_s=self.tokens_per_s,
            acceptance_profile=self.acceptance_profile,
        )
        return out


def tree_depth(tree: str | None) -> int:
    """Levels of a recorded tree name ("4-16-16" -> 3); 0 for "ar", None or anything that is not level widths."""
    if not tree:
        return 0
    parts = tree.split("-")
    return len(parts) if all(p.isdigit() for p in parts) else 0


def acceptance_profile(reached: list[int], accepted: list[int]) -> list[float | None]:
    return [a / r if r else None for r, a in zip(reached, accepted, strict=True)]
