"""Reference sampling walk down a batch of draft trees, on fixed shapes (the semantics `triton.py` follows).

Shape legend: B trees, N nodes (level by level; a parent's children in candidate order), K the most children of
a node, V vocabulary, L tree depth.
"""

from __future__ import annotations

import torch

__all__ = ["child_table", "sample_walk_naive"]


def child_table(parents: torch.Tensor, valid: torch.Tensor, max_children: int) -> torch.Tensor:
    """children [B, N, K]: the slot of node n's k-th valid child (in slot order = candidate order), -1 where
    there is none. parents / valid [B, N]; the root's parent entry is ignored. Fixed shapes, no host read."""
    batch, num_nodes = parents.shape
    earlier = torch.ones(num_nodes, num_nodes, dtype=torch.bool, device=parents.device).tril(-1)
    same = (parents.unsqueeze(-1) == parents.unsqueeze(-2)) & valid.unsqueeze(-2) & earlier
    rank = same.sum(-1)  # [B, N]: valid earlier siblings
    keep = valid & (rank < max_children)
    keep[:, 0] = False  # the root is nobody's child
    # Each kept node writes its own slot at (parent, rank); the others write into one spare column, dropped.
    flat = torch.where(keep, parents.clamp(min=0) * max_children + rank, num_nodes * max_children)
    table = torch.full((batch, num_nodes * max_children + 1), -1, dtype=torch.long, device=parents.device)
    slots = torch.arange(num_nodes, device=parents.device).expand(batch, num_nodes)
    table.scatter_(1, flat, torch.where(keep, slots, -1))
    return table[:, :-1].view(batch, num_nodes, max_children)


def sample_walk_naive(
    tokens: torch.Tensor,
    children: torch.Tensor,
    target_probs: torch.Tensor,
    draws: torch.Tensor,
    depth: int,
    draft_probs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Walk each tree from its root: (path [B, L + 1] padded with 0, length [B], residual [B, V] float64, the
    distribution the round's bonus token is drawn from). tokens [B, N]; children [B, N, K] (`child_table`);
    target_probs [B, N, V] (p at every node); draws [B, >= L * K] uniforms (float64), draws[:, l * K + k] for
    the k-th child at level l; draft_probs [B, N, V] or None.

    At node u with p = target_probs[u] and children x1..xk: draft_probs None, accept xi with probability
    p_i(xi) / sum p_i (p_i = p with x1..x(i-1) zeroed); else recursive rejection sampling: accept xi with
    probability min(1, p_i(xi) / q_i(xi)), on a rejection p_(i+1) = norm(max(p_i - q_i, 0)) and q_(i+1) = q_i
    without xi, renormalised. The walk stops at the first node where every child is rejected (residual = the
    p reached there) or at a leaf (residual = its p). Why this is lossless: `infer.accept.sample_path`."""
    batch, _, max_children = children.shape
    device = tokens.device
    rows = torch.arange(batch, device=device)
    node = torch.zeros(batch, dtype=torch.long, device=device)
    alive = torch.ones(batch, dtype=torch.bool, device=device)  # still walking (the last step accepted)
    path = torch.zeros(batch, depth + 1, dtype=torch.long, device=device)
    length = torch.ones(batch, dtype=torch.long, device=device)
    residual = target_probs[rows, node].double()
    for level in range(depth):
        p = target_probs[rows, node].double()  # [B, V]
        q = draft_probs[rows, node].double() if draft_probs is not None else None
        chosen = torch.full((batch,), -1, dtype=torch.long, device=device)
        for k in range(max_children):
            child = children[rows, node, k]  # [B], -1: no k-th child
            active = alive & (child >= 0) & (chosen < 0)
            x = tokens[rows, child.clamp(min=0)][:, None]  # [B, 1]
            px = p.gather(-1, x)[:, 0]
            u = draws[:, level * max_children + k]
            if q is None:
                accept = active & (u * p.sum(-1) < px)
                rejected = (active & ~accept)[:, None]
                p = torch.where(rejected, p.scatter(-1, x, 0.0), p)
            else:
                accept = active & (u * q.gather(-1, x)[:, 0] < px)  # u < min(1, p/q), q(x) > 0
                rejected = (active & ~accept)[:, None]
                rest = (p - q).clamp(min=0)
                mass = rest.sum(-1, keepdim=True)
                # mass 0 means p_i == q_i on its support: acceptance was certain, the branch is never taken.
                p = torch.where(rejected & (mass > 0), rest / mass.clamp(min=1e-300), p)
                q_rest = q.scatter(-1, x, 0.0)
                q = torch.where(rejected, q_rest / q_rest.sum(-1, keepdim=True).clamp(min=1e-300), q)
            chosen = torch.where(accept, child, chosen)
        stepped = alive & (chosen >= 0)
        residual = torch.where((alive & ~stepped)[:, None], p, residual)
        path[:, level + 1] = torch.where(stepped, chosen, 0)
        length += stepped.long()
        node = torch.where(stepped, chosen, node)
        alive = stepped
    # Walked to a leaf: nothing was proposed below it, the bonus comes from p there.
    residual = torch.where(alive[:, None], target_probs[rows, node].double(), residual)
    # Children holding ~all the mass are all rejected only through rounding: fall back to p itself.
    empty = residual.sum(-1, keepdim=True) <= 0
    residual = torch.where(empty, target_probs[rows, node].double(), residual)
    return path, length, residual
