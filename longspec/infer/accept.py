"""Acceptance of a verified draft tree: small pure functions, greedy (T = 0) and lossless sampling (T > 0).

Shape legend: N tree nodes (node 0 is the root, parents precede children), V vocabulary.
A tree is given by `tokens [N]`, `parents [N]` (root: -1), `depths [N]`, `ancestor_mask [N, N]`
(row i is True at i and at every ancestor of i) and `valid [N]` (padding nodes, e.g. short PLD drafts, are False).
The target's output at node i is its prediction for the token *after* node i, i.e. for i's children.

Both rules return `(path, bonus)`: `path` the accepted node indices from the root down (always starts with 0; the
root itself was emitted last round), `bonus` the token the target emits after the deepest accepted node.
Tokens emitted this round = tokens[path[1:]] + [bonus], so a round emits len(path) tokens for one target forward.

`greedy_accept` / `sample_accept` are the plain references (variable-length path, host walk for sampling). The
engine runs `greedy_path` / `sample_path`: the same rules on fixed-shape device tensors (path padded to
[depth + 1] plus its length, no host value read), so a round needs no host sync until its emitted tokens are
copied out. `sample_path` also runs recursive rejection sampling against the drafter's probabilities q
(`draft_probs`), for trees whose children were SAMPLED from q without replacement (longspec.infer.tree.sample_step).
"""

from __future__ import annotations

import torch

from longspec.kernels.bonus_sampling import inverse_cdf, sample_bonus_naive
from longspec.kernels.chain_accept import emitted_tokens, greedy_chain_path, sample_chain_decide
from longspec.kernels.row_softmax import row_softmax
from longspec.kernels.tree_sampling import child_table, sample_walk_naive
from longspec.modules.constants import arange_once

__all__ = [
    "target_distribution",
    "greedy_accept",
    "sample_accept",
    "sample_token",
    "children_lists",
    "greedy_chain_path",
    "greedy_path",
    "sample_path",
    "sample_chain_path",
    "emitted_tokens",
]


def target_distribution(
    logits: torch.Tensor, *, temperature: float, top_k: int | None = None, top_p: float | None = None
) -> torch.Tensor:
    """target_probs [..., V] (fp32) after temperature, then top-k, then top-p (nucleus) truncation.

    Both truncations keep at least the most likely token. Only the target's distribution is shaped this way:
    the lossless guarantee is about sampling from exactly this distribution. Its softmaxes are `row_softmax`
    (on CUDA a Triton kernel summing in another order than torch.softmax: the last bits differ from torch's, the
    same for every method, the AR baseline included).
    """
    if temperature <= 0:
        raise ValueError(
            f"target_distribution needs temperature > 0 (got {temperature}); use greedy_accept for T=0"
        )
    logits = logits.float()
    if temperature != 1.0:  # (x / 1.0 == x: one launch fewer per sampled step at T = 1)
        logits = logits / temperature
    if top_k is not None and 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and 0.0 < top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = row_softmax(sorted_logits)
        # Drop a token when the mass strictly before it already reaches top_p (so the first token always stays).
        drop_sorted = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return row_softmax(logits)


def greedy_accept(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    depths: torch.Tensor,
    ancestor_mask: torch.Tensor,
    target_argmax: torch.Tensor,
    valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """T = 0: the deepest node whose whole path equals the target's argmax at each parent, plus the bonus.

    match[i]    = tokens[i] == target_argmax[parents[i]]       (root: True)
    accepted[i] = AND of match[j] over ancestors-or-self j of i
    Siblings carry distinct tokens, so at most one node per depth is accepted and the accepted set is one path.
    Returns (path [k+1] long, bonus [] long), on the input device; only `path`'s length needs the host.
    """
    match = tokens == target_argmax[parents.clamp(min=0)]
    match[0] = True
    if valid is not None:
        match &= valid
    accepted = ~(ancestor_mask & ~match[None, :]).any(dim=-1)
    deepest = torch.argmax(torch.where(accepted, depths, torch.full_like(depths, -1)))
    path = torch.nonzero(ancestor_mask[deepest], as_tuple=False).flatten()  # ascending = root first
    return path, target_argmax[deepest]


def children_lists(parents: torch.Tensor, valid: torch.Tensor | None = None) -> list[list[int]]:
    """children[i] = valid children of node i in index order (the drafter's score order within a level)."""
    parents_list = parents.tolist()
    valid_list = [True] * len(parents_list) if valid is None else valid.tolist()
    children: list[list[int]] = [[] for _ in parents_list]
    for node, parent in enumerate(parents_list):
        if parent >= 0 and valid_list[node]:
            children[parent].append(node)
    return children


def sample_accept(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    target_probs: torch.Tensor,
    valid: torch.Tensor | None = None,
    *,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """T > 0, lossless for deterministic candidates (docs/ALGORITHM.md §4.3; not upstream's rule).

    At node u with target_probs p = target_probs[u] and candidate children c1..cm (distinct tokens, chosen by the
    drafter without sampling, so there are no draft_probs to correct for):
        walk i = 1..m: accept ci with probability p(ci) / (1 - sum_{j<i} p(cj))      (= p_residual(ci) / sum p_residual)
                       on accept: descend into ci and repeat there;  on reject: p(ci) := 0 (renormalise)
        all rejected:  bonus ~ p with c1..cm zeroed, renormalised.
    Why it is exact: P(emit ci) = prod_{j<i}(1 - p(cj)/(1 - sum_{l<j} p(cl))) * p(ci)/(1 - sum_{j<i} p(cj))
    = (1 - sum_{j<i} p(cj)) * p(ci) / (1 - sum_{j<i} p(cj)) = p(ci)   (the product telescopes), and
    P(emit x not a child) = (1 - sum_j p(cj)) * p(x) / (1 - sum_j p(cj)) = p(x). Descending into ci then samples the
    next token from the target's distribution conditioned on ci, by the same argument, so every emitted token
    is an exact target sample.

    Host work is one small gather per visited node (its children's probabilities), never the [N, V] matrix.
    Returns (path [k+1] long, bonus [] long) with path on the CPU and bonus on target_probs' device.
    """
    children = children_lists(parents, valid)
    token_list = tokens.tolist()
    node, path = 0, [0]
    while True:
        kids = children[node]
        probs = target_probs[node]
        kid_probs = probs[tokens[kids]].double().cpu().tolist() if kids else []  # host sync (small)
        uniforms = torch.rand(len(kids), generator=generator, dtype=torch.float64).tolist()
        rejected: list[int] = []
        rejected_mass = 0.0
        chosen = None
        for i, kid in enumerate(kids):
            remaining = 1.0 - rejected_mass
            if uniforms[i] * remaining < kid_probs[i]:
                chosen = kid
                break
            rejected.append(token_list[kid])
            rejected_mass += kid_probs[i]
        if chosen is None:
            residual = probs.clone()
            if rejected:
                residual[torch.tensor(rejected, device=probs.device)] = 0.0
            # Children holding ~all the mass are all rejected only through rounding: fall back to p itself.
            if not bool(residual.sum() > 0):  # host sync
                residual = probs
            return torch.tensor(path, dtype=torch.long), _sample_index(residual, generator)
        path.append(chosen)
        node = chosen


def uniforms(shape, generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """float64 uniforms on `device`, drawn on the generator's own device (a CPU generator drives any device:
    the draw is then one host-to-device copy, never a device-to-host sync)."""
    source = generator.device if generator is not None else device
    return torch.rand(shape, generator=generator, dtype=torch.float64, device=source).to(device)


def _sample_index(weights: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One draw per row from unnormalised `weights` [..., V] by inverse CDF (torch.multinomial would need a
    generator on the weights' device)."""
    return inverse_cdf(weights, uniforms(weights.shape[:-1], generator, weights.device))


def sample_token(target_probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row from target_probs [..., V] (the prefill's first token uses the same sampler as the
    tree)."""
    return _sample_index(target_probs, generator)


# ---------------------------------------------------------------------------------------------- device-side rules
def _path_from_deepest(ancestor_mask: torch.Tensor, depths: torch.Tensor, deepest: torch.Tensor, depth: int):
    """(path [..., depth + 1], length [...]) of node `deepest` [...]: path[d] = its ancestor at depth d, padded
    with 0. ancestor_mask [..., N, N]; depths [N] (one layout for every tree of a batch)."""
    levels = torch.arange(depth + 1, device=depths.device)
    num_nodes = ancestor_mask.shape[-1]
    index = deepest[..., None, None].expand(*deepest.shape, 1, num_nodes)
    row = ancestor_mask.gather(-2, index)[..., 0, :]  # [..., N]: the ancestors of `deepest`
    on_path = row[..., None, :] & (depths[None, :] == levels[:, None])  # [..., depth + 1, N]
    return on_path.to(torch.int8).argmax(-1), depths[deepest] + 1


def greedy_path(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    depths: torch.Tensor,
    ancestor_mask: torch.Tensor,
    target_argmax: torch.Tensor,
    valid: torch.Tensor,
    depth: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`greedy_accept` on fixed shapes, over any leading batch dims (one tree per sequence): tokens / parents /
    target_argmax / valid [..., N], ancestor_mask [..., N, N], depths [N] -> (path [..., depth + 1] padded
    with 0, length [...] long, bonus [...] long), all on the input device and computed without reading any
    device value on the host. `depth` = the trees' depth."""
    match = (tokens == target_argmax.gather(-1, parents.clamp(min=0))) & valid
    match[..., 0] = True
    accepted = ~(ancestor_mask & ~match[..., None, :]).any(dim=-1)
    deepest = torch.argmax(torch.where(accepted, depths, torch.full_like(depths, -1)), dim=-1)
    path, length = _path_from_deepest(ancestor_mask, depths, deepest, depth)
    return path, length, target_argmax.gather(-1, deepest[..., None])[..., 0]


def sample_path(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    valid: torch.Tensor,
    target_probs: torch.Tensor,
    draws: torch.Tensor,
    *,
    depth: int,
    max_children: int,
    draft_probs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lossless sampling acceptance on fixed shapes, batched over independent trees (leading dims [B]).

    tokens / parents / valid [B, N] (nodes level by level, a parent's children in its candidate order),
    target_probs [B, N, V] (p at every node), draws [B, depth * max_children + 1] uniforms in [0, 1),
    draft_probs [B, N, V] or None. Returns (path [B, depth + 1] padded with 0, length [B], bonus [B]).

    Walk from the root; at node u with p = target_probs[u] and valid children x1..xk in candidate order:

    * draft_probs None — deterministic candidates (the drafter's top choices; ALGORITHM §4.3, `sample_accept`):
      accept xi with probability p_i(xi) / sum p_i, where p_i = p with x1..x(i-1) zeroed; all rejected: the
      bonus ~ p_(k+1). Exact by the telescoping product in `sample_accept`'s docstring.
    * draft_probs given — recursive rejection sampling (Jeon et al. 2024) for children drawn from q = draft_probs[u]
      WITHOUT replacement (x1 ~ q, x2 ~ q without x1, ...): p_1 = p, q_1 = q;
      accept xi with probability min(1, p_i(xi) / q_i(xi)); on reject p_(i+1) = norm(max(p_i - q_i, 0)),
      q_(i+1) = q_i with xi removed, renormalised; all k rejected: the bonus ~ p_(k+1).

      Proof that the emitted token Y ~ p. Claim: given x1..x(i-1) and that step i is reached, Y ~ p_i. For i = k+1
      Y ~ p_(k+1) by construction. Step i: given x1..x(i-1) (which fix p_i, q_i and p_(i+1)), xi ~ q_i, because
      a draw without replacement is the next draw from q restricted to the unseen tokens, and rejecting earlier
      candidates depended only on them and on independent uniforms. By the claim for i+1, after a rejection Y ~
      p_(i+1) whatever xi was. So P(Y = y) = q_i(y) min(1, p_i(y)/q_i(y)) + (1 - sum_x min(q_i(x), p_i(x))) p_(i+1)(y)
      = min(q_i(y), p_i(y)) + max(p_i(y) - q_i(y), 0) = p_i(y): ordinary speculative sampling. (When the
      residual mass is 0, p_i = q_i on its support and acceptance is certain.) The claim at i = 1 is Y ~ p.
      A node with no valid children emits from p itself (k = 0).

    Descending into the accepted child repeats the argument with that child's p, which is the target's
    distribution conditioned on the emitted prefix; so every emitted token is an exact target sample PROVIDED the
    children of a node are a without-replacement sample from its q whose SIZE was fixed before they were drawn,
    independently of the verifier's uniforms (longspec.infer.tree.sample_step fixes each node's child budget
    from its parent level's path scores). A global top-W over the children's own draw values would break that:
    the number of children a node keeps would depend on the values drawn, so its candidates would no longer be
    a fixed-size without-replacement sample from q.
    """
    children = child_table(parents, valid, max_children)  # [B, N, K]
    walk = _walk_for(tokens.device)
    path, length, residual = walk(tokens, children, target_probs, draws, depth, draft_probs)
    return path, length, inverse_cdf(residual, draws[:, -1])


def sample_chain_path(
    tokens: torch.Tensor,
    valid: torch.Tensor,
    target_probs: torch.Tensor,
    draws: torch.Tensor,
    depth: int,
    draft_probs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`sample_path` for a chain (node i's parent is node i - 1: the drafter's chains, a lookup chain, a plain
    step's one node), as a few whole-batch tensor ops instead of the walk: (path [B, depth + 1] = 0, 1, ...,
    depth (only the first `length` count), length [B], bonus [B]), the same values as `sample_path` for the same
    `draws` [B, depth + 1] (its draw for node i's one child is draws[:, i], the bonus's is the last).

    In a chain every node has at most one child, so the walk's decisions do not depend on each other: draft
    i + 1 (if valid) is accepted iff u_i q_i(x) < p_i(x) (rrs; deterministic: u_i sum p_i < p_i(x)), with p_i, q_i
    the unmodified rows at node i, and the walk stops at the first draft not accepted. The bonus is drawn from
    the stop node's residual: a rejected draft's max(p - q, 0), renormalised (deterministic: p without it),
    else (a leaf, or an invalid child: a lookup's padding) p itself. Only the stop node's row is read, so a
    round's V-wide work is one draw from one row however long the chain (`kernels.bonus_sampling`: on CUDA two
    launches across the device instead of a V-wide op each), and the decisions one launch (`kernels.chain_accept.sample_chain_decide`). A plain step
    (depth 0) draws from p at the root the same way."""
    path = arange_once(depth + 1, tokens.device).expand(tokens.shape[0], depth + 1)
    if depth == 0:  # a plain step: the bonus comes from p at the root
        zero = torch.zeros_like(tokens[:, 0])
        bonus = _bonus_for(tokens.device)(target_probs, None, zero, zero.bool(), zero, draws[:, -1])
        return path, torch.ones_like(zero), bonus
    threshold = None
    if draft_probs is None:
        threshold = target_probs[:, :depth].sum(-1, dtype=torch.float64)  # no float64 copy of the rows
    stop, rejected, token = sample_chain_decide(tokens, valid, target_probs, draws, threshold, draft_probs)
    bonus = _bonus_for(tokens.device)(target_probs, draft_probs, stop, rejected, token, draws[:, -1])
    return path, stop + 1, bonus


def _bonus_for(device: torch.device):
    """The bonus draw from the stop node's residual on `device`: the Triton kernels on CUDA (two launches over
    the device; imports Triton), else the plain-PyTorch reference (about fifteen V-wide ops)."""
    if device.type == "cuda":
        from longspec.kernels.bonus_sampling import sample_bonus

        return sample_bonus
    return sample_bonus_naive


def _walk_for(device: torch.device):
    """The sampling walk on `device`: the Triton kernel on CUDA (one program per tree, one launch; imports
    Triton), else the plain-PyTorch reference (one small kernel per step of the walk)."""
    if device.type == "cuda":
        from longspec.kernels.tree_sampling import sample_walk

        return sample_walk
    return sample_walk_naive
