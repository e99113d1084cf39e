"""How to decode: `GenerationConfig`, the settings of one `SpeculativeEngine.generate` (or `run_method`) call,
checked when built; the eval checks its own settings by building one.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any

import torch

from longspec.infer.candidates import AUTO_LOOKUPS, AUTO_TREES, DrafterTree, RoundShape, as_shape

__all__ = ["GenerationConfig", "SAMPLING_RULES"]

SAMPLING_RULES = ("rrs", "deterministic")
# GenerationConfig's integer fields (top_k may also be None)
_INT_FIELDS = (
    "max_new_tokens", "top_k", "pld_num_draft", "pld_max_ngram", "prefill_chunk", "seed", "shrink_min_tokens",
)  # fmt: skip


@dataclass(kw_only=True)
class GenerationConfig:
    """How to decode. Sampling settings shape the TARGET distribution only; output stays lossless."""

    max_new_tokens: int = 256  # tokens to generate, the prefill's first token included
    temperature: float = 0.0  # 0 = greedy
    top_k: int | None = None  # keep the k most likely target tokens (T > 0)
    top_p: float | None = None  # nucleus truncation of the target distribution (T > 0)
    eos_token_ids: tuple[int, ...] = ()  # stop after emitting any of these
    # longspec's tree: "auto" (adaptive per round, longspec.infer.policy), fixed level widths, or one round shape
    # by name (`RoundShape.name`: "4-16-16", a lookup "lookup16" / forest "lookup16x4", every round) or as a
    # `candidates.RoundShape`, kept as level widths or a Lookup (`RoundShape.config_value`); a fixed
    # `tree_widths` given by the user wins over `tree`. At T > 0 every tree samples the target's distribution
    # exactly, but with "auto" the trees chosen depend on measured round times (and on what earlier calls
    # learned), so a seed does not pin the sample: fix the tree for reproducible sampling.
    tree: Any = "auto"  # typed Any (a name, widths or a RoundShape) so the eval config can nest this schema
    tree_widths: tuple[int, ...] | None = None
    # tree="auto" also weighs prompt-lookup chains (policy.AUTO_LOOKUPS: n-gram drafts from the sequence's own
    # text, pld_max_ngram long) against the drafter's trees and a plain step each round; False: drafter trees and
    # plain steps only. A fixed tree runs no lookups.
    auto_lookup: bool = True
    # T > 0: "rrs" = children sampled from the drafter's q, recursive rejection sampling; "deterministic" = the
    # drafter's top candidates, accepted by p alone (both lossless; longspec.infer.accept.sample_path).
    sampling_rule: str = "rrs"
    pld_num_draft: int = 10  # PLD: tokens proposed per round
    pld_max_ngram: int = 3  # PLD and tree="auto"'s lookup chains: longest n-gram matched against the context
    prefill_chunk: int = 4096  # target prefill tokens per forward
    seed: int = 0  # sampling RNG seed (T > 0)
    static_shapes: bool = False  # rounds read the cache length from the device (what a CUDA graph replays)
    # Capture each round's draft and target forward in CUDA graphs (implies static_shapes).
    cuda_graphs: bool = False
    # On static shapes a batch moves to its smaller bucket once at most half of it still runs, and only while
    # its running rows may still generate this many tokens (max_new_tokens minus what they have): the first
    # shrink to a bucket builds (with graphs: captures) that bucket's steps, every tree's draft, verify and
    # commit, a few eager forwards each, which the last rounds before max_new_tokens never win back (rows
    # of one batch reach max_new_tokens a few rounds apart). 0: shrink whenever half the batch has finished.
    shrink_min_tokens: int = 64
    # tree="auto": measure the round costs again instead of reading the table an earlier run stored on disk
    # (`policy.cost_cache`: per device, model shape, dtype and code)
    remeasure_costs: bool = False

    @property
    def static(self) -> bool:
        """Whether rounds run on static shapes: asked for, or implied by cuda_graphs."""
        return self.static_shapes or self.cuda_graphs

    def __post_init__(self):
        # Types first, so a wrong one is one error naming its field: else a float max_new_tokens would reach the
        # cache's allocation (a TypeError from torch.zeros), a seed of None the RNG, a str a bare comparison.
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if not (value is None and name == "top_k") and not _is_int(value):
                raise TypeError(f"{name} must be an integer, got {value!r}")
            if value is not None:
                setattr(self, name, int(value))  # a numpy / 0-d tensor integer: a plain int
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if value is None and name == "top_p":
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(f"{name} must be a number, got {value!r}")
            setattr(self, name, float(value))
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")
        if self.shrink_min_tokens < 0:
            raise ValueError(f"shrink_min_tokens must be >= 0, got {self.shrink_min_tokens}")
        if self.prefill_chunk < 1 or self.pld_num_draft < 1 or self.pld_max_ngram < 1:
            raise ValueError("prefill_chunk, pld_num_draft and pld_max_ngram must be >= 1")
        self.eos_token_ids = _eos_ids(self.eos_token_ids)
        if self.tree_widths is not None:
            self.tree_widths = _widths("tree_widths", self.tree_widths)
            DrafterTree(self.tree_widths)  # validates the widths
        if not (isinstance(self.tree, str) and self.tree == "auto"):
            try:
                shape = as_shape(self.tree)  # a name, level widths or a RoundShape
            except TypeError as error:
                raise TypeError(f"tree must be 'auto' or a round shape: {error}") from None
            if not shape.speculates:
                raise ValueError(f"tree={self.tree!r} is no speculation: use method='ar'")
            self.tree = shape.config_value
        if not isinstance(self.remeasure_costs, bool):
            raise ValueError(f"remeasure_costs must be true or false, got {self.remeasure_costs!r}")
        if not isinstance(self.auto_lookup, bool):
            raise ValueError(f"auto_lookup must be true or false, got {self.auto_lookup!r}")
        if self.sampling_rule not in SAMPLING_RULES:
            raise ValueError(f"sampling_rule must be one of {SAMPLING_RULES}, got {self.sampling_rule!r}")

    @property
    def fixed_tree(self) -> RoundShape | None:
        """The user's fixed round shape (tree_widths, else `tree`'s), or None for tree="auto"."""
        if self.tree_widths is not None:
            return DrafterTree(self.tree_widths)
        return None if self.tree == "auto" else as_shape(self.tree)

    @property
    def candidates(self) -> tuple[RoundShape, ...]:
        """Every round shape a longspec round may run: the fixed one, or tree="auto"'s drafter shapes (a plain
        step among them) and, with auto_lookup, its lookups."""
        if (fixed := self.fixed_tree) is not None:
            return (fixed,)
        return AUTO_TREES + (AUTO_LOOKUPS if self.auto_lookup else ())

    @property
    def trees(self) -> tuple[RoundShape, ...]:
        """The candidates that are no lookup: drafter trees and the plain step."""
        return tuple(c for c in self.candidates if not c.drafts_by_lookup)

    @property
    def max_round_nodes(self) -> int:
        """The most tokens one round of any method verifies (sizes the cache's slack)."""
        return max(1 + self.pld_num_draft, *(c.nodes for c in self.candidates))

    @property
    def rrs(self) -> bool:
        """Whether longspec's trees are sampled from the drafter's q (T > 0 with the "rrs" rule)."""
        return self.temperature > 0 and self.sampling_rule == "rrs"


def _is_int(value) -> bool:
    """An integer (Python, numpy or a 0-d integer tensor), not a bool, float or str."""
    if isinstance(value, torch.Tensor):
        return value.dim() == 0 and not value.dtype.is_floating_point and value.dtype != torch.bool
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _eos_ids(value) -> tuple[int, ...]:
    """eos_token_ids as a tuple of ints. One id (`tokenizer.eos_token_id`, an int or 0-d tensor) and None (a
    tokenizer without one) are taken too: an int raised "'int' object is not iterable", and a str "12" was read
    as the ids (1, 2)."""
    if value is None:
        return ()
    if _is_int(value):
        return (int(value),)
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise TypeError(f"eos_token_ids must be token ids (an int or a sequence of ints), got {value!r}")
    ids = list(value)
    if not all(_is_int(t) for t in ids):
        raise TypeError(f"eos_token_ids must be token ids (an int or a sequence of ints), got {value!r}")
    return tuple(int(t) for t in ids)


def _widths(name: str, value) -> tuple[int, ...]:
    """Field `name`'s level widths given as a sequence of ints (a list, tuple or tensor): an int or a str raised a
    bare "'int' object is not iterable" / "invalid literal for int()", naming no field."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        hint = " (a round shape's name goes in tree=)" if isinstance(value, str) else ""
        raise TypeError(f"{name} must be a sequence of level widths like (4, 16, 16), got {value!r}{hint}")
    widths = list(value)
    if not all(_is_int(w) for w in widths):
        raise TypeError(f"{name} must be a sequence of integer level widths like (4, 16, 16), got {value!r}")
    return tuple(int(w) for w in widths)
