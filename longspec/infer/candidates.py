"""The round shapes a longspec round may run, and everything that tells them apart: a plain step (`()`, no
speculation), a drafter tree (level widths, e.g. (4, 16, 16)) or a prompt-lookup chain or forest (`Lookup`).
The rest of `longspec.infer` asks this module what a candidate does (drafts with the drafter, its depth, its
name, the ranks its accepted path shows) instead of testing its type.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from longspec.infer.tree import TreeLayout

__all__ = [
    "AUTO_LOOKUPS",
    "AUTO_TREES",
    "DEFAULT_TREE_WIDTHS",
    "Candidate",
    "Lookup",
    "as_candidate",
    "candidate_depth",
    "candidate_nodes",
    "candidate_order",
    "contains",
    "is_drafter_tree",
    "is_lookup",
    "is_plain",
    "level_ranks",
    "max_children",
    "model_widths",
    "parse_candidate",
    "shape_key",
    "tree_name",
]


@dataclass(frozen=True)
class Lookup:
    """A round shape that drafts by prompt lookup instead of the drafter (longspec.infer.pld): `branches` chains
    of `length` drafts from the round's root, each continuing another earlier occurrence of the context's last
    n-gram (`pld.prompt_lookups`), padded with invalid nodes where a match is shorter or missing, verified
    together (a forest, `tree.forest_parts`). One branch is PLD's chain. Hashable and named apart from the
    drafter's trees (tuples of level widths)."""

    length: int
    branches: int = 1

    def __post_init__(self):
        if self.length < 1 or self.branches < 1:
            raise ValueError(
                f"a lookup needs at least one draft and one branch, got {self.length} x {self.branches}"
            )

    @property
    def nodes(self) -> int:
        """The verified tree's nodes: the root and every branch's drafts."""
        return 1 + self.length * self.branches

    @property
    def widths(self) -> tuple[int, ...]:
        """The level widths the acceptance model sees: the branch is chosen at depth 1 (the accepted path's
        rank there is its branch), and the chain below it has one node per level (rank 0)."""
        return (self.branches,) + (1,) * (self.length - 1)

    def ranks(self, matched: Sequence[int]) -> list[int]:
        """The accepted ranks (as `widths` models them) of a round of this lookup whose branches, best first,
        would match `matched` drafts each (more branches than it has are ignored): the first branch that matches
        the most (greedy's deepest path; the tree's ties go to the lower slot) at depth 1, then 0 down its chain;
        [] when none matches."""
        matched = list(matched[: self.branches])
        accepted = min(max(matched, default=0), self.length)
        return [matched.index(max(matched))] + [0] * (accepted - 1) if accepted else []


# A round shape: a drafter tree's level widths (() = no speculation) or a Lookup chain / forest.
Candidate = tuple[int, ...] | Lookup

DEFAULT_TREE_WIDTHS = (4, 16, 16, 16, 16)  # ALGORITHM §4.1's dynamic beam, the largest tree="auto" candidate

# The drafter candidates of tree="auto": no speculation, short chains, then beam trees up to ALGORITHM §4.1's.
AUTO_TREES: tuple[tuple[int, ...], ...] = (
    (),
    (1,),
    (1, 1),
    (1, 1, 1, 1),
    (2, 2, 2),
    (4, 4, 4),
    (4, 8, 8, 8),
    (4, 16, 16, 16),
    DEFAULT_TREE_WIDTHS,
)

# tree="auto"'s prompt-lookup candidates (GenerationConfig.auto_lookup): chains of 2 to 16 drafts, and forests of
# chains of 16 continuing several earlier occurrences. A lookup costs no drafter forward, only its n-gram match
# and the verify of its drafts, so it pays where a text repeats itself (a summary quoting its document, code).
AUTO_LOOKUPS: tuple[Lookup, ...] = (Lookup(2), Lookup(4), Lookup(8), Lookup(16), Lookup(16, 2), Lookup(16, 4))


def is_lookup(candidate) -> bool:
    """Whether a round shape drafts by prompt lookup."""
    return isinstance(candidate, Lookup)


def is_plain(candidate) -> bool:
    """Whether a round shape is a plain step (no speculation)."""
    return not is_lookup(candidate) and not candidate


def is_drafter_tree(candidate) -> bool:
    """Whether a round shape runs the drafter: level widths, not () (no speculation) nor a Lookup."""
    return isinstance(candidate, tuple) and bool(candidate)


def as_candidate(candidate) -> Candidate:
    """A candidate in its hashable form: a Lookup as it is, level widths as a tuple of ints."""
    return candidate if is_lookup(candidate) else tuple(map(int, candidate))


def candidate_depth(candidate) -> int:
    """Levels drafted by a round shape (a tree's widths, or a Lookup chain)."""
    return candidate.length if is_lookup(candidate) else len(candidate)


def max_children(candidate) -> int:
    """The most children one node of the round's tree has (0: a plain step)."""
    if is_lookup(candidate):
        return candidate.branches
    return max(candidate, default=0)


def candidate_nodes(candidate) -> int:
    """Tokens a round verifies: the root and every draft."""
    return candidate.nodes if is_lookup(candidate) else 1 + sum(candidate)


def model_widths(candidate) -> tuple[int, ...]:
    """The level widths the acceptance model sees for a round shape (a lookup's: `Lookup.widths`)."""
    return candidate.widths if is_lookup(candidate) else candidate


def candidate_order(candidate) -> tuple:
    """A sort key for round shapes (a Lookup does not compare with level widths): trees by widths, then lookups."""
    if is_lookup(candidate):
        return (1, (candidate.length, candidate.branches))
    return (0, tuple(candidate))


def shape_key(candidate, max_ngram: int) -> tuple:
    """What a round's static step depends on of its shape: a lookup's length, branches and n-gram length, or a
    tree's widths."""
    if is_lookup(candidate):
        return ("lookup", candidate.length, candidate.branches, max_ngram)
    return ("tree", tuple(candidate))


def contains(small: Candidate, big: Candidate) -> bool:
    """Whether round `small` does a part of round `big`'s work: tree `small` is a sub-tree of `big` (no more levels,
    each level no wider); a lookup is no longer and has no more branches than the other; no speculation is part of
    every round. A lookup and a drafter tree are of different families (one runs the drafter, the other an n-gram
    match): neither bounds the other's cost."""
    if not small:
        return True
    if is_lookup(small) or is_lookup(big):
        return (
            is_lookup(small)
            and is_lookup(big)
            and small.length <= big.length
            and small.branches <= big.branches
        )
    return len(small) <= len(big) and all(a <= b for a, b in zip(small, big, strict=False))


def level_ranks(candidate, path_slots: list[int]) -> list[int]:
    """Rank of each accepted node within its level (its slot minus the level's first slot): what the
    acceptance model learns from (a lookup's: its branch at depth 1, then 0 down the chain, as `Lookup.widths`
    models it). path_slots starts with the root."""
    if not candidate:
        return []
    if is_lookup(candidate):  # level 1's slots are 1..branches: the branch; one node a level below it
        accepted = len(path_slots) - 1
        return [path_slots[1] - 1] + [0] * (accepted - 1) if accepted else []
    layout = TreeLayout(candidate)
    return [slot - layout.level_slice(d).start for d, slot in enumerate(path_slots[1:], start=1)]


def tree_name(candidate) -> str:
    """'ar' for no speculation, 'lookup8' for a lookup chain of 8, 'lookup16x4' for four chains of 16, else the
    widths joined by '-' (e.g. '4-16-16'): the stats' key for a round shape."""
    if is_lookup(candidate):
        return f"lookup{candidate.length}" + (f"x{candidate.branches}" if candidate.branches > 1 else "")
    return "-".join(map(str, candidate)) if candidate else "ar"


def parse_candidate(name: str) -> Candidate:
    """The inverse of `tree_name`: 'ar' -> (), 'lookup8' -> Lookup(8), 'lookup16x4' -> Lookup(16, 4),
    '4-16-16' -> (4, 16, 16). Raises ValueError (naming what it accepts) on anything else."""
    try:
        if name == "ar":
            return ()
        if name.startswith("lookup"):
            length, _, branches = name[len("lookup") :].partition("x")
            return Lookup(int(length), int(branches or 1))
        widths = tuple(int(w) for w in name.split("-"))
        TreeLayout(widths)
        return widths
    except ValueError:
        raise ValueError(
            f"not a round shape: {name!r} (level widths like '4-16-16', a lookup like 'lookup16' or "
            "'lookup16x4', or 'ar')"
        ) from None
