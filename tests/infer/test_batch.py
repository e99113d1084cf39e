"""Batched generation (issue 13): a batch of prompts of different lengths decoded together is lossless per
sequence: at T=0 every sequence's tokens equal its own single-sequence greedy output, on every family, with
ragged acceptance (a forcing drafter) and sequences that finish early (EOS) while the others run."""

import copy
import dataclasses

import pytest
import torch
from infer_helpers import RING_BEHIND, WINDOW, CyclingCosts, OracleDrafter, random_drafter, reference_greedy

from longspec.drafter import DrafterConfig
from longspec.infer.accept import target_distribution
from longspec.infer.engine import GenerationConfig, SpeculativeEngine
from longspec.infer.slots import compaction
from longspec.testing import FAMILY_VARIANTS, make_tiny_target, tiny_hf_config

LENGTHS = (
    17,
    40,
    63,
)  # > drafter window 8 and Mistral's window 16; prefill chunks of 16 end at different rounds
# (not the LongRoPE variants: their batches need every prompt on one side of the original context,
# tests/infer/test_config_variants.py)
FAMILIES = [f for f in FAMILY_VARIANTS if tiny_hf_config(f).rope_parameters["rope_type"] != "longrope"]


def _prompts(seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=gen) for n in LENGTHS]


def _oracle(target, prompts, refs, favour=lambda p: p % 3 != 0):
    sequences = [p.tolist() + r + [0] * 16 for p, r in zip(prompts, refs, strict=True)]
    config = DrafterConfig.from_target_config(target.config, window=WINDOW)
    return OracleDrafter(config, sequences, favour)


@pytest.mark.parametrize("family", FAMILIES)
def test_batch_greedy_equals_each_sequence_alone(family):
    """Mixed prompt lengths, a fixed tree, ragged acceptance (the oracle accepts 0-2 tokens per round, at
    different rounds for different rows), and one sequence finishing early on an EOS."""
    target = make_tiny_target(family)
    prompts = _prompts()
    refs = [reference_greedy(target, p, 20) for p in prompts]
    eos = refs[1][4]  # sequence 1 stops after at most 5 tokens; the others may or may not meet it
    expected = [r[: r.index(eos) + 1] if eos in r else r for r in refs]
    assert len(expected[1]) <= 5 < max(len(e) for e in expected)
    engine = SpeculativeEngine(target, _oracle(target, prompts, refs))
    config = GenerationConfig(
        max_new_tokens=20, tree_widths=(2, 3, 3), prefill_chunk=16, eos_token_ids=(eos,)
    )
    results = engine.generate_batch(prompts, config)
    assert [r.tokens for r in results] == expected
    for result, tokens in zip(results, expected, strict=True):
        assert result.stats.num_new_tokens == len(tokens)
        # a row whose first token (the prefill's) is the EOS ran no round
        assert result.stats.trees == ({"2-3-3": result.stats.rounds} if result.stats.rounds else {})
    accepted = [r.stats.accepted for r in results if r.stats.rounds]
    assert max(max(a) for a in accepted) == 2 and min(min(a) for a in accepted) == 0
    # the early finisher ran fewer rounds: it stopped while the others went on
    assert results[1].stats.rounds < max(r.stats.rounds for r in results)


@pytest.mark.parametrize("family", FAMILIES)
def test_batch_with_real_drafter_and_baselines(family):
    """The real (random) drafter's batched draft step over ragged rows, and `ar` / `pld` through the same
    batched round, each equal to every sequence's own greedy output."""
    target = make_tiny_target(family)
    prompts = _prompts(seed=1)
    refs = [reference_greedy(target, p, 12) for p in prompts]
    engine = SpeculativeEngine(target, random_drafter(target))
    config = GenerationConfig(max_new_tokens=12, tree_widths=(2, 3), prefill_chunk=16)
    for method in ("longspec", "ar", "pld"):
        results = engine.generate_batch(prompts, config, method=method)
        assert [r.tokens for r in results] == refs, method
        if method == "ar":
            assert all(r.stats.rounds == 11 for r in results)


def test_batched_prefill_shares_the_chunk_budget(monkeypatch):
    """prefill_chunk is tokens per forward for the whole batch (per row, a forward's activations grew with the
    batch): 3 ragged rows with prefill_chunk=16 prefill 5 positions per forward, and the output is still every
    row's greedy output."""
    from longspec.infer.target_step import TargetStep

    target = make_tiny_target("llama")
    prompts = _prompts(seed=1)
    assert len(prompts) == 3
    refs = [reference_greedy(target, p, 6) for p in prompts]
    shapes = []
    forward = TargetStep.forward

    def spy(self, tokens, *args, **kwargs):
        shapes.append(tuple(tokens.shape))
        return forward(self, tokens, *args, **kwargs)

    monkeypatch.setattr(TargetStep, "forward", spy)
    engine = SpeculativeEngine(target, random_drafter(target))
    results = engine.generate_batch(
        prompts, GenerationConfig(max_new_tokens=6, prefill_chunk=16), method="ar"
    )
    assert [r.tokens for r in results] == refs
    longest = max(p.numel() for p in prompts)
    prefill = shapes[: -(6 - 1)]  # then one decode step per token after the prefill's
    assert prefill == [(3, min(5, longest - start)) for start in range(0, longest, 5)]


def test_batch_of_one_equals_generate():
    target = make_tiny_target("llama")
    prompt = _prompts()[1]
    ref = reference_greedy(target, prompt, 16)
    engine = SpeculativeEngine(target, _oracle(target, [prompt], [ref]))
    config = GenerationConfig(max_new_tokens=16, tree_widths=(2, 3, 3))
    alone = engine.generate(prompt, config)
    (batched,) = engine.generate_batch([prompt], config)
    assert alone.tokens == batched.tokens == ref
    assert alone.stats.accepted == batched.stats.accepted and sum(alone.stats.accepted) > 0


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_batch_static_shapes_equal_eager(family):
    """The static-shape path (what CUDA graphs capture: device-side per-row lengths, scatter writes, per-row
    sliding-window gathers), run uncaptured on CPU over a ragged batch."""
    target = make_tiny_target(family)
    prompts = _prompts(seed=2)
    refs = [reference_greedy(target, p, 14) for p in prompts]
    engine = SpeculativeEngine(target, _oracle(target, prompts, refs))
    for method in ("longspec", "ar"):
        config = GenerationConfig(max_new_tokens=14, tree_widths=(2, 3, 3), static_shapes=True)
        results = engine.generate_batch(prompts, config, method=method)
        assert [r.tokens for r in results] == refs, method


@pytest.mark.parametrize("family", FAMILIES)
def test_batch_tree_auto_mixes_trees_losslessly(family):
    target = make_tiny_target(family)
    prompts = _prompts(seed=5)
    refs = [reference_greedy(target, p, 16) for p in prompts]
    engine = SpeculativeEngine(target, random_drafter(target), costs=CyclingCosts())
    for static in (False, True):
        results = engine.generate_batch(prompts, GenerationConfig(max_new_tokens=16, static_shapes=static))
        assert [r.tokens for r in results] == refs, static
        trees = set().union(*(r.stats.trees for r in results))
        # rounds that leave the ring behind (plain or lookup) among drafting ones
        assert trees & RING_BEHIND and len(trees) >= 2, trees


def test_batch_tree_auto_measures_round_costs_at_the_batch_size(monkeypatch):
    from longspec.infer.policy import measure as round_costs

    timed = []  # rounds timed to measure costs
    time_rounds = round_costs._time_rounds
    monkeypatch.setattr(round_costs, "_time_rounds", lambda *a: (timed.append(a[1]), time_rounds(*a))[1])
    target = make_tiny_target("llama")
    prompts = _prompts()
    refs = [reference_greedy(target, p, 8) for p in prompts]
    engine = SpeculativeEngine(target, random_drafter(target))
    results = engine.generate_batch(prompts, GenerationConfig(max_new_tokens=8))
    assert [r.tokens for r in results] == refs
    assert [mode[-1] for mode in engine.cost_tables] == [len(prompts)]  # measured with 3 rows per round
    assert engine.cache.batch_size == len(prompts)
    # Another batch size is another cost table; the batch of one gets its own, and the batch's stays.
    assert timed
    timed.clear()
    assert engine.generate(prompts[0], GenerationConfig(max_new_tokens=8)).tokens == refs[0]
    assert sorted(mode[-1] for mode in engine.cost_tables) == [1, len(prompts)] and timed
    timed.clear()
    assert [r.tokens for r in engine.generate_batch(prompts, GenerationConfig(max_new_tokens=8))] == refs
    assert not timed  # back at 3 rows: its table is still there, nothing measured again


@pytest.mark.parametrize("rule", ["rrs", "deterministic"])
def test_batch_sampling_path_with_a_one_hot_target_is_greedy(rule):
    """T > 0 through the batched sampling path (per-row sampled trees, batched recursive rejection): with top_k=1
    the target distribution is one-hot, so every exact sample is the greedy token, eager and static."""
    target = make_tiny_target("qwen3")
    prompts = _prompts(seed=3)
    refs = [reference_greedy(target, p, 10) for p in prompts]
    engine = SpeculativeEngine(target, random_drafter(target))
    for static in (False, True):
        config = GenerationConfig(
            max_new_tokens=10, temperature=1.0, top_k=1, tree_widths=(2, 3), sampling_rule=rule,
            static_shapes=static,
        )  # fmt: skip
        assert [r.tokens for r in engine.generate_batch(prompts, config)] == refs


@pytest.mark.parametrize("rule", ["rrs", "deterministic"])
def test_batch_sampling_reproduces_each_rows_target_distribution(chi_square, rule):
    """The statistical test of batched sampling, end to end through `generate_batch`: three rows with different
    prompts, a vocabulary of 8 so every cell is populated, top-k shaping, one speculative round per call (a
    2-3 tree). Over 1200 seeds, per row: the first token (the prefill's) ~ p(. | prompt), and the second (the
    round's first) ~ p(. | prompt, t) given the row's most frequent first token t. Rows accept different paths in
    the same round, so a row verified against another row's q or target would show here."""
    target = make_tiny_target("llama", vocab_size=8, bos_token_id=0, eos_token_id=1, pad_token_id=0)
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 8, (n,), generator=gen) for n in (5, 9, 12)]
    engine = SpeculativeEngine(target, random_drafter(target))
    shaping = dict(temperature=1.0, top_k=6)
    outputs = []
    for seed in range(1200):
        config = GenerationConfig(
            max_new_tokens=2, tree_widths=(2, 3), sampling_rule=rule, seed=seed, **shaping
        )
        outputs.append([r.tokens[:2] for r in engine.generate_batch(prompts, config)])
    pairs = torch.tensor(outputs)  # [seeds, rows, 2]
    accepted = 0
    for row, prompt in enumerate(prompts):
        first, second = pairs[:, row, 0], pairs[:, row, 1]
        p_first = target_distribution(target.model(prompt[None]).logits[0, -1], **shaping)
        assert chi_square(torch.bincount(first, minlength=8).float(), p_first) > 1e-3, row
        t = int(torch.bincount(first, minlength=8).argmax())
        p_second = target_distribution(
            target.model(torch.cat([prompt, torch.tensor([t])])[None]).logits[0, -1], **shaping
        )
        given = second[first == t]
        assert chi_square(torch.bincount(given, minlength=8).float(), p_second) > 1e-3, row
    for result in engine.generate_batch(
        prompts, GenerationConfig(max_new_tokens=12, tree_widths=(2, 3), **shaping)
    ):
        accepted += sum(result.stats.accepted)
    assert accepted > 0  # the rule accepts drafts here, not only residual draws


def test_static_batches_run_in_power_of_two_buckets():
    """On static shapes a batch of 3 runs as the bucket of 4 (a frozen one-token padding row), so a batch of 4
    afterwards reuses every static step instead of building (on a GPU: capturing) new ones. (ar: every row
    emits one token per round, so no row finishes first and the batch never shrinks.)"""
    target = make_tiny_target("llama")
    prompts = _prompts(seed=7)
    refs = [reference_greedy(target, p, 10) for p in prompts]
    engine = SpeculativeEngine(target, random_drafter(target))
    config = GenerationConfig(max_new_tokens=10, static_shapes=True)
    results = engine.generate_batch(prompts, config, method="ar")
    assert [r.tokens for r in results] == refs and engine.cache.batch_size == 4
    steps = set(engine.target_step.steps)
    assert steps and all(key[-1] == 4 for key in steps)
    results = engine.generate_batch([*prompts, prompts[0]], config, method="ar")
    assert [r.tokens for r in results] == [*refs, refs[0]]
    assert set(engine.target_step.steps) == steps


@pytest.mark.parametrize("method", ["longspec", "pld"])
def test_finished_rows_leave_a_static_batch(method):
    """On static shapes, once half a batch has finished the rest moves to the smaller bucket (cache rows, ring
    rows and roots compacted): every row's output is still its own greedy output, to its own EOS."""
    target = make_tiny_target("qwen2")
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 256, (n,), generator=gen) for n in (21, 34, 15, 40)]
    refs = [reference_greedy(target, p, 14) for p in prompts]
    eos = (refs[0][2], refs[2][4])  # rows 0 and 2 stop early (others too, where they meet these tokens)
    expected = [next((r[: i + 1] for i, t in enumerate(r) if t in eos), r) for r in refs]
    assert sum(len(e) < 14 for e in expected) >= 2
    engine = SpeculativeEngine(target, random_drafter(target))
    config = GenerationConfig(
        max_new_tokens=14, tree_widths=(2, 2), static_shapes=True, eos_token_ids=eos, shrink_min_tokens=0
    )
    results = engine.generate_batch(prompts, config, method=method)
    assert [r.tokens for r in results] == expected
    assert engine.cache.batch_size < len(prompts)  # the batch shrank on the way
    # The rows moved in place: the same storage, and the smaller bucket's steps, built once, serve the next
    # call's shrink (with graphs: captured once, not inside every timed decode).
    storage, steps = engine.cache.nbytes(), dict(engine.target_step.steps)
    assert {key[-1] for key in steps} >= {4, engine.cache.batch_size}
    results = engine.generate_batch(prompts, config, method=method)
    assert [r.tokens for r in results] == expected and engine.cache.nbytes() == storage
    assert engine.target_step.steps.keys() == steps.keys()
    assert all(engine.target_step.steps[key] is step for key, step in steps.items())


@pytest.mark.parametrize("tree", ["auto", (2, 2)])
def test_warm_up_builds_every_step_a_shrinking_batch_runs(tree):
    """`SpeculativeEngine.warm_up` builds, before any timed call, the steps of the batch's bucket and of every
    smaller bucket a shrink reaches (under tree="auto" every candidate's, from that bucket's measured costs): a
    call whose rows finish early and shrink then builds nothing (on a GPU: captures nothing inside its timing).
    The control, a plain short call at the batch size (the earlier warm-up), leaves the shrink's steps to the
    timed call."""
    target = make_tiny_target("qwen2")
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 256, (n,), generator=gen) for n in (21, 34, 15, 40)]
    refs = [reference_greedy(target, p, 14) for p in prompts]
    eos = (refs[0][2], refs[2][4])
    expected = [next((r[: i + 1] for i, t in enumerate(r) if t in eos), r) for r in refs]
    widths = {"tree": "auto"} if tree == "auto" else {"tree_widths": tree}
    config = GenerationConfig(
        max_new_tokens=14, static_shapes=True, eos_token_ids=eos, shrink_min_tokens=0, **widths
    )
    for warm_up in (True, False):
        engine = SpeculativeEngine(target, random_drafter(target))
        if warm_up:
            engine.warm_up(max(prompts, key=len), config, batch_size=len(prompts))
        else:
            engine.reserve_for([p.numel() for p in prompts], config)
            engine.generate_batch(
                [max(prompts, key=len)] * len(prompts), dataclasses.replace(config, max_new_tokens=8)
            )
        built = set(engine.target_step.steps)
        if warm_up and tree == "auto":  # the ring's catch-up after plain rounds: at every bucket too
            assert {key[-1] for key in built if key[0] == "catch_up"} == {4, 2, 1}
        results = engine.generate_batch(prompts, config)
        assert [r.tokens for r in results] == expected
        assert engine.cache.batch_size < len(prompts)  # it shrank
        new = set(engine.target_step.steps) - built
        assert (not new) if warm_up else (new and all(key[-1] < len(prompts) for key in new)), new


def test_a_batch_shrinks_only_for_a_long_enough_tail():
    """Half the rows meet their EOS early: with 14 tokens of budget the batch stays in its bucket (the default
    shrink_min_tokens, 64: building the smaller bucket's steps would not pay for the last rounds); with 90 the
    rest moves to the smaller bucket while it still has more than 64 tokens to go. Lossless either way."""
    target = make_tiny_target("llama")
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 256, (n,), generator=gen) for n in (21, 34, 15, 40)]
    refs = [reference_greedy(target, p, 90) for p in prompts]
    eos = (refs[0][2], refs[2][4])
    for budget, shrinks in ((14, False), (90, True)):
        expected = [
            next((r[: i + 1] for i, t in enumerate(r[:budget]) if t in eos), r[:budget]) for r in refs
        ]
        assert sum(len(e) < 10 for e in expected) >= 2 and max(len(e) for e in expected) == budget
        engine = SpeculativeEngine(target, random_drafter(target))
        config = GenerationConfig(
            max_new_tokens=budget, tree_widths=(2, 2), static_shapes=True, eos_token_ids=eos
        )
        results = engine.generate_batch(prompts, config)
        assert [r.tokens for r in results] == expected
        assert (engine.cache.batch_size < len(prompts)) == shrinks, budget


def test_device_lengths_are_copied_once_per_change():
    """sync_length skips the device write when lengths_t already holds the host lengths (a round's draft, verify
    and commit steps start from the same ones), and writes again after any change; a compacted cache syncs."""
    engine = SpeculativeEngine(make_tiny_target("llama"))
    engine.reserve(32, batch_size=2)
    cache = engine.cache
    cache.commit([3, 5])
    cache.sync_length()
    assert cache.lengths_t.tolist() == [3, 5]
    cache.lengths_t.fill_(-7)  # a stand-in for "not written again": the next sync must leave it
    cache.sync_length()
    assert cache.lengths_t.tolist() == [-7, -7]
    cache.commit([1, 0])
    cache.sync_length()
    assert cache.lengths_t.tolist() == [4, 5]
    cache.move_rows(compaction([1]), 1)  # row 1 moves to the front, in place
    assert cache.lengths == [5] and cache.lengths_t.tolist() == [5] and engine.cache is cache
    cache.lengths_t.fill_(-7)
    cache.sync_length()
    assert cache.lengths_t.tolist() == [5]


def _learned(policy) -> tuple:
    """What a tree policy has learned: both families' acceptance counts and yield calibrations, and the
    observed round times."""
    return (
        policy.acceptance.hits,
        policy.acceptance.trials,
        policy.lookup_acceptance.hits,
        policy.lookup_acceptance.trials,
        vars(policy.calibration),
        vars(policy.lookup_calibration),
        policy.costs.mean,
    )


def test_warm_up_teaches_the_tree_policy_nothing():
    """`warm_up`'s short calls decode one prompt at every bucket; what the drafter accepts there is not what it
    accepts on the batch, so the policies come out of it as they went in: none on a fresh engine (its round
    costs, measured, are kept), and after a real batch taught one, that one unchanged. The control: the same
    short calls through `generate_batch` do change it."""
    target = make_tiny_target("llama")
    prompts = _prompts(3)
    refs = [reference_greedy(target, p, 12) for p in prompts]
    config = GenerationConfig(max_new_tokens=12, static_shapes=True, tree="auto")
    engine = SpeculativeEngine(target, random_drafter(target))
    engine.warm_up(max(prompts, key=len), config, batch_size=len(prompts))
    assert engine.policies == {} and engine.cost_tables
    results = engine.generate_batch(prompts, config)
    assert [r.tokens for r in results] == refs
    (key, policy), *others = engine.policies.items()
    assert not others and policy.costs.mean  # it learned from the batch (its round times at least)
    before = copy.deepcopy(_learned(policy))
    engine.warm_up(max(prompts, key=len), config, batch_size=len(prompts))
    assert list(engine.policies) == [key] and _learned(engine.policies[key]) == before
    engine.generate_batch(
        [max(prompts, key=len)] * len(prompts), dataclasses.replace(config, max_new_tokens=8)
    )
    assert _learned(engine.policies[key]) != before
