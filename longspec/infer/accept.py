"""Acceptance of a verified draft tree: small pure functions, greedy (T = 0) and lossless sampling (T > 0).

Shape legend: N tree nodes (node 0 is the root, parents precede children), V vocabulary.
A tree is given by `tokens [N]`, `parents [N]` (root: -1), `depths [N]`, `ancestor_mask [N, N]`
(row i is True at i and at every ancestor of i) and `valid [N]` (padding nodes, e.g. short PLD drafts, are False).
The target's output at node i is its prediction for the token *after* node i, i.e. for i's children.

Both rules return `(path, bonus)`: `path` the accepted node indices from the root down (always starts with 0; the
root itself was emitted last round), `bonus` the token the target emits after the deepest accepted node.
Tokens emitted this round = tokens[path[1:]] + [bonus], so a round emits len(path) tokens for one target forward.
"""

from __future__ import annotations

import torch

__all__ = ["target_distribution", "greedy_accept", "sample_accept", "sample_token", "children_lists"]


def target_distribution(
    logits: torch.Tensor, *, temperature: float, top_k: int | None = None, top_p: float | None = None
) -> torch.Tensor:
    """target_probs [..., V] (fp32) after temperature, then top-k, then top-p (nucleus) truncation.

    Both truncations keep at least the most likely token. Only the target's distribution is shaped this way:
    the lossless guarantee is about sampling from exactly this distribution.
    """
    if temperature <= 0:
        raise ValueError(
            f"target_distribution needs temperature > 0 (got {temperature}); use greedy_accept for T=0"
        )
    logits = logits.float() / temperature
    if top_k is not None and 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and 0.0 < top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the mass strictly before it already reaches top_p (so the first token always stays).
        drop_sorted = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return torch.softmax(logits, dim=-1)


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
    """T > 0, lossless for deterministic candidates (REFERENCE §4; not upstream's rule).

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


def _sample_index(weights: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One draw from unnormalised `weights` [V] by inverse CDF with a CPU uniform, so one CPU generator
    drives sampling on any device (torch.multinomial would need a generator on the weights' device)."""
    cdf = torch.cumsum(weights.double(), dim=0)
    u = torch.rand((), generator=generator, dtype=torch.float64).to(weights.device)
    index = torch.searchsorted(cdf, (u * cdf[-1]).reshape(1), right=True).clamp(max=weights.shape[0] - 1)
    return index.squeeze(0)


def sample_token(target_probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token from target_probs [V] (prefill and AR decoding use the same sampler as the tree)."""
    return _sample_index(target_probs, generator)
