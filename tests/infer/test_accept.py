import pytest
import torch

from longspec.infer.accept import greedy_accept, sample_accept, sample_token, target_distribution
from longspec.infer.tree import DraftTree, TreeLayout, beam_step, chain_tree


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
