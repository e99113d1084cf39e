import pytest
import torch

from longspec.infer.accept import (
    emitted_tokens,
    greedy_accept,
    greedy_chain_path,
    greedy_path,
    sample_accept,
    sample_chain_path,
    sample_path,
    sample_token,
    target_distribution,
)
from longspec.infer.tree import DraftTree, TreeLayout, beam_step, chain_tree, sample_step


def _tree(tokens, parents) -> DraftTree:
    """A hand-written tree (parents precede children)."""
    n = len(tokens)
    parents_t = torch.tensor(parents)
    anc = torch.zeros(n, n, dtype=torch.bool)
    depths = torch.zeros(n, dtype=torch.long)
    for i in range(n):
        anc[i, i] = True
        if parents[i] >= 0:
            anc[i] |= anc[parents[i]]
            depths[i] = depths[parents[i]] + 1
    return DraftTree(torch.tensor(tokens), parents_t, depths, anc, torch.ones(n, dtype=torch.bool))


# root(5) -> {1, 2};  1 -> {3};  2 -> {3, 4};  3(under 2) -> {0}
TREE = _tree([5, 1, 2, 3, 3, 4, 0], [-1, 0, 0, 1, 2, 2, 4])


def _argmax_for(tree: DraftTree, wanted: dict[int, int], vocab: int = 6) -> torch.Tensor:
    """target argmax per node: `wanted[node]` where given, else a token no child carries (vocab - 1)."""
    return torch.tensor([wanted.get(i, vocab - 1) for i in range(tree.num_nodes)])


@pytest.mark.parametrize(
    "wanted, path, bonus",
    [
        ({0: 5}, [0], 5),  # reject everything: bonus only
        ({0: 2, 2: 3, 4: 0, 6: 1}, [0, 2, 4, 6], 1),  # deepest branch fully accepted
        ({0: 1, 1: 3, 3: 2}, [0, 1, 3], 2),  # other branch
        ({0: 2, 2: 4}, [0, 2, 5], 5),  # second sibling matches
    ],
)
def test_greedy_accept_paths(wanted, path, bonus):
    argmax = _argmax_for(TREE, wanted)
    got_path, got_bonus = greedy_accept(
        TREE.tokens, TREE.parents, TREE.depths, TREE.ancestor_mask, argmax, TREE.valid
    )
    assert got_path.tolist() == path
    assert int(got_bonus) == bonus


def test_greedy_accept_ignores_invalid_padding():
    tree = chain_tree(torch.tensor(7), torch.tensor([1, 2]), num_valid=1, num_nodes=4)
    argmax = torch.tensor([1, 2, 3, 3])  # node 2 would match, but it is padding
    path, bonus = greedy_accept(
        tree.tokens, tree.parents, tree.depths, tree.ancestor_mask, argmax, tree.valid
    )
    assert path.tolist() == [0, 1] and int(bonus) == 2


def test_target_distribution_truncations():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert torch.allclose(target_distribution(logits, temperature=1.0), torch.tensor([0.5, 0.3, 0.15, 0.05]))
    top2 = target_distribution(logits, temperature=1.0, top_k=2)
    assert torch.allclose(top2, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    nucleus = target_distribution(logits, temperature=1.0, top_p=0.8)  # 0.5 + 0.3 reaches 0.8
    assert torch.allclose(nucleus, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    tiny_p = target_distribution(logits, temperature=1.0, top_p=0.1)
    assert torch.allclose(tiny_p, torch.tensor([1.0, 0.0, 0.0, 0.0]))
    hot = target_distribution(logits, temperature=2.0)
    assert torch.allclose(hot, torch.softmax(logits / 2, -1))
    with pytest.raises(ValueError):
        target_distribution(logits, temperature=0.0)


# Target distributions with most of the mass on the drafted children, so that every branch of the rule
# (accept first / accept after a rejection / reject all and sample the residual) is frequent.
def _tree_target_probs(vocab: int = 6) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1234)
    probs = torch.softmax(torch.randn(TREE.num_nodes, vocab, generator=gen), dim=-1)
    probs[0] = torch.tensor([0.05, 0.35, 0.35, 0.1, 0.1, 0.05])  # root: children tokens 1, 2
    probs[2] = torch.tensor([0.1, 0.05, 0.05, 0.35, 0.35, 0.1])  # node 2: children tokens 3, 4
    return probs


def _first_two_counts(sampler, target_probs, draws: int, vocab: int = 6):
    """Counts of the first emitted token, and of the second one when the first is token 2 (tree node 2)."""
    gen = torch.Generator().manual_seed(99)
    first, second = torch.zeros(vocab), torch.zeros(vocab)
    for _ in range(draws):
        path, bonus = sampler(TREE.tokens, TREE.parents, target_probs, TREE.valid, generator=gen)
        emitted = TREE.tokens[path[1:]].tolist() + [int(bonus)]
        first[emitted[0]] += 1
        if emitted[0] == 2 and len(emitted) >= 2:
            second[emitted[1]] += 1
    return first, second


def _sampler_without_renormalisation(tokens, parents, target_probs, valid, *, generator):
    """A plausible bug: accept child ci with probability p(ci) instead of p(ci) / (1 - rejected mass)."""
    node, path = 0, [0]
    while True:
        probs = target_probs[node].clone()
        for kid in (i for i, p in enumerate(parents.tolist()) if p == node):
            if torch.rand((), generator=generator) < probs[tokens[kid]]:
                path.append(kid)
                node = kid
                break
            probs[tokens[kid]] = 0.0
        else:
            return torch.tensor(path), torch.multinomial(probs, 1, generator=generator)[0]


def test_sample_accept_reproduces_target_distribution(chi_square):
    """Chi-square over 6000 draws: the first emitted token ~ target_probs[root]; when it is tree node 2's token,
    the second ~ target_probs[2] (the conditional the rule must reproduce after descending)."""
    target_probs = _tree_target_probs()
    first, second = _first_two_counts(sample_accept, target_probs, draws=6000)
    assert chi_square(first, target_probs[0]) > 1e-3
    assert second.sum() > 1000
    assert chi_square(second, target_probs[2]) > 1e-3


def test_the_chi_square_test_catches_a_biased_sampler(chi_square):
    """Power check of the test above: skipping the renormalisation after a rejection is detected."""
    target_probs = _tree_target_probs()
    first, second = _first_two_counts(_sampler_without_renormalisation, target_probs, draws=6000)
    assert chi_square(first, target_probs[0]) < 1e-6


def test_sample_token_matches_distribution(chi_square):
    gen = torch.Generator().manual_seed(7)
    probs = torch.tensor([0.1, 0.0, 0.6, 0.3])
    counts = torch.zeros(4)
    for _ in range(4000):
        counts[int(sample_token(probs, gen))] += 1
    assert counts[1] == 0
    assert chi_square(counts, probs) > 1e-3


def test_beam_step_global_top_k():
    scores = torch.tensor([0.0, -1.0])
    logprobs = torch.log(torch.tensor([[0.5, 0.3, 0.2], [0.9, 0.05, 0.05]]))
    parent, tokens, new_scores = beam_step(scores, logprobs, 3)
    # (0,0): log .5 = -0.69 > (1,0): -1 + log .9 = -1.11 > (0,1): log .3 = -1.20 > (0,2): log .2 = -1.61
    assert parent.tolist() == [0, 1, 0] and tokens.tolist() == [0, 0, 1]
    assert torch.allclose(new_scores, torch.tensor([0.5, 0.9, 0.3]).log() + torch.tensor([0.0, -1.0, 0.0]))
    parent, tokens, _ = beam_step(torch.tensor([0.0, 0.0]), logprobs, 2)
    assert parent.tolist() == [1, 0] and tokens.tolist() == [0, 0]
    with pytest.raises(ValueError):
        beam_step(scores, logprobs, 7)


@pytest.mark.parametrize("width", [1, 5, 16, 40])  # 40 > V: a parent gives all its tokens
def test_beam_step_equals_brute_force_over_every_pair(width):
    gen = torch.Generator().manual_seed(width)
    parents, logits = torch.randn(3, 4, generator=gen), torch.randn(3, 4, 30, generator=gen) * 3  # B=3, P=4
    parent, tokens, scores = beam_step(parents, logits, width)
    every = (parents[..., None] + torch.log_softmax(logits, dim=-1)).flatten(1)  # [B, P*V]
    best, flat = every.topk(width, dim=-1)
    assert torch.equal(parent, flat // 30) and torch.equal(tokens, flat % 30)
    torch.testing.assert_close(scores, best)


@pytest.mark.parametrize("width", [1, 5])
def test_beam_step_without_scores_is_the_parents_top_w(width):
    """One parent and no scores to hand on (`TreeLayout.needs_scores`, e.g. a chain's levels): the same selection
    as the full step (its top-W, best first), without the normalisation; a width of one is an argmax."""
    gen = torch.Generator().manual_seed(width)
    logits = torch.randn(3, 1, 30, generator=gen) * 3  # B=3 trees, P=1
    parent, tokens, scores = beam_step(None, logits, width, scores=False)
    full_parent, full_tokens, _ = beam_step(torch.zeros(3, 1), logits, width)
    assert scores is None and torch.equal(parent, full_parent) and torch.equal(tokens, full_tokens)
    _, _, root_scores = beam_step(None, logits, width)  # None: the root's score, 0
    torch.testing.assert_close(root_scores, torch.log_softmax(logits, -1)[:, 0].topk(width).values)
    assert TreeLayout((1, 1, 1)).needs_scores(0) is False
    assert [TreeLayout((1, 4, 16, 1)).needs_scores(level) for level in range(4)] == [True, True, True, False]


def test_tree_layout_and_ancestor_mask():
    layout = TreeLayout((2, 3))
    assert layout.num_nodes == 6 and layout.depths().tolist() == [0, 1, 1, 2, 2, 2]
    tree = DraftTree.empty(layout, torch.tensor(9))
    tree.set_level(layout.level_slice(1), torch.tensor([0, 0]), torch.tensor([4, 5]))
    tree.set_level(layout.level_slice(2), torch.tensor([2, 1, 2]), torch.tensor([6, 7, 8]))
    assert tree.parents.tolist() == [-1, 0, 0, 2, 1, 2]
    assert tree.ancestor_mask[3].nonzero().flatten().tolist() == [0, 2, 3]
    assert tree.ancestor_mask[4].nonzero().flatten().tolist() == [0, 1, 4]
    with pytest.raises(ValueError):
        TreeLayout((4, 0))


def test_chain_tree_pads_and_truncates():
    tree = chain_tree(torch.tensor(9), torch.tensor([1, 2, 3, 4, 5]), num_valid=5, num_nodes=4)
    assert tree.tokens.tolist() == [9, 1, 2, 3] and tree.valid.all()
    short = chain_tree(torch.tensor(9), torch.tensor([1]), num_valid=1, num_nodes=4)
    assert short.tokens.tolist() == [9, 1, 0, 0] and short.valid.tolist() == [True, True, False, False]
    assert short.parents.tolist() == [-1, 0, 1, 2]


# ------------------------------------------------------------------ device-side rules (fixed shapes)
def _random_tree(layout: TreeLayout, vocab: int, gen: torch.Generator) -> DraftTree:
    """A level-ordered tree on `layout` with random parents and distinct tokens among siblings."""
    tree = DraftTree.empty(layout, torch.randint(0, vocab, (), generator=gen))
    for level in range(1, layout.depth + 1):
        parent_sl, sl = layout.level_slice(level - 1), layout.level_slice(level)
        parents = torch.randint(parent_sl.start, parent_sl.stop, (sl.stop - sl.start,), generator=gen)
        parents = parents.sort().values
        # distinct tokens per parent: a random permutation shared by the level, indexed by sibling rank
        perm = torch.randperm(vocab, generator=gen)
        ranks = torch.tensor([int((parents[:i] == parents[i]).sum()) for i in range(parents.numel())])
        tree.set_level(sl, parents, perm[ranks])
    return tree


def test_greedy_path_matches_reference_on_random_trees():
    gen = torch.Generator().manual_seed(0)
    for trial in range(200):
        layout = TreeLayout(((1,), (2, 3), (4, 4, 4), (3, 1, 5, 2))[trial % 4])
        tree = _random_tree(layout, vocab=6, gen=gen)
        tree.valid = torch.rand(tree.num_nodes, generator=gen) > 0.1
        tree.valid[0] = True
        # the target mostly agrees with some child, so deep paths are common
        argmax = torch.where(
            torch.rand(tree.num_nodes, generator=gen) < 0.8,
            tree.tokens[torch.randint(0, tree.num_nodes, (tree.num_nodes,), generator=gen)],
            torch.randint(0, 6, (tree.num_nodes,), generator=gen),
        )
        ref_path, ref_bonus = greedy_accept(
            tree.tokens, tree.parents, tree.depths, tree.ancestor_mask, argmax, tree.valid
        )
        path, length, bonus = greedy_path(
            tree.tokens, tree.parents, tree.depths, tree.ancestor_mask, argmax, tree.valid, layout.depth
        )
        assert path.shape == (layout.depth + 1,)
        assert path[: int(length)].tolist() == ref_path.tolist() and int(bonus) == int(ref_bonus)
        emitted = emitted_tokens(tree.tokens, path, length, bonus)[: int(length)]
        assert emitted.tolist() == tree.tokens[ref_path[1:]].tolist() + [int(ref_bonus)]


@pytest.mark.parametrize("depth", [0, 1, 5])
def test_greedy_chain_path_is_greedy_path_on_chains(depth):
    """The chain walk (a leading run of matches) against the tree walk, on chains of random drafts and validity
    (a lookup's invalid tail) where the target mostly agrees, one chain per row of a batch."""
    gen = torch.Generator().manual_seed(depth)
    for _ in range(50):
        drafts = torch.randint(0, 4, (depth + 1,), generator=gen)
        chain = chain_tree(drafts[0], drafts[1:], depth, depth + 1)
        tokens, valid = chain.tokens.expand(3, -1).clone(), torch.rand(3, depth + 1, generator=gen) > 0.15
        valid[:, 0] = True
        argmax = torch.where(
            torch.rand(3, depth + 1, generator=gen) < 0.8,
            torch.roll(tokens, -1, dims=-1),
            torch.randint(0, 4, (3, depth + 1), generator=gen),
        )
        parents, mask = chain.parents.expand(3, -1), chain.ancestor_mask.expand(3, -1, -1)
        ref = greedy_path(tokens, parents, chain.depths, mask, argmax, valid, depth)
        path, length, bonus = greedy_chain_path(tokens, argmax, valid, depth)
        assert torch.equal(length, ref[1]) and torch.equal(bonus, ref[2])
        for row in range(3):
            assert path[row, : int(length[row])].tolist() == ref[0][row, : int(length[row])].tolist()


def test_sample_path_matches_reference_when_the_target_is_certain():
    """With one-hot target rows both sampling rules are deterministic: same path and bonus as the host walk."""
    gen = torch.Generator().manual_seed(1)
    for trial in range(100):
        layout = TreeLayout(((2, 3), (4, 4, 4))[trial % 2])
        tree = _random_tree(layout, vocab=6, gen=gen)
        choice = torch.where(
            torch.rand(tree.num_nodes, generator=gen) < 0.7,
            tree.tokens[torch.randint(0, tree.num_nodes, (tree.num_nodes,), generator=gen)],
            torch.randint(0, 6, (tree.num_nodes,), generator=gen),
        )
        probs = torch.nn.functional.one_hot(choice, 6).float()
        ref_path, ref_bonus = sample_accept(tree.tokens, tree.parents, probs, tree.valid, generator=gen)
        draws = torch.rand(1, layout.depth * max(layout.widths) + 1, generator=gen, dtype=torch.float64)
        path, length, bonus = sample_path(
            tree.tokens[None],
            tree.parents[None],
            tree.valid[None],
            probs[None],
            draws,
            depth=layout.depth,
            max_children=max(layout.widths),
        )
        assert path[0, : int(length[0])].tolist() == ref_path.tolist() and int(bonus[0]) == int(ref_bonus)


def _probs(logits: torch.Tensor, **shaping) -> torch.Tensor:
    return target_distribution(logits, temperature=1.0, **shaping)


def _two_level_trials(
    rule: str, trials: int, vocab: int, shaping: dict, seed: int, verify=sample_path, k1: int = 3, k2: int = 2
):
    """`trials` independent rounds on a two-level tree (root -> k1 children -> k2 children each), vectorised.
    rrs: children drawn from the drafter's q without replacement (Gumbel-top-k); deterministic: q's top tokens.
    p (the target) and q (the drafter) differ; both depend on the node's token. Returns the first two emitted
    tokens [trials, 2] (-1: only one emitted), p at the root [V] and p after each first token [V, V]."""
    gen = torch.Generator().manual_seed(seed)
    logits_root, logits_next = (
        torch.randn(vocab, generator=gen) * 1.5,
        torch.randn(vocab, vocab, generator=gen) * 1.5,
    )
    p_root, p_next = _probs(logits_root, **shaping), _probs(logits_next, **shaping)  # p_next: [token, V]
    # q: a perturbed copy of p's logits, itself truncated (support < k1 at the root: invalid children occur)
    q_root = _probs(logits_root + torch.randn(vocab, generator=gen), top_k=2)
    q_next = _probs(logits_next + torch.randn(vocab, vocab, generator=gen), top_k=vocab - 1)

    def draw(q: torch.Tensor, k: int) -> torch.Tensor:  # [B, V] -> [B, k] tokens
        if rule == "deterministic":
            return q.topk(k, dim=-1).indices
        noise = torch.empty_like(q).exponential_(generator=gen)
        return (q.log() - noise.log()).topk(k, dim=-1).indices

    level1 = draw(q_root.expand(trials, -1), k1)  # [B, k1]
    level2 = draw(q_next[level1.flatten()], k2).reshape(trials, k1 * k2)  # [B, k1 * k2]
    tokens = torch.cat([torch.zeros(trials, 1, dtype=torch.long), level1, level2], 1)  # [B, N]
    parents = torch.tensor([-1] + [0] * k1 + [1 + i // k2 for i in range(k1 * k2)]).expand(trials, -1)
    node_q = torch.cat(
        [q_root.expand(trials, 1, -1), q_next[level1], torch.zeros(trials, k1 * k2, vocab)], 1
    )  # [B, N, V]: q each node's children were drawn from
    parent_q = node_q.gather(1, parents.clamp(min=0)[..., None].expand(-1, -1, vocab))
    valid = parent_q.gather(-1, tokens[..., None])[..., 0] > 0  # drawn past q's support: padding
    valid[:, 0] = True
    target = torch.cat([p_root.expand(trials, 1, -1), p_next[level1], torch.zeros(trials, k1 * k2, vocab)], 1)
    target[:, 1 + k1 :] = 1.0 / vocab  # leaves' p: only the bonus after depth 2 reads it
    draws = torch.rand(trials, 2 * k1 + 1, generator=gen, dtype=torch.float64)
    path, length, bonus = verify(
        tokens,
        parents,
        valid,
        target,
        draws,
        depth=2,
        max_children=k1,
        draft_probs=node_q if rule == "rrs" else None,
    )
    emitted = torch.cat([tokens.gather(1, path[:, 1:]), bonus[:, None]], 1)  # [B, 3]
    first = torch.where(length > 1, emitted[:, 0], bonus)
    second = torch.where(length > 2, emitted[:, 1], torch.where(length == 2, bonus, -1))
    return torch.stack([first, second], 1), p_root, p_next, (length > 1).float().mean()


@pytest.mark.parametrize("rule", ["rrs", "deterministic"])
@pytest.mark.parametrize(
    "vocab, shaping", [(4, {}), (6, {"top_k": 4}), (8, {"top_p": 0.8}), (8, {"top_k": 6, "top_p": 0.9})]
)
def test_sample_path_is_lossless(chi_square, rule, vocab, shaping):
    """Chi-square over 20000 vectorised rounds: the first emitted token ~ p(root), and the second, given the
    most frequent first token t, ~ p(. | t); q differs from p and is truncated, top-k / top-p shape p."""
    out, p_root, p_next, accept_rate = _two_level_trials(rule, 20000, vocab, shaping, seed=vocab)
    assert accept_rate > 0.2  # the accept branch runs, not only the residual
    first = torch.bincount(out[:, 0], minlength=vocab).float()
    assert chi_square(first, p_root) > 1e-3
    t = int(first.argmax())
    second = out[out[:, 0] == t, 1]
    assert chi_square(torch.bincount(second, minlength=vocab).float(), p_next[t]) > 1e-3


def _chain_verify(tokens, parents, valid, target, draws, *, depth, max_children, draft_probs=None):
    assert max_children == 1 and torch.equal(
        parents[:, 1:], parents.new_tensor(range(depth)).expand(len(parents), -1)
    )
    return sample_chain_path(tokens, valid, target, draws, depth, draft_probs)


@pytest.mark.parametrize("rule", ["rrs", "deterministic"])
@pytest.mark.parametrize("vocab, shaping", [(4, {}), (6, {"top_k": 4})])
def test_sample_chain_path_is_lossless(chi_square, rule, vocab, shaping):
    """The chain walk under the same chi-square as the tree walk: a chain of two drafts (one child per node)."""
    out, p_root, p_next, accept_rate = _two_level_trials(
        rule, 20000, vocab, shaping, seed=vocab, verify=_chain_verify, k1=1, k2=1
    )
    assert accept_rate > 0.2
    first = torch.bincount(out[:, 0], minlength=vocab).float()
    assert chi_square(first, p_root) > 1e-3
    # A round that rejected its first draft emits one token; given an accepted first draft t, the next token is
    # the walk's own exact sample from p(. | t).
    two = out[out[:, 1] >= 0]
    t = int(torch.bincount(two[:, 0], minlength=vocab).argmax())
    second = two[two[:, 0] == t, 1]
    assert len(second) > 1000
    assert chi_square(torch.bincount(second, minlength=vocab).float(), p_next[t]) > 1e-3


@pytest.mark.parametrize("rule", ["rrs", "deterministic"])
@pytest.mark.parametrize("depth", [0, 1, 4])
def test_sample_chain_path_is_sample_path_on_chains(rule, depth):
    """The chain walk against the tree walk (the naive reference), same draws: same path, length and bonus, on
    chains with an invalid tail (a lookup's padding), q close to p so every stop depth occurs, a batch of rows."""
    gen = torch.Generator().manual_seed(depth)
    batch, vocab, lengths = 4, 5, []
    for _ in range(60):
        valid = torch.rand(batch, depth + 1, generator=gen) > 0.1
        valid = valid.long().cumprod(-1).bool()  # padding only at the tail
        valid[:, 0] = True
        logits = torch.randn(batch, depth + 1, vocab, generator=gen) * 2
        p = _probs(logits, top_k=4)
        # drafts mostly p's likeliest token at their parent, so that long accepted runs occur
        tokens = torch.where(
            torch.rand(batch, depth + 1, generator=gen) < 0.8,
            torch.roll(p.argmax(-1), 1, dims=-1),
            torch.randint(0, vocab, (batch, depth + 1), generator=gen),
        )
        q = _probs(logits + 0.5 * torch.randn(batch, depth + 1, vocab, generator=gen))
        q = (
            q[:, :depth] if rule == "rrs" else None
        )  # q of the nodes with children only (as the draft keeps it)
        draws = torch.rand(batch, depth + 1, generator=gen, dtype=torch.float64)
        parents = torch.arange(-1, depth).expand(batch, -1)
        ref = sample_path(tokens, parents, valid, p, draws, depth=depth, max_children=1, draft_probs=q)
        path, length, bonus = sample_chain_path(tokens, valid, p, draws, depth, q)
        assert torch.equal(length, ref[1]) and torch.equal(bonus, ref[2])
        for row in range(batch):
            assert path[row, : int(length[row])].tolist() == ref[0][row, : int(length[row])].tolist()
        lengths += length.tolist()
    assert set(lengths) == set(range(1, depth + 2))  # every stop depth, a full accept included


def test_sample_step_one_draw_is_the_general_rule():
    """A chain's level (one parent, one child, no scores read): the fast path draws what the general rule does
    for the same noise, and reports every node valid."""
    gen = torch.Generator().manual_seed(2)
    for _ in range(50):
        q = _probs(torch.randn(3, 1, 9, generator=gen) * 2, top_p=0.7)
        noise = torch.empty(3, 1, 9).exponential_(generator=gen)
        parent, tokens, scores, valid = sample_step(None, q, noise, 1, scores=False)
        ref = sample_step(torch.zeros(3, 1), q, noise, 1)
        assert torch.equal(tokens, ref[1]) and bool(ref[3].all())
        assert scores is None and valid is None and torch.equal(parent, ref[0])


def test_the_chi_square_harness_catches_a_wrong_q(chi_square):
    """Power check: verifying sampled children against a q they were not drawn from (uniform) is biased."""

    def wrong_q(*args, draft_probs=None, **kwargs):
        uniform = torch.full_like(draft_probs, 1.0 / draft_probs.shape[-1])
        return sample_path(*args, draft_probs=uniform, **kwargs)

    out, p_root, _, _ = _two_level_trials("rrs", 20000, 6, {}, seed=6, verify=wrong_q)
    assert chi_square(torch.bincount(out[:, 0], minlength=6).float(), p_root) < 1e-6


def test_sample_step_budgets_then_draws_without_replacement(chi_square):
    """Budgets are a prefix of each parent's draw order, set by parent scores and q's support only; the first
    child is a draw from q and the second from q without the first."""
    q = torch.tensor([[0.5, 0.3, 0.2, 0.0, 0.0], [0.1, 0.2, 0.3, 0.4, 0.0]])
    scores = torch.tensor([0.0, -0.8])
    gen = torch.Generator().manual_seed(0)
    parent, tokens, new_scores, valid = sample_step(
        scores, q, torch.empty(2, 5).exponential_(generator=gen), 5
    )
    # slot worths: p0: 0, -.69, -1.39 (support 3); p1: -.8, -1.49, ... -> p0 x3, p1 x2
    assert sorted(parent.tolist()) == [0, 0, 0, 1, 1] and valid.all()
    for p in (0, 1):
        kids = tokens[parent == p]
        assert kids.unique().numel() == kids.numel() and bool((q[p, kids] > 0).all())
    torch.testing.assert_close(new_scores, scores[parent] + q[parent, tokens].log())
    _, _, _, valid = sample_step(torch.tensor([0.0]), q[:1], torch.ones(1, 5), 4)
    assert valid.tolist() == [True, True, True, False]  # past the support: padding
    first, second = torch.zeros(5), torch.zeros(5)
    for _ in range(3000):
        _, tokens, _, _ = sample_step(
            torch.tensor([0.0]), q[1:], torch.empty(1, 5).exponential_(generator=gen), 2
        )
        first[tokens[0]] += 1
        if tokens[0] == 3:
            second[tokens[1]] += 1
    assert chi_square(first, q[1]) > 1e-3
    assert chi_square(second, q[1].index_fill(0, torch.tensor(3), 0.0)) > 1e-3


def test_sample_step_on_a_batch_is_each_tree_alone():
    """sample_step over [B, ...] (the batched draft) == sample_step per tree: same budgets, same draws, same
    scores for every valid slot (invalid slots are padding, never read)."""
    gen = torch.Generator().manual_seed(4)
    B, P, V, width = 3, 4, 7, 9
    scores = torch.randn(B, P, generator=gen)
    scores[1, 2] = float("-inf")  # an invalid parent
    q = torch.softmax(torch.randn(B, P, V, generator=gen) * 2, -1)
    q[2, :, 2:] = 0.0  # truncated q: 4 parents x 2 tokens < 9 slots, so invalid slots appear
    q = q / q.sum(-1, keepdim=True)
    noise = torch.empty(B, P, V).exponential_(generator=gen)
    batched = sample_step(scores, q, noise, width)
    for b in range(B):
        alone = sample_step(scores[b], q[b], noise[b], width)
        valid = alone[3]
        assert torch.equal(batched[3][b], valid)
        for got, want in zip(batched[:3], alone[:3], strict=True):
            assert torch.equal(got[b][valid], want[valid])
    assert not batched[3][2].all()  # the truncated tree has invalid slots
