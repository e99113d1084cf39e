"""The round shapes a longspec round may run, as types that carry their behaviour: `Plain` (no speculation),
`DrafterTree` (the drafter's tree, by level widths, e.g. (4, 16, 16)) and `Lookup` (a prompt-lookup chain or
forest). The rest of `longspec.infer` asks a shape what it does (drafts with the drafter, its depth, its name, the
ranks its accepted path shows, which proposer builds its tree) and never tests its type. User input (a name such
as '4-16-16' or 'lookup16x4', level widths) becomes a shape in `as_shape` / `parse`; a shape's `name` is the key
of stats, reports and the round-cost tables on disk.
"""

from __future__ import annotations

import operator
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

from longspec.infer.tree import DraftTree, TreeLayout

__all__ = [
    "AUTO_LOOKUPS",
    "AUTO_TREES",
    "DEFAULT_TREE_WIDTHS",
    "DrafterTree",
    "Lookup",
    "Plain",
    "Proposer",
    "RoundShape",
    "as_shape",
    "parse",
]


class Proposer(Protocol):
    """What builds a round's tree [B, N], one method per shape (`RoundShape.propose` calls its own)."""

    def plain(self) -> DraftTree: ...

    def drafter_tree(self, tree: DrafterTree) -> DraftTree: ...

    def lookup(self, lookup: Lookup) -> DraftTree: ...


@dataclass(frozen=True)
class RoundShape(ABC):
    """What one round runs. Frozen and hashable (a key of cost tables and policies); every shape answers the same
    questions, so no caller needs to know which one it holds."""

    # Whether it drafts anything (every shape but the plain step: a tree has a level, a lookup a draft); whether
    # its round drafts with the drafter (its ring must be caught up first) or by prompt lookup.
    speculates: ClassVar[bool] = True
    drafts_with_drafter: ClassVar[bool] = False
    drafts_by_lookup: ClassVar[bool] = False
    # `sort_key`'s and `contains`'s family: the drafter's (plain steps among them) 0, the lookups' 1.
    _family: ClassVar[int] = 0

    def __bool__(self):
        # No truth value: every shape, the plain step too, is a round; `if shape` would read as "speculates" to
        # some and as "is a shape" to others.
        raise TypeError(f"{self!r} has no truth value: ask .speculates")

    @property
    @abstractmethod
    def depth(self) -> int:
        """Levels it drafts (0: a plain step)."""

    @property
    @abstractmethod
    def nodes(self) -> int:
        """Tokens its round verifies: the root and every draft."""

    @property
    @abstractmethod
    def max_children(self) -> int:
        """The most children one node of its tree has (0: a plain step)."""

    @property
    @abstractmethod
    def model_widths(self) -> tuple[int, ...]:
        """The level widths the acceptance model sees for it."""

    @property
    @abstractmethod
    def name(self) -> str:
        """Its name: the stats' and reports' key, and `parse`'s input ('ar', '4-16-16', 'lookup8', 'lookup16x4')."""

    @property
    @abstractmethod
    def config_value(self):
        """How `GenerationConfig.tree` records it (level widths as a tuple of ints, a lookup as itself): the form
        results.json's config and the eval's resume key hold."""

    @property
    @abstractmethod
    def _extent(self) -> tuple[int, ...]:
        """What `sort_key` orders and `contains` compares level by level within a family."""

    @property
    def sort_key(self) -> tuple:
        """A sort key over every shape (a lookup does not compare with level widths): the drafter's shapes by
        widths, then the lookups by (length, branches)."""
        return (self._family, self._extent)

    @abstractmethod
    def shape_key(self, max_ngram: int) -> tuple:
        """What a round's static step depends on of its shape (a lookup's also on the n-gram length)."""

    def contains(self, other: RoundShape) -> bool:
        """Whether round `other` does a part of this round's work: a plain step is part of every round; a drafter
        tree contains the trees with no more levels, each level no wider; a lookup the lookups no longer and with
        no more branches. A lookup and a drafter tree are of different families (one runs the drafter, the other
        an n-gram match): neither bounds the other's cost."""
        if not other.speculates:
            return True
        small, big = other._extent, self._extent
        return (
            other._family == self._family
            and len(small) <= len(big)
            and all(a <= b for a, b in zip(small, big, strict=False))
        )

    @abstractmethod
    def level_ranks(self, path_slots: Sequence[int]) -> list[int]:
        """Rank of each accepted node within its level, as `model_widths` models it: what the acceptance model
        learns from. `path_slots` (the accepted path's node slots) starts with the root."""

    @abstractmethod
    def propose(self, proposer: Proposer) -> DraftTree:
        """Its round's tree, built by `proposer`'s method for this shape."""


@dataclass(frozen=True)
class Plain(RoundShape):
    """No speculation: the round verifies its root alone (an AR step on the engine)."""

    speculates: ClassVar[bool] = False

    @property
    def depth(self) -> int:
        return 0

    @property
    def nodes(self) -> int:
        return 1

    @property
    def max_children(self) -> int:
        return 0

    @property
    def model_widths(self) -> tuple[int, ...]:
        return ()

    @property
    def name(self) -> str:
        return "ar"

    @property
    def config_value(self) -> tuple[int, ...]:
        return ()

    @property
    def _extent(self) -> tuple[int, ...]:
        return ()

    def shape_key(self, max_ngram: int) -> tuple:
        return ("tree", ())

    def level_ranks(self, path_slots: Sequence[int]) -> list[int]:
        return []

    def propose(self, proposer: Proposer) -> DraftTree:
        return proposer.plain()


@dataclass(frozen=True)
class DrafterTree(RoundShape):
    """The drafter's dynamic-beam tree (ALGORITHM §4.1): `widths[d]` nodes at level d + 1, at least one level,
    every width positive."""

    widths: tuple[int, ...]

    drafts_with_drafter: ClassVar[bool] = True

    def __post_init__(self):
        object.__setattr__(self, "widths", tuple(operator.index(w) for w in self.widths))
        TreeLayout(self.widths)  # validates: a ValueError naming the widths

    @property
    def layout(self) -> TreeLayout:
        """Its static tree layout (level offsets, every slot's depth)."""
        return TreeLayout(self.widths)

    @property
    def depth(self) -> int:
        return len(self.widths)

    @property
    def nodes(self) -> int:
        return 1 + sum(self.widths)

    @property
    def max_children(self) -> int:
        return max(self.widths)

    @property
    def model_widths(self) -> tuple[int, ...]:
        return self.widths

    @property
    def name(self) -> str:
        return "-".join(map(str, self.widths))

    @property
    def config_value(self) -> tuple[int, ...]:
        return self.widths

    @property
    def _extent(self) -> tuple[int, ...]:
        return self.widths

    def shape_key(self, max_ngram: int) -> tuple:
        return ("tree", self.widths)

    def level_ranks(self, path_slots: Sequence[int]) -> list[int]:
        layout = self.layout
        return [slot - layout.level_slice(d).start for d, slot in enumerate(path_slots[1:], start=1)]

    def propose(self, proposer: Proposer) -> DraftTree:
        return proposer.drafter_tree(self)


@dataclass(frozen=True)
class Lookup(RoundShape):
    """A round shape that drafts by prompt lookup instead of the drafter (longspec.infer.pld): `branches` chains
    of `length` drafts from the round's root, each continuing another earlier occurrence of the context's last
    n-gram (`pld.prompt_lookups`), padded with invalid nodes where a match is shorter or missing, verified
    together (a forest, `tree.forest_parts`). One branch is PLD's chain."""

    length: int
    branches: int = 1

    drafts_by_lookup: ClassVar[bool] = True
    _family: ClassVar[int] = 1

    def __post_init__(self):
        if self.length < 1 or self.branches < 1:
            raise ValueError(
                f"a lookup needs at least one draft and one branch, got {self.length} x {self.branches}"
            )

    @property
    def depth(self) -> int:
        return self.length

    @property
    def nodes(self) -> int:
        return 1 + self.length * self.branches

    @property
    def max_children(self) -> int:
        return self.branches

    @property
    def model_widths(self) -> tuple[int, ...]:
        """The branch is chosen at depth 1 (the accepted path's rank there is its branch), and the chain below it
        has one node per level (rank 0)."""
        return (self.branches,) + (1,) * (self.length - 1)

    @property
    def name(self) -> str:
        return f"lookup{self.length}" + (f"x{self.branches}" if self.branches > 1 else "")

    @property
    def config_value(self) -> Lookup:
        return self

    @property
    def _extent(self) -> tuple[int, ...]:
        return (self.length, self.branches)

    def shape_key(self, max_ngram: int) -> tuple:
        return ("lookup", self.length, self.branches, max_ngram)

    def level_ranks(self, path_slots: Sequence[int]) -> list[int]:
        # level 1's slots are 1..branches: the branch; one node a level below it
        accepted = len(path_slots) - 1
        return [path_slots[1] - 1] + [0] * (accepted - 1) if accepted else []

    def ranks(self, matched: Sequence[int]) -> list[int]:
        """The accepted ranks (as `model_widths` models them) of a round of this lookup whose branches, best
        first, would match `matched` drafts each (more branches than it has are ignored): the first branch that
        matches the most (greedy's deepest path; the tree's ties go to the lower slot) at depth 1, then 0 down
        its chain; [] when none matches."""
        matched = list(matched[: self.branches])
        accepted = min(max(matched, default=0), self.length)
        return [matched.index(max(matched))] + [0] * (accepted - 1) if accepted else []

    def propose(self, proposer: Proposer) -> DraftTree:
        return proposer.lookup(self)


DEFAULT_TREE_WIDTHS = (4, 16, 16, 16, 16)  # ALGORITHM §4.1's dynamic beam, the largest tree="auto" candidate

# The drafter candidates of tree="auto": no speculation, short chains, then beam trees up to ALGORITHM §4.1's.
AUTO_TREES: tuple[RoundShape, ...] = (
    Plain(),
    DrafterTree((1,)),
    DrafterTree((1, 1)),
    DrafterTree((1, 1, 1, 1)),
    DrafterTree((2, 2, 2)),
    DrafterTree((4, 4, 4)),
    DrafterTree((4, 8, 8, 8)),
    DrafterTree((4, 16, 16, 16)),
    DrafterTree(DEFAULT_TREE_WIDTHS),
)

# tree="auto"'s prompt-lookup candidates (GenerationConfig.auto_lookup): chains of 2 to 16 drafts, and forests of
# chains of 16 continuing several earlier occurrences. A lookup costs no drafter forward, only its n-gram match
# and the verify of its drafts, so it pays where a text repeats itself (a summary quoting its document, code).
AUTO_LOOKUPS: tuple[Lookup, ...] = (Lookup(2), Lookup(4), Lookup(8), Lookup(16), Lookup(16, 2), Lookup(16, 4))


def parse(name: str) -> RoundShape:
    """The shape a name stands for (the inverse of `RoundShape.name`): 'ar' -> Plain(), 'lookup8' -> Lookup(8),
    'lookup16x4' -> Lookup(16, 4), '4-16-16' -> DrafterTree((4, 16, 16)). Raises ValueError (naming what it
    accepts) on anything else."""
    try:
        if name == "ar":
            return Plain()
        if name.startswith("lookup"):
            length, _, branches = name[len("lookup") :].partition("x")
            return Lookup(int(length), int(branches or 1))
        return DrafterTree(tuple(int(w) for w in name.split("-")))
    except ValueError:
        raise ValueError(
            f"not a round shape: {name!r} (level widths like '4-16-16', a lookup like 'lookup16' or "
            "'lookup16x4', or 'ar')"
        ) from None


def as_shape(value) -> RoundShape:
    """User input as a round shape: a shape as it is, a name (`parse`), or level widths (a sequence of integers:
    a list, tuple or tensor; empty: no speculation). A TypeError names anything else (a bare int, a float
    width); a ValueError, widths that are no tree (a width below 1)."""
    if isinstance(value, RoundShape):
        return value
    if isinstance(value, str):
        return parse(value)
    if isinstance(value, bytes) or not hasattr(value, "__iter__"):
        raise TypeError(
            f"not a round shape: {value!r} (level widths like (4, 16, 16), or a name like '4-16-16', 'lookup16' "
            "or 'ar')"
        )
    widths = list(value)
    try:
        if any(isinstance(w, bool) for w in widths):
            raise TypeError
        widths = [operator.index(w) for w in widths]
    except TypeError:
        raise TypeError(
            f"not a round shape: {value!r} (level widths must be integers, like (4, 16, 16))"
        ) from None
    return DrafterTree(tuple(widths)) if widths else Plain()
