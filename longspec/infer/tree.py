"""Draft trees: dynamic beam search levels and the ancestor mask, with a fixed node count per round.

Shape legend: N tree nodes (root + sum(widths)), V vocabulary, P nodes in the current level, W next level width.

A tree is stored level by level (root, then level 1, level 2, ...), so parents always precede children and the
node count, the depth of every slot and the level offsets are the same every round: only tokens, parents and the
ancestor mask change. That is what keeps a round's shapes static (CUDA-graph friendly).

Dynamic beam search (docs/ALGORITHM.md §4.1): the root's children are its top-widths[0] tokens; each next level is the global
top-widths[d] over (current level nodes x vocab) scored by the path's cumulative draft log-prob. Nodes that get no
children stay in the tree and are verified too.

Sampling with recursive rejection (T > 0, `sample_step`): a node's children are drawn from the drafter's q without
replacement (Gumbel-top-k), after each node's child budget was fixed from its parent level's path scores only;
see longspec.infer.accept.sample_path for why the budget must not depend on the drawn values.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import torch

from longspec.kernels.row_argmax import row_argmax
from longspec.modules.constants import zeros_once

__all__ = [
    "DraftTree",
    "TreeLayout",
    "beam_step",
    "chain_tree",
    "ForestParts",
    "forest_parts",
    "sample_step",
]


@dataclass(frozen=True)
class TreeLayout:
    """The static part of a tree: level widths, their offsets into the node axis, every slot's depth."""

    widths: tuple[int, ...]

    def __post_init__(self):
        if not self.widths or any(w < 1 for w in self.widths):
            raise ValueError(f"tree widths must be positive integers, got {list(self.widths)}")

    @property
    def num_nodes(self) -> int:
        return 1 + sum(self.widths)

    @property
    def depth(self) -> int:
        return len(self.widths)

    @property
    def num_parents(self) -> int:
        """Nodes that get children: every level but the last, the first nodes in level order (a sampled tree keeps
        q and draws noise for these only)."""
        return self.num_nodes - self.widths[-1]

    @property
    def is_chain(self) -> bool:
        """Every level one node wide: each node's ancestors are the nodes before it."""
        return all(w == 1 for w in self.widths)

    def needs_scores(self, level: int) -> bool:
        """Whether the path scores of level `level`'s children are read: by a later level's beam selection among
        more than one parent (`beam_step`; a chain's levels never are)."""
        return any(w > 1 for w in self.widths[level:-1])

    def level_slice(self, level: int) -> slice:
        """Node slots of level `level` (0 = root)."""
        start = 1 + sum(self.widths[: level - 1]) if level > 0 else 0
        size = 1 if level == 0 else self.widths[level - 1]
        return slice(start, start + size)

    def depths(self, device: torch.device | str | None = None) -> torch.Tensor:
        """Depth of every node slot [N]. Memoised per device: building it copies host data to the device,
        which a CUDA graph capture forbids, so the capture reuses the tensor its warm-up calls made."""
        return _depths(self.widths, torch.device(device or "cpu"))


@functools.lru_cache(maxsize=64)
def _depths(widths: tuple[int, ...], device: torch.device) -> torch.Tensor:
    depths = [0] + [level + 1 for level, width in enumerate(widths) for _ in range(width)]
    return torch.tensor(depths, dtype=torch.long, device=device)


@dataclass
class DraftTree:
    """One round's candidate tree (fields described in longspec.infer.accept), or one tree per sequence of a
    batch: every field but `depths` (the layout's, shared) may carry leading batch dims [B]."""

    tokens: torch.Tensor  # [..., N] long
    parents: torch.Tensor  # [..., N] long, root -1
    depths: torch.Tensor  # [N] long
    ancestor_mask: torch.Tensor  # [..., N, N] bool, row i: i and its ancestors
    valid: torch.Tensor  # [..., N] bool
    # [..., R, V] the q each node's children were sampled from (sampled trees), for the first R nodes, those with
    # children (`TreeLayout.num_parents`)
    draft_probs: torch.Tensor | None = None
    # Whether node i's ancestors are exactly the nodes before it (levels of width 1, PLD's drafts, an AR step):
    # known from the shape alone, so a verify can take the chain's causal attention without reading the mask.
    # With `branches` > 1, `branches` such chains from one root, level by level (a lookup forest, `forest_parts`):
    # node i's ancestors are the root and the nodes of its own chain before it, again known from the shape.
    chain: bool = False
    branches: int = 1

    @classmethod
    def empty(cls, layout: TreeLayout, root_token: torch.Tensor) -> DraftTree:
        """A tree with only the root filled in (root_token [] or [B]: one tree per sequence); levels are
        written by `set_level`."""
        device, lead = root_token.device, tuple(root_token.shape)
        n = layout.num_nodes
        tree = cls(
            tokens=torch.zeros(*lead, n, dtype=torch.long, device=device),
            parents=torch.full((*lead, n), -1, dtype=torch.long, device=device),
            depths=layout.depths(device),
            ancestor_mask=torch.zeros(*lead, n, n, dtype=torch.bool, device=device),
            valid=torch.ones(*lead, n, dtype=torch.bool, device=device),
            chain=layout.is_chain,
        )
        tree.tokens[..., 0] = root_token
        # fill_, not setitem: setitem copies a host scalar (not graph-safe)
        tree.ancestor_mask[..., 0, :1].fill_(True)
        return tree

    def set_level(self, level_slice: slice, parents: torch.Tensor, tokens: torch.Tensor) -> None:
        """Write one level: parents / tokens [..., W], parents absolute node indices of an earlier level."""
        idx = torch.arange(level_slice.start, level_slice.stop, device=self.tokens.device)
        self.tokens[..., idx] = tokens
        self.parents[..., idx] = parents
        # A node sees what its parent sees, plus itself.
        rows = parents[..., None].expand(*parents.shape, self.ancestor_mask.shape[-1])
        self.ancestor_mask[..., idx, :] = self.ancestor_mask.gather(-2, rows)
        ones = torch.ones_like(idx, dtype=torch.bool)  # a device value: graph-safe
        self.ancestor_mask[..., idx, idx] = ones

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[-1]

    @property
    def is_one_chain(self) -> bool:
        """One chain (node i's parent is node i - 1): its accepted path is its first nodes, in place."""
        return self.chain and self.branches == 1

    def per_sequence(self, fn) -> DraftTree:
        """The tree with `fn` applied to every per-sequence field (all but the layout's `depths` and `chain`)."""
        probs = None if self.draft_probs is None else fn(self.draft_probs)
        return replace(
            self,
            tokens=fn(self.tokens),
            parents=fn(self.parents),
            ancestor_mask=fn(self.ancestor_mask),
            valid=fn(self.valid),
            draft_probs=probs,
        )

    def row(self, index: int) -> DraftTree:
        """Sequence `index`'s tree of a batch of trees (views)."""
        return self.per_sequence(lambda t: t[index])

    def dynamic_part(self) -> tuple[torch.Tensor, ...]:
        """What changes between rounds of one layout: (tokens, parents, ancestor_mask, valid[, draft_probs])."""
        parts = (self.tokens, self.parents, self.ancestor_mask, self.valid)
        return parts if self.draft_probs is None else (*parts, self.draft_probs)

    @classmethod
    def from_dynamic_part(
        cls, layout: TreeLayout, tokens, parents, ancestor_mask, valid=None, draft_probs=None
    ) -> DraftTree:
        """Rebuild a tree from `dynamic_part()` (e.g. a CUDA graph's static outputs) and the layout."""
        return cls(
            tokens=tokens,
            parents=parents,
            depths=layout.depths(tokens.device),  # the layout's, shared: read only
            ancestor_mask=ancestor_mask,
            valid=torch.ones_like(tokens, dtype=torch.bool) if valid is None else valid,
            draft_probs=draft_probs,
            chain=layout.is_chain,
        )


def beam_step(
    parent_scores: torch.Tensor | None,
    draft_logits: torch.Tensor,
    width: int,
    *,
    scores: bool = True,
    ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One level of dynamic beam search.

    parent_scores [..., P] cumulative log-probs of the current level's paths (None: the root's, 0); draft_logits [..., P, V] the
    drafter's next-token logits at those nodes (leading dims: one tree per sequence of a batch). Returns
    (parent_local [..., W] index into the P nodes, tokens [..., W], scores [..., W]), the global top-W of
    parent_scores[..., None] + log_softmax(draft_logits) per tree, best first. (parent, token) pairs are
    distinct, so siblings never repeat a token (acceptance relies on that).

    Each of the global top-W is among its own parent's top-W, so the selection runs over P x W candidates
    instead of P x V (a top-k over 16 x 128K scores per level at Llama-3's vocabulary), and log_softmax is
    applied to those candidates alone.

    With one parent the selection is its own top-W and the normalisation does not
    change it: `scores=False` (a level whose scores no later selection reads, `TreeLayout.needs_scores`) returns
    None for them and skips the log-sum-exp; a width of one is then one argmax, and its parent_local a shared
    constant. (Each saved op is a kernel launch in a drafting round.)

    `ids` [V]: the logits' columns are draft ids and the tokens are returned as these ids (a draft vocabulary's
    map to target ids; in the argmax's own launch where there is one)."""
    num_parents, vocab = draft_logits.shape[-2:]
    if width > num_parents * vocab:
        raise ValueError(f"tree level width {width} exceeds {num_parents} nodes x vocab {vocab}")
    if num_parents == 1 and not scores:  # the parent's own top-W; a [..., 1, V] row
        if width == 1:
            tokens = row_argmax(draft_logits, ids)  # [..., 1]
        else:
            tokens = _mapped(draft_logits.topk(width, dim=-1).indices[..., 0, :], ids)  # [..., W]
        return zeros_once(width, tokens.device).expand_as(tokens), tokens, None
    logits = draft_logits.float()
    per_parent = min(width, vocab)
    top, index = logits.topk(per_parent, dim=-1)  # [..., P, k]
    candidates = top - logits.logsumexp(-1, keepdim=True)
    if parent_scores is not None:  # None: the root's paths, score 0
        candidates = parent_scores[..., None] + candidates
    top_scores, flat = candidates.flatten(-2).topk(width, dim=-1)
    return flat // per_parent, _mapped(index.flatten(-2).gather(-1, flat), ids), top_scores


def _mapped(tokens: torch.Tensor, ids: torch.Tensor | None) -> torch.Tensor:
    """Draft ids -> the ids `ids` maps them to (unchanged without a map)."""
    return tokens if ids is None else ids[tokens]


# A later child of the same parent is worth this factor less than the previous one when budgets are shared out
# (a rough prior on how acceptance falls with a candidate's draw rank; any fixed rule keeps sampling lossless).
_BUDGET_DECAY = math.log(2.0)


def sample_step(
    parent_scores: torch.Tensor | None,
    draft_probs: torch.Tensor,
    noise: torch.Tensor,
    width: int,
    *,
    scores: bool = True,
    ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """One level of a SAMPLED tree (T > 0, recursive rejection acceptance), for one tree or a batch of trees.

    parent_scores [..., P] path log-q of the current level's nodes (-inf: invalid node; None: the root's, 0),
    draft_probs [..., P, V] the q each node's children are drawn from, noise [..., P, V] i.i.d. Exp(1); the
    leading dims (none, or B trees) are independent. Returns (parent_local, tokens, scores, valid), each [..., W]; a parent's children
    appear in draw order.

    1. Budgets first, from parent_scores alone: slot (i, j) = "the j-th child of node i" is worth
       parent_scores[i] - j * log 2; the level takes the W best slots (a parent's slots form a prefix 0..b_i - 1),
       never more than q_i's support. Nothing drawn at this level enters the budget.
    2. Then each node's children: the top-b_i of q_i / E (E ~ Exp(1): the "exponential race", whose arrival
       times E / q_i order the tokens as successive draws from q_i without replacement; = Gumbel-top-k on
       log q_i - log E) are b_i draws from q_i without replacement, in draw order.
    Slots past every parent's support are filled with invalid nodes (fixed shapes), never accepted.

    `scores=False` (no later level reads this level's path scores, `TreeLayout.needs_scores`) with one parent
    and W = 1 (a chain's level) is one draw, the race's winner: its budget is the one slot, always valid (q has
    at least one token), so (zeros, tokens, None, None) (valid None: every node valid) in three launches.

    `ids` [V]: q's columns are draft ids and the tokens are returned as these ids (a draft vocabulary's map to
    target ids).
    """
    lead, (num_parents, vocab) = draft_probs.shape[:-2], draft_probs.shape[-2:]
    if num_parents == 1 and width == 1 and not scores:
        tokens = row_argmax(draft_probs / noise, ids)  # [..., 1]
        return zeros_once(1, tokens.device).expand_as(tokens), tokens, None, None
    if parent_scores is None:
        parent_scores = torch.zeros(*lead, num_parents, device=draft_probs.device)
    parent_scores = parent_scores.reshape(-1, num_parents)  # [B, P] (B = 1 for one tree)
    draft_probs = draft_probs.reshape(-1, num_parents, vocab)
    noise = noise.reshape(-1, num_parents, vocab)
    k = min(width, vocab)
    support = (draft_probs > 0).sum(-1)  # [B, P]
    rank = torch.arange(k, device=draft_probs.device)
    worth = parent_scores[..., None].float() - rank * _BUDGET_DECAY  # [B, P, k]
    worth = worth.masked_fill(rank >= support[..., None], float("-inf"))
    if width > num_parents * k:
        raise ValueError(f"tree level width {width} exceeds {num_parents} nodes x {k} candidates")
    slot_worth, flat = torch.topk(worth.flatten(1), width)  # [B, W]: slot = parent_local * k + child rank
    parent_local = flat // k
    draws = torch.topk(draft_probs.float() / noise, k, dim=-1).indices  # [B, P, k] draw order
    tokens = draws.flatten(1).gather(1, flat)  # draws[b, parent_local, child rank]
    valid = torch.isfinite(slot_worth)
    # log q of the chosen tokens (log_q[b, parent_local, tokens]), taken after the gather: W values, not P x V
    chosen_q = draft_probs.flatten(1).gather(1, parent_local * vocab + tokens).float()
    scores = torch.where(valid, parent_scores.gather(1, parent_local) + torch.log(chosen_q), float("-inf"))
    return tuple(x.reshape(*lead, width) for x in (parent_local, _mapped(tokens, ids), scores, valid))


def forest_parts(batch: int, length: int, branches: int, device) -> tuple[torch.Tensor, ...]:
    """The constant parts (parents [B, N], depths [N], ancestor_mask [B, N, N]) of `branches` chains of `length`
    nodes from one root, N = 1 + length * branches, stored level by level like every tree: level d's node of
    chain i at slot 1 + (d - 1) * branches + i, its parent the same chain's node a level up (the root at depth 1).
    branches = 1 is a chain (length 0: the root alone, a plain step's tree)."""
    idx = torch.arange(1 + length * branches, device=device)
    depths = torch.where(idx > 0, (idx - 1) // branches + 1, 0)
    parents = torch.where(idx > branches, idx - branches, torch.where(idx > 0, 0, -1))
    branch = (idx - 1) % branches
    # j is an ancestor of i (or i): the root, or i's own chain at a depth <= i's
    ancestor = (idx[None, :] == 0) | (
        (idx[None, :] > 0) & (branch[None, :] == branch[:, None]) & (idx[None, :] <= idx[:, None])
    )
    return (
        parents.expand(batch, -1).contiguous(),
        depths,
        ancestor.expand(batch, -1, -1).contiguous(),
    )


class ForestParts:
    """`forest_parts` made once per (batch, length, branches) on one device, with `valid` (every node valid: a
    plain round's and a drafter chain's): the rounds of a chain shape build no tree (on the GPU each op would be
    a launch, inside or outside the captured steps, in rounds that should cost about one AR step). The tensors
    are shared by every round: nothing may write to them."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self._made: dict[tuple[int, int, int], tuple[torch.Tensor, ...]] = {}

    def __call__(self, batch: int, length: int, branches: int = 1) -> tuple[torch.Tensor, ...]:
        """(parents [B, N], depths [N], ancestor_mask [B, N, N], valid [B, N]) of `branches` chains of `length`."""
        key = (batch, length, branches)
        if key not in self._made:
            parents, depths, ancestor_mask = forest_parts(batch, length, branches, self.device)
            self._made[key] = (parents, depths, ancestor_mask, torch.ones_like(parents, dtype=torch.bool))
        return self._made[key]


def chain_tree(
    root_token: torch.Tensor, draft_tokens: torch.Tensor, num_valid: int | torch.Tensor, num_nodes: int
) -> DraftTree:
    """A chain root -> d1 -> d2 ... padded to `num_nodes` (PLD, AR): padding nodes are invalid, never accepted.
    root_token [] or [B]; draft_tokens [..., k]; num_valid an int or [B] (valid drafts per sequence)."""
    device, lead = root_token.device, tuple(root_token.shape)
    draft_tokens = draft_tokens[..., : num_nodes - 1]
    num_drafts = draft_tokens.shape[-1]
    tokens = torch.zeros(*lead, num_nodes, dtype=torch.long, device=device)
    tokens[..., 0] = root_token
    tokens[..., 1 : 1 + num_drafts] = draft_tokens
    parents, idx, ancestor_mask = forest_parts(1, num_nodes - 1, 1, device)  # a chain: depth = slot
    if isinstance(num_valid, torch.Tensor):
        valid = idx <= num_valid.clamp(max=num_drafts)[..., None]
    else:
        valid = (idx <= min(num_valid, num_drafts)).expand(*lead, num_nodes)
    return DraftTree(
        tokens=tokens,
        parents=parents[0].expand(*lead, num_nodes),
        depths=idx,
        ancestor_mask=ancestor_mask[0].expand(*lead, num_nodes, num_nodes),
        valid=valid,
        chain=True,
    )
