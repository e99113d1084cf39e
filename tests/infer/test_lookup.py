"""Prompt lookup on the device (`pld.device_lookup`) against the host reference (`pld.prompt_lookups`), and the
rounds that draft by lookup: pld on static shapes (one round ahead, as the others), tree="auto"'s lookup chains and
forests (lossless on every family, in ragged batches, at T > 0 with the rrs rule; the drafter's ring caught up
after them)."""

import random

import pytest
import torch
from infer_helpers import prefill_drafter, random_drafter, reference_greedy
from test_engine import sampling_marginals, sampling_target
from test_policy import _common_prefix, _ring_by_position

from longspec.infer.candidates import AUTO_LOOKUPS, DrafterTree, Lookup
from longspec.infer.engine import GenerationConfig, SpeculativeEngine
from longspec.infer.pld import device_lookup, prompt_lookups
from longspec.infer.policy import AdaptivePolicy
from longspec.infer.policy import shadow as shadow_module
from longspec.infer.policy.shadow import LookupShadow, ShadowReport
from longspec.testing import FAMILY_VARIANTS, make_tiny_target

LOOKUP_NAMES = {c.name for c in AUTO_LOOKUPS}


def _reference(history, lengths, roots, num_draft, max_ngram, branches=1) -> list[list[list[int]]]:
    """Per row, its drafts (best first)."""
    return [
        [
            draft.tolist()
            for draft in prompt_lookups(
                torch.cat([history[row, :n], roots[row : row + 1]]), num_draft, max_ngram, branches
            )
        ]
        for row, n in enumerate(lengths.tolist())
    ]


def _device(history, lengths, roots, num_draft, max_ngram, branches=1) -> list[list[list[int]]]:
    drafts, num_valid = device_lookup(history, lengths, roots, num_draft, max_ngram, branches=branches)
    # fixed shapes, whatever the rows' lengths and matches
    assert drafts.shape == (history.shape[0], branches, num_draft) and num_valid.shape == (
        history.shape[0],
        branches,
    )
    # the valid branches first: a row with fewer matches pads its last branches
    assert all(row == sorted(row, key=lambda n: n == 0) for row in num_valid.tolist())
    return [
        [drafts[row, i, :n].tolist() for i, n in enumerate(counts) if n]
        for row, counts in enumerate(num_valid.tolist())
    ]


# small vocabularies: repetitive texts, matches near the end
@pytest.mark.parametrize("vocab", [2, 3, 8, 256])
def test_device_lookup_equals_the_reference(vocab):
    """Rows of different lengths (0, 1 and 2 committed tokens among them), stale random tokens past each row's
    length (never context), n-gram sizes and draft lengths as pld and tree="auto" use them."""
    gen = torch.Generator().manual_seed(vocab)
    slots = 40
    for _ in range(25):
        history = torch.randint(0, vocab, (5, slots), generator=gen)
        lengths = torch.cat([torch.tensor([0, 1, 2]), torch.randint(3, slots - 1, (2,), generator=gen)])
        roots = torch.randint(0, vocab, (5,), generator=gen)
        for num_draft, max_ngram, branches in (
            (1, 1, 1),
            (2, 3, 1),
            (8, 3, 1),
            (10, 2, 1),
            (8, 3, 2),
            (4, 3, 4),
        ):
            args = (history, lengths, roots, num_draft, max_ngram, branches)
            assert _device(*args) == _reference(*args)


def test_prompt_lookups_rank_the_longest_match_then_the_latest():
    """The reference's order, by hand: the trigram's two occurrences (latest first), then the bigram's and the
    unigram's other ones; each match end once, and the first draft is PLD's."""
    #                        0  1  2  3  4  5  6  7  8  9 10 11 12 13
    context = torch.tensor([1, 2, 3, 9, 1, 2, 3, 8, 5, 2, 3, 7, 1, 2, 3])
    drafts = [d.tolist() for d in prompt_lookups(context, 2, 3, branches=6)]
    # "1 2 3" ends at 3 and 7; "2 3" also at 11; "3" at no other end
    assert drafts == [[8, 5], [9, 1], [7, 1]]
    assert [d.tolist() for d in prompt_lookups(context, 2, 3)] == drafts[:1]  # PLD's: the first


def test_device_lookup_on_a_repeated_pattern_and_on_no_match():
    pattern = torch.tensor([5, 9, 2, 7, 4])
    history = torch.stack([pattern.repeat(6), torch.arange(30)])  # a loop; all tokens distinct
    lengths, roots = torch.tensor([13, 20]), torch.tensor([7, 25])  # row 0's root continues the loop
    for num_draft in (2, 4, 8):
        got = _device(history, lengths, roots, num_draft, 3, branches=2)
        assert got == _reference(history, lengths, roots, num_draft, 3, branches=2)
        # the latest "9 2 7" ends 5 tokens before the context's end: a draft of 8 is cut to those 5; the one
        # before it, a loop earlier, runs on (10 tokens to the end)
        assert got[0] == [[4, 5, 9, 2, 7][:num_draft], ([4, 5, 9, 2, 7] * 2)[:num_draft]] and got[1] == []


class LookupCosts:
    """Stub cost model: a lookup chain costs about a plain step, the drafter's trees far more: the policy takes
    lookup chains every round (their expected tokens never drop to 1), which hit once the tiny target's output
    loops."""

    def cost(self, widths, context_len):
        if widths.drafts_by_lookup:
            return 1.0 + 0.001 * widths.length
        return 1.0 if not widths.speculates else 1000.0


def _repetitive(seed: int, length: int) -> torch.Tensor:
    """A prompt made of a random 7-token phrase repeated, with a random token every few: lookups hit, and the
    tiny targets' greedy outputs loop too."""
    gen = torch.Generator().manual_seed(seed)
    phrase = torch.randint(0, 256, (7,), generator=gen)
    prompt = phrase.repeat(length // 7 + 1)[:length].clone()
    prompt[::9] = torch.randint(0, 256, (prompt[::9].numel(),), generator=gen)
    return prompt


@pytest.mark.parametrize("family", FAMILY_VARIANTS)
def test_auto_lookups_are_lossless_and_accepted(family):
    """tree="auto" with lookup chains == the target's greedy output, eager and on static shapes; lookup rounds ran
    and accepted drafts (the only speculating rounds here: the drafter's trees are priced out)."""
    target = make_tiny_target(family)
    prompt = _repetitive(4, 45)  # a seed whose outputs loop on every family within 32 tokens
    ref = reference_greedy(target, prompt, 32)
    engine = SpeculativeEngine(target, random_drafter(target), costs=LookupCosts())
    for static in (False, True):
        config = GenerationConfig(max_new_tokens=32, prefill_chunk=16, static_shapes=static)
        result = engine.generate(prompt, config)
        assert result.tokens == ref, static
        trees = result.stats.trees
        assert set(trees) <= LOOKUP_NAMES | {"ar"} and set(trees) & LOOKUP_NAMES, trees
        assert sum(result.stats.accepted) > 0


@pytest.mark.parametrize("family", FAMILY_VARIANTS)
def test_lookup_forests_are_lossless_and_accepted(family):
    """Every round a lookup forest (tree="lookup16x4": several chains from one root, one verify: the cache
    attention's forest tail on static shapes): == the target's greedy output, eager and on static shapes, alone
    and in a ragged batch; drafts were accepted."""
    target = make_tiny_target(family)
    prompts = [_repetitive(seed, n) for seed, n in ((4, 45), (3, 37), (2, 33))]  # all past longrope's 32
    refs = [reference_greedy(target, p, 24) for p in prompts]
    engine = SpeculativeEngine(target, random_drafter(target))
    for static in (False, True):
        config = GenerationConfig(
            max_new_tokens=24, prefill_chunk=16, static_shapes=static, tree="lookup16x4"
        )
        result = engine.generate(prompts[0], config)
        assert result.tokens == refs[0], static
        assert set(result.stats.trees) == {"lookup16x4"} and sum(result.stats.accepted) > 0
        results = engine.generate_batch(prompts, config)
        assert [r.tokens for r in results] == refs, static


def test_a_fixed_lookup_forest_runs_every_round_and_is_lossless():
    """tree="lookup16x2": that round shape every round (no policy, no drafter round), == greedy, eager and static."""
    target = make_tiny_target("qwen2")
    prompt = _repetitive(4, 45)
    ref = reference_greedy(target, prompt, 24)
    engine = SpeculativeEngine(target, random_drafter(target))
    for static in (False, True):
        result = engine.generate(
            prompt, GenerationConfig(max_new_tokens=24, tree="lookup16x2", static_shapes=static)
        )
        assert result.tokens == ref and set(result.stats.trees) == {"lookup16x2"}, static


def test_a_forest_accepts_the_branch_the_target_continues_and_reports_its_rank():
    """Greedy acceptance over a lookup forest takes the deepest accepted path, whichever branch holds it: here the
    latest match (branch 0) diverges after one draft and the older one (branch 1) runs on; the policy learns rank
    1 at depth 1, then 0 down the chain (`Lookup.model_widths`)."""
    from longspec.infer.accept import greedy_path
    from longspec.infer.pld import lookup_tree
    from longspec.infer.tree import forest_parts

    #                         "5 6" ends at 2 (-> 7 8 9) and at 7 (-> 7 1 4); the root is 6, after 5
    history = torch.tensor([[5, 6, 7, 8, 9, 3, 5, 6, 7, 1, 4, 5, 0, 0]])
    lookup = Lookup(3, 2)
    parents, depths, ancestor = forest_parts(1, 3, 2, "cpu")
    tree = lookup_tree(history, torch.tensor([11]), torch.tensor([6]), lookup, 2, (parents, depths, ancestor))
    assert tree.tokens.tolist() == [[6, 7, 7, 1, 8, 4, 9]] and tree.valid.all()
    # the target continues 6 -> 7 8 9 2: each node's argmax is its true next token where its path is right
    true_next = {(6,): 7, (6, 7): 8, (6, 7, 8): 9, (6, 7, 8, 9): 2}
    argmax = []
    for node in range(tree.num_nodes):
        path = tuple(tree.tokens[0, j].item() for j in range(node + 1) if ancestor[0, node, j])
        argmax.append(true_next.get(path, 0))
    path, length, bonus = greedy_path(
        tree.tokens, tree.parents, tree.depths, tree.ancestor_mask, torch.tensor([argmax]), tree.valid, 3
    )
    assert length.item() == 4 and bonus.item() == 2
    slots = path[0, : length.item()].tolist()
    assert [tree.tokens[0, j].item() for j in slots] == [6, 7, 8, 9]
    assert lookup.level_ranks(slots) == [1, 0, 0] and lookup.model_widths == (2, 1, 1)
    # what the shadow would report for this root (branch 0 matches 1 draft, branch 1 all 3) ranks the same
    assert lookup.ranks([1, 3]) == [1, 0, 0]


def test_lookup_ranks_take_the_first_longest_branch_within_the_lookup():
    assert Lookup(3, 2).ranks([1, 3]) == [1, 0, 0]
    assert Lookup(3, 2).ranks([2, 2]) == [0, 0]  # a tie: the lower slot, as greedy's argmax
    assert Lookup(3, 2).ranks([0, 0]) == [] and Lookup(3, 2).ranks([]) == []
    assert Lookup(2, 2).ranks([1, 5]) == [1, 0]  # cut at its length
    assert Lookup(3, 1).ranks([1, 3]) == [0]  # a chain sees branch 0 alone


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_auto_lookups_in_a_ragged_batch_equal_each_row_alone(family):
    target = make_tiny_target(family)
    prompts = [_repetitive(seed, n) for seed, n in ((2, 45), (3, 19), (4, 33))]
    refs = [reference_greedy(target, p, 16) for p in prompts]
    engine = SpeculativeEngine(target, random_drafter(target), costs=LookupCosts())
    for static in (False, True):
        results = engine.generate_batch(prompts, GenerationConfig(max_new_tokens=16, static_shapes=static))
        assert [r.tokens for r in results] == refs, static
        assert set().union(*(r.stats.trees for r in results)) & LOOKUP_NAMES
        assert sum(sum(r.stats.accepted) for r in results) > 0


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_pld_on_static_shapes_equals_eager_and_runs_one_ahead(family, monkeypatch):
    """pld drafts on the device (no host context): on static shapes its rounds launch one ahead, as the other
    methods' do, and every row of a ragged batch equals its greedy output."""
    target = make_tiny_target(family)
    prompts = [_repetitive(seed, n) for seed, n in ((5, 40), (6, 17), (7, 29))]
    refs = [reference_greedy(target, p, 18) for p in prompts]
    engine = SpeculativeEngine(target)  # no drafter: pld needs none
    events = []
    launch, finish = engine.runner.launch, engine.runner.settle
    monkeypatch.setattr(engine.runner, "launch", lambda *a, **k: (events.append("L"), launch(*a, **k))[1])
    monkeypatch.setattr(engine.runner, "settle", lambda rnd: (events.append("F"), finish(rnd))[1])
    for static in (False, True):
        events.clear()
        config = GenerationConfig(max_new_tokens=18, static_shapes=static, shrink_min_tokens=1000)
        results = engine.generate_batch(prompts, config, method="pld")
        assert [r.tokens for r in results] == refs, static
        assert sum(sum(r.stats.accepted) for r in results) > 0
        assert ("LLF" in "".join(events)) == static
    assert any(key[:2] == ("round", ("lookup", 10, 1, 3)) for key in engine.target_step.steps)


class AlternatingCosts:
    """Stub cost model: a lookup chain of 8 at even cache lengths, the drafter's (2, 2, 2) tree at odd ones."""

    def cost(self, widths, context_len):
        cheapest = Lookup(8) if context_len % 2 == 0 else DrafterTree((2, 2, 2))
        return 1.0 if widths == cheapest else 1000.0


def test_the_ring_after_lookup_rounds_is_the_prefill_of_the_committed_text():
    """A lookup round commits a path and a bonus (up to 9 tokens here) into the history only; the drafting round
    after it catches the ring up (`DraftStep.catch_up`, several tokens at once): at the end of the call the ring,
    caught up, equals the prefill of the committed text, eager and on static shapes, for ragged rows."""
    target = make_tiny_target("llama")
    prompts = [_repetitive(seed, n) for seed, n in ((8, 30), (9, 14))]
    for static in (False, True):
        engine = SpeculativeEngine(target, random_drafter(target), costs=AlternatingCosts())
        config = GenerationConfig(max_new_tokens=30, static_shapes=static, shrink_min_tokens=1000)
        results = engine.generate_batch(prompts, config)
        assert {"lookup8", "2-2-2"} <= set().union(*(r.stats.trees for r in results))
        assert max(max(r.stats.accepted) for r in results) >= 2  # a lookup round left several tokens behind
        draft = engine.draft_step
        draft.catch_up(engine.cache.lengths_t)
        got = [_ring_by_position(engine.drafter_cache, row) for row in range(2)]
        committed = [draft.history.tokens[row, :n].clone() for row, n in enumerate(engine.cache.lengths)]
        for text, prompt, result in zip(committed, prompts, results, strict=True):
            known = torch.cat([prompt, torch.tensor(result.tokens)])[: text.numel()]
            assert text[: known.numel()].tolist() == known.tolist()
        prefill_drafter(engine, committed)
        for row in range(2):
            reference = _ring_by_position(engine.drafter_cache, row)
            assert got[row].keys() == reference.keys()
            for position, key in reference.items():
                torch.testing.assert_close(got[row][position], key)


@pytest.mark.slow
def test_sampling_with_lookup_chains_reproduces_target_distribution(chi_square):
    """T=1 (top-k 10), the rrs rule asked for, every round a lookup chain (a prompt that repeats its tokens, so
    lookups propose and get accepted): a lookup has no draft distribution q, so it must take the
    deterministic-candidate rule; the first two tokens (jointly) and the 3rd follow the target's exact
    distributions over many seeds (enumerated with full forwards on a 16-token vocabulary)."""
    vocab, top_k, draws = 16, 10, 300
    target = sampling_target(vocab)
    prompt = torch.arange(vocab).repeat(2)[:24]  # every token occurs: a unigram always matches
    joint_12, marginal_3, _ = sampling_marginals(target, prompt, vocab, top_k)

    class AlwaysLookup:
        def cost(self, widths, context_len):
            return 1.0 if widths == Lookup(2) else 1000.0

    engine = SpeculativeEngine(target, random_drafter(target), costs=AlwaysLookup())
    counts_12, counts_3 = torch.zeros(vocab * vocab), torch.zeros(vocab)
    accepted = 0
    for seed in range(draws):
        config = GenerationConfig(
            max_new_tokens=3, temperature=1.0, top_k=top_k, seed=seed, sampling_rule="rrs"
        )
        result = engine.generate(prompt, config)
        assert set(result.stats.trees) == {"lookup2"}
        counts_12[result.tokens[0] * vocab + result.tokens[1]] += 1
        counts_3[result.tokens[2]] += 1
        accepted += sum(result.stats.accepted)
    assert accepted > draws // 10  # the accept branch ran, not only the residual one
    assert chi_square(counts_12, joint_12) > 1e-3
    assert chi_square(counts_3, marginal_3) > 1e-3


@pytest.mark.slow
def test_sampling_with_lookup_forests_reproduces_target_distribution(chi_square, monkeypatch):
    """T=1 (top-k 10), tree="lookup2x2" every round: every token of the prompt occurs twice with different
    successors, so a root's forest holds two chains whose first tokens differ, verified as siblings by the
    deterministic-candidate rule (the second tried with the residual of the first); the first two tokens (jointly)
    and the 3rd follow the target's exact distributions over many seeds."""
    vocab, top_k, draws = 16, 10, 300
    target = sampling_target(vocab)
    perm = torch.randperm(vocab, generator=torch.Generator().manual_seed(3))
    prompt = torch.cat([torch.arange(vocab), perm])  # every token twice, its successors differ
    joint_12, marginal_3, _ = sampling_marginals(target, prompt, vocab, top_k)
    ranks, level_ranks = [], Lookup.level_ranks
    monkeypatch.setattr(Lookup, "level_ranks", lambda *a: ranks.append(level_ranks(*a)) or ranks[-1])
    engine = SpeculativeEngine(target, random_drafter(target))
    counts_12, counts_3 = torch.zeros(vocab * vocab), torch.zeros(vocab)
    accepted = 0
    for seed in range(draws):
        config = GenerationConfig(max_new_tokens=3, temperature=1.0, top_k=top_k, seed=seed, tree="lookup2x2")
        result = engine.generate(prompt, config)
        assert set(result.stats.trees) == {"lookup2x2"}
        counts_12[result.tokens[0] * vocab + result.tokens[1]] += 1
        counts_3[result.tokens[2]] += 1
        accepted += sum(result.stats.accepted)
    assert accepted > draws // 10  # drafts were accepted, not only the residual sampled
    assert any(r[:1] == [1] for r in ranks)  # the second branch too, after the first was rejected
    assert chi_square(counts_12, joint_12) > 1e-3
    assert chi_square(counts_3, marginal_3) > 1e-3


def _reference_reports(
    context: list[int], rounds: list[tuple[int, int, bool]], length: int, max_ngram: int, branches: int = 1
) -> list[list[ShadowReport]]:
    """The reports the shadow should give after each round, from the reference lookup (`prompt_lookups` on the
    context up to the tracked root) and the text that follows: `rounds` = (root position, tokens the round emits,
    whether it ran no lookup). A round that ran no lookup tracks its root's lookup unless one is still tracked; a
    lookup round drops the tracked one. After each round the tracked lookup is closed where every branch is
    decided (a mismatch seen, or its whole draft matched), else reported open where its best match grew."""
    out, tracked = [], None  # [root, drafts, the best match already reported]
    for root, count, shadowed in rounds:
        reports = []
        if not shadowed:
            tracked = None
        elif tracked is None:
            drafts = prompt_lookups(torch.tensor(context[: root + 1]), length, max_ngram, branches)
            if drafts:
                tracked = [root, [d.tolist() for d in drafts], 0]
            else:
                reports.append(ShadowReport(()))
        if tracked is not None:
            start, drafts, reported = tracked
            after = context[start + 1 : root + count + 1]
            matched = tuple(_common_prefix(d, after) for d in drafts)
            if all(n == len(d) or n < len(after) for n, d in zip(matched, drafts, strict=True)):
                reports.append(ShadowReport(matched, reported, True))
                tracked = None
            elif max(matched) > reported:
                reports.append(ShadowReport(matched, reported, False))
                tracked[2] = max(matched)
        out.append(reports)
    return out


def test_a_quote_decoded_plain_is_reported_as_it_goes_on_and_closed_at_its_end():
    """A quote decoded plain, one token a round: the shadow lookup at its root reports open after its first
    matched draft and at every draft more (right-censored: the depths past it unknown), and once more, closed, at
    the mismatch, with no new draft; each report's `reported` is the drafts the earlier ones gave, so the new
    drafts add up to the run once. The roots inside the run start no lookup of their own; the first after it
    does: 0 never occurred before (nothing to draft: one closed empty report), root 7 drafts 8, 9, 1, ... and
    misses at once (closed with nothing matched)."""
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1]  # the lookup at the last 1 drafts 2, 3, ..., 9
    shadow = LookupShadow(prompt, 8, 1)
    reports = [shadow.extend([token], shadow=True) for token in [2, 3, 4, 0, 7, 5]]
    assert reports == [
        [ShadowReport((1,), 0, False)],
        [ShadowReport((2,), 1, False)],
        [ShadowReport((3,), 2, False)],
        [ShadowReport((3,), 3, True)],
        [ShadowReport(())],
        [ShadowReport((0,))],
    ]
    stream = [r for rs in reports[:4] for r in rs]
    assert sum(max(r.matched) - r.reported for r in stream) == 3
    context = prompt + [2, 3, 4, 0, 7, 5]
    rounds = [(len(prompt) - 1 + i, 1, True) for i in range(6)]
    assert reports == _reference_reports(context, rounds, 8, 1)


def test_a_full_match_closes_at_its_last_draft_and_a_round_covering_it_reports_once():
    """All drafts matched: closed by the last one, the next root tracks a lookup again. A round that emits a
    whole run at once (a drafter round) reports it once, closed."""
    prompt = [1, 2, 3, 4, 1]  # the lookup at the last 1 drafts 2, 3, 4, 1 (4 drafts of 8: the context ends)
    shadow = LookupShadow(prompt, 8, 1)
    assert shadow.extend([2, 3], shadow=True) == [ShadowReport((2,), 0, False)]
    assert shadow.extend([4, 1], shadow=True) == [ShadowReport((4,), 2, True)]
    assert shadow.extend([2], shadow=True) == [
        ShadowReport((1,), 0, False)
    ]  # root 1 again: drafts 2, 3, 4, 1, 2
    shadow = LookupShadow(prompt, 8, 1)
    assert shadow.extend([2, 3, 4, 9], shadow=False) == []  # a lookup round: its own outcome, no shadow
    shadow = LookupShadow(prompt, 8, 1)
    assert shadow.extend([2, 3, 4, 9], shadow=True) == [ShadowReport((3,))]  # one closed report, whole


def test_a_lookup_round_drops_the_shadow_without_closing_it():
    """A round that runs a lookup ends the pending shadow where it stands: its open reports stand (censored), no
    closed one follows (the lookup round's own outcome covers the text from there), and the next round that runs
    none tracks the lookup at its own root."""
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1]
    shadow = LookupShadow(prompt, 8, 1)
    assert shadow.extend([2, 3], shadow=True) == [ShadowReport((2,), 0, False)]
    assert shadow.extend([4, 5, 0], shadow=False) == []  # the lookup round: 4, 5 would have matched, 0 missed
    assert shadow.pending is None
    assert shadow.extend([7], shadow=True) == [
        ShadowReport(())
    ]  # root 0: never seen before, nothing to draft


@pytest.mark.parametrize("branches", [1, 3])
@pytest.mark.parametrize("vocab", [2, 5, 50])
def test_the_shadow_lookup_is_the_reference_lookup_and_its_common_prefix(vocab, branches):
    """`LookupShadow` (an incremental n-gram index on the host) drafts what `prompt_lookups` drafts at every
    length, and reports each tracked root's lookup as the reference does: open as its best match grows, closed
    once every branch is decided, dropped by a lookup round, a root inside a tracked run tracking none. Over a
    lookup's reports the new drafts add up to its best match."""
    rng = random.Random(vocab)
    for _ in range(30):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 25))]
        output = [rng.randrange(vocab) for _ in range(30)]
        shadow, context = LookupShadow(prompt, 8, 3, branches), list(prompt)
        for token in output:
            assert shadow.draft() == [
                d.tolist() for d in prompt_lookups(torch.tensor(context), 8, 3, branches)
            ]
            shadow._append(token)
            context.append(token)
        shadow, context, rounds, reports, i = LookupShadow(prompt, 8, 3, branches), list(prompt), [], [], 0
        while i < len(output):  # rounds of 1-4 tokens; about one in three ran a lookup (not shadowed)
            tokens = output[i : i + rng.randint(1, 4)]
            shadowed = rng.random() < 0.7
            rounds.append((len(context) - 1, len(tokens), shadowed))
            reports.append(shadow.extend(tokens, shadow=shadowed))
            context += tokens
            i += len(tokens)
        assert reports == _reference_reports(context, rounds, 8, 3, branches)
        best = 0  # what the reports of the lookup being reported gave so far
        for report in (r for rs in reports for r in rs):
            # a lookup's first report, or the next of the one before: each draft is given once
            assert report.reported in (0, best) and (
                max(report.matched, default=0) > report.reported or report.done
            )
            best = max(report.matched, default=0)


class PlainCosts:
    """Stub cost model: plain steps only (everything else priced out, explorations past the budget's floor)."""

    def cost(self, widths, context_len):
        return 1.0 if not widths.speculates else 1000.0


def test_plain_rounds_tell_the_policy_what_a_lookup_would_have_accepted(monkeypatch):
    """Every round plain, a ragged batch: the policy hears, per row, the shadow lookup's reports as the
    reference gives them on the decoded text (greedy: exact): each tracked root's lookup as its run happens and
    closed once resolved, the roots inside a tracked run tracking none."""
    target = make_tiny_target("llama")
    prompts = [_repetitive(seed, n) for seed, n in ((10, 30), (11, 17))]
    heard = []
    monkeypatch.setattr(AdaptivePolicy, "observe_shadow", lambda self, report: heard.append(report))
    engine = SpeculativeEngine(target, random_drafter(target), costs=PlainCosts())
    for static in (False, True):
        heard.clear()
        config = GenerationConfig(max_new_tokens=20, static_shapes=static, shrink_min_tokens=1000)
        results = engine.generate_batch(prompts, config)
        assert all(set(r.stats.trees) == {"ar"} for r in results)
        expected = []
        for prompt, result in zip(prompts, results, strict=True):
            context = prompt.tolist() + result.tokens  # each round's root: the prompt's last token onward
            # the rounds settled in the call, one token each
            rounds = [(p, 1, True) for p in range(prompt.numel(), prompt.numel() + len(result.tokens) - 1)]
            length, branches = max(c.length for c in AUTO_LOOKUPS), max(c.branches for c in AUTO_LOOKUPS)
            expected += [r for rs in _reference_reports(context, rounds, length, 3, branches) for r in rs]
        assert sorted(heard) == sorted(expected)
        assert any(not r.done for r in heard) and max(max(r.matched, default=0) for r in heard) > 0


@pytest.mark.parametrize("vocab", [3, 50, 200_000])
def test_the_shadow_indexes_a_prompt_as_appending_it_token_by_token(vocab):
    """The prompt's n-gram tables, built with array operations, draft what the index `_append` builds a token at a
    time drafts (every prompt length from 0, short ones included, then as the text goes on), for small and large
    vocabularies."""
    rng = random.Random(vocab)
    for size in [*range(6), 40, 300]:
        prompt = [rng.randrange(vocab) for _ in range(size)]
        built = LookupShadow([], 8, 3, 2)
        for token in prompt:
            built._append(token)
        shadow = LookupShadow(prompt, 8, 3, 2)
        assert shadow.context == built.context
        for token in [rng.randrange(vocab) for _ in range(12)]:
            assert shadow.draft() == built.draft()
            shadow._append(token)
            built._append(token)


def test_the_shadow_tells_apart_prompt_n_grams_whose_keys_collide(monkeypatch):
    """A key is a hash: n-grams sharing one are told apart by their tokens."""
    monkeypatch.setattr(
        shadow_module, "_PromptGrams", type("Colliding", (shadow_module._PromptGrams,), {"MULTIPLIER": 0})
    )
    prompt = [5, 1, 7, 5, 1, 9, 3, 1, 4, 5, 1]
    shadow = LookupShadow(prompt, 8, 2, 4)  # a key is now the n-gram's last token: "3 1" shares "5 1"'s
    expected = [
        [9, 3, 1, 4, 5, 1],
        [7, 5, 1, 9, 3, 1, 4, 5],
        [4, 5, 1],
    ]  # after "5 1" (latest first), then "1"
    assert shadow.draft() == expected == [d.tolist() for d in prompt_lookups(torch.tensor(prompt), 8, 2, 4)]
