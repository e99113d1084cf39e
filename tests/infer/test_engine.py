"""The engine against a target-only reference: lossless greedy on every family, forced acceptance patterns,
hybrid verification logits, drafter state size, and the T=1 sampler's distribution."""

import pytest
import torch
from infer_helpers import WINDOW, OracleDrafter, random_drafter, reference_greedy

from longspec.drafter import DrafterConfig
from longspec.drafter.vocab import DraftVocab
from longspec.infer.candidates import DEFAULT_TREE_WIDTHS
from longspec.infer.engine import GenerationConfig, SpeculativeEngine, cache_slots
from longspec.infer.tree import TreeLayout, beam_step
from longspec.testing import FAMILY_VARIANTS, make_tiny_target


@pytest.fixture(scope="module")
def llama():
    return make_tiny_target("llama")


@pytest.mark.parametrize("family", FAMILY_VARIANTS)
def test_greedy_speculative_equals_target_greedy(family):
    """Prompt 45 tokens > drafter window 8 and > Mistral's sliding window 16; prefill in chunks of 16."""
    target = make_tiny_target(family)
    prompt = torch.randint(0, 256, (45,))
    ref = reference_greedy(target, prompt, 24)
    engine = SpeculativeEngine(target, random_drafter(target))
    config = GenerationConfig(max_new_tokens=24, prefill_chunk=16)
    for method in ("longspec", "ar", "pld"):
        result = engine.generate(prompt, config, method=method)
        assert result.tokens == ref, method
        assert result.stats.rounds >= 3
        assert result.stats.num_new_tokens == 24


def some_draft_vocab(vocab_size: int, size: int, seed: int = 0) -> DraftVocab:
    """`size` ids drawn at random: which ids a draft vocabulary holds never changes the output, only the speed."""
    generator = torch.Generator().manual_seed(seed)
    return DraftVocab(torch.randperm(vocab_size, generator=generator)[:size].sort().values, vocab_size)


@pytest.mark.parametrize(
    ("family", "static"), [(family, False) for family in FAMILY_VARIANTS] + [("llama", True), ("qwen2", True)]
)
def test_greedy_with_a_draft_vocabulary_equals_target_greedy(family, static):
    """A drafter over 64 of the 256 ids (its head the target head's rows of them, drafts mapped back to target
    ids on the device): a trained-looking tree, a chain and tree=auto all keep the target's greedy output."""
    target = make_tiny_target(family)
    prompt = torch.randint(0, 256, (45,))
    ref = reference_greedy(target, prompt, 24)
    drafter = random_drafter(target)
    drafter.use_draft_vocab(some_draft_vocab(target.config.vocab_size, 64))
    assert drafter.logits(torch.randn(2, drafter.config.hidden_size)).shape == (2, 64)
    engine = SpeculativeEngine(target, drafter)
    for tree in ((4, 4, 4), (1,), None):
        config = GenerationConfig(max_new_tokens=24, prefill_chunk=16, tree_widths=tree, static_shapes=static)
        result = engine.generate(prompt, config)
        assert result.tokens == ref, tree


def test_drafts_are_target_ids_of_the_draft_vocabulary(llama):
    """Every drafted token lies in the draft vocabulary (mapped from draft ids), and the roots' children are the
    argmax of the reduced head over those ids."""
    drafter = random_drafter(llama)
    vocab = some_draft_vocab(llama.config.vocab_size, 16, seed=3)
    drafter.use_draft_vocab(vocab)
    hidden = torch.randn(3, drafter.config.hidden_size)
    full = drafter.lm_head(hidden)
    want = vocab.ids[full[:, vocab.ids].argmax(-1)]
    assert torch.equal(drafter.draft_ids[drafter.logits(hidden).argmax(-1)], want)
    # The draft step's pick, the map applied with the argmax: a chain's level (the drafter's own pick, and the
    # beam step of width one) and a tree's level of one parent.
    logits = drafter.logits(hidden)[:, None, :]  # [3, 1, Kd]
    assert torch.equal(drafter.pick(hidden[:, None, :])[:, 0], want)
    assert torch.equal(beam_step(None, logits, 1, scores=False, ids=drafter.draft_ids)[1][:, 0], want)
    parents, tokens, _ = beam_step(None, logits, 2, scores=True, ids=drafter.draft_ids)
    assert torch.equal(tokens[:, 0], want) and torch.isin(tokens, vocab.ids).all() and not parents.any()
    probs = torch.softmax(drafter.logits(hidden), -1)
    spread = drafter.target_probs(probs)
    assert spread.shape == full.shape and torch.allclose(spread.sum(-1), torch.ones(3))
    outside = torch.ones(llama.config.vocab_size, dtype=torch.bool)
    outside[vocab.ids] = False
    assert not spread[:, outside].any()


@pytest.mark.parametrize(
    "name, favour",
    [("all", lambda p: True), ("none", lambda p: False), ("some", lambda p: p % 3 != 0)],
)
def test_forced_acceptance(llama, name, favour):
    prompt = torch.randint(0, 256, (20,))
    ref = reference_greedy(llama, prompt, 30)
    sequence = prompt.tolist() + ref + [0] * 16
    config = DrafterConfig.from_target_config(llama.config, window=WINDOW)
    engine = SpeculativeEngine(llama, OracleDrafter(config, [sequence], favour))
    fixed = GenerationConfig(max_new_tokens=30, tree_widths=DEFAULT_TREE_WIDTHS)
    result = engine.generate(prompt, fixed, method="longspec")
    assert result.tokens == ref
    assert result.stats.trees == {"4-16-16-16-16": result.stats.rounds}  # a fixed tree runs every round
    accepted = result.stats.accepted
    depth = len(DEFAULT_TREE_WIDTHS)
    if name == "all":
        assert accepted == [depth] * len(accepted)
        assert result.stats.mean_accept_length == depth + 1
    elif name == "none":
        assert accepted == [0] * 29 and result.stats.mean_accept_length == 1.0
    else:  # a token at a position divisible by 3 is never drafted: at most 2 accepted per round
        assert max(accepted) == 2 and min(accepted) == 0 and 0 < sum(accepted)
    hist = result.stats.accept_histogram
    assert sum(hist) == result.stats.rounds and sum(k * c for k, c in enumerate(hist)) == sum(accepted)


def test_hybrid_verification_equals_full_forward(llama):
    """Every tree node's verify logits == the full causal forward over prompt + that node's path."""
    prompt = torch.randint(0, 256, (30,))
    engine = SpeculativeEngine(llama, random_drafter(llama))
    config = GenerationConfig(max_new_tokens=8, tree_widths=(2, 3, 3), prefill_chunk=7)
    layout = TreeLayout(config.tree_widths)
    engine.reserve(64)
    roots = engine.runner.start([prompt], config, None, history=True, ring=True)
    batched = engine.runner.draft(roots, layout)
    static_tree = engine.runner.draft(roots, layout, static=True)  # the path a CUDA graph captures
    for a, b in zip(batched.dynamic_part(), static_tree.dynamic_part(), strict=True):
        assert torch.equal(a, b)
    logits = engine.runner.verify(batched)[0]  # [N, V]
    tree = batched.row(0)
    for node in range(tree.num_nodes):
        path = tree.tokens[tree.ancestor_mask[node]]
        full = llama.model(torch.cat([prompt, path])[None]).logits[0, -1]
        torch.testing.assert_close(logits[node], full, rtol=1e-4, atol=1e-4)
    assert engine.cache.length == prompt.numel()  # verification alone commits nothing


def test_drafter_state_is_independent_of_context_length(llama):
    engine = SpeculativeEngine(llama, random_drafter(llama))
    config = GenerationConfig(max_new_tokens=6)
    sizes = []
    for length in (12, 200):
        engine.generate(torch.randint(0, 256, (length,)), config)
        sizes.append(engine.drafter_cache.nbytes)
    assert sizes[0] == sizes[1]
    assert engine.cache.max_len >= 200  # the target cache, by contrast, grows with the context


def test_caches_are_allocated_once(llama):
    """reserve() sizes the static target cache; later calls (any length up to it) reuse the same storage."""
    engine = SpeculativeEngine(llama, random_drafter(llama))
    engine.reserve(cache_slots([150], GenerationConfig(max_new_tokens=8)))
    pointers = (engine.cache.keys.data_ptr(), engine.drafter_cache.keys.data_ptr())
    for length in (150, 20):
        engine.generate(torch.randint(0, 256, (length,)), GenerationConfig(max_new_tokens=8))
        assert (engine.cache.keys.data_ptr(), engine.drafter_cache.keys.data_ptr()) == pointers


@pytest.mark.parametrize("method, tree", [("ar", "auto"), ("longspec", (1, 1))])
def test_chain_rounds_build_no_tree(llama, monkeypatch, method, tree):
    """A plain round's tree, and a drafter chain's parents, depths and ancestors, are constant parts made once per
    batch size: no op per round builds them (on the GPU each would be a launch, in a round that should cost
    about one AR step)."""
    import longspec.infer.tree as tree_module

    built = []
    parts = tree_module.forest_parts
    monkeypatch.setattr(tree_module, "forest_parts", lambda *a: built.append(a) or parts(*a))
    monkeypatch.setattr(tree_module.DraftTree, "set_level", None)  # a chain writes no level
    drafter = random_drafter(llama) if method == "longspec" else None
    engine = SpeculativeEngine(llama, drafter)
    prompt = torch.randint(0, 256, (30,))
    config = GenerationConfig(max_new_tokens=12, static_shapes=True, tree=tree)
    tokens = engine.generate(prompt, config, method=method).tokens
    assert tokens == reference_greedy(llama, prompt, 12)
    assert len(built) == 1  # the first round's, kept


@pytest.mark.parametrize("batch", [1, 3])
def test_reserve_for_is_what_a_call_needs(llama, batch):
    """reserve_for sizes the cache exactly as generate_batch will ask (a batch of 3 on static shapes runs in a
    bucket of 4): the longest prompt's call neither reallocates nor drops the static steps built before it (a
    reservation one round short once re-captured every graph inside the eval's timed decode)."""
    engine = SpeculativeEngine(llama, random_drafter(llama))
    config = GenerationConfig(max_new_tokens=8, static_shapes=True)
    prompts = [torch.randint(0, 256, (n,)) for n in (40, 25, 33)[:batch]]
    engine.reserve_for([p.numel() for p in prompts], config)
    # method "ar": every row emits one token a round, so no row leaves the batch early (a shrink is another
    # cache by design: `SpeculativeEngine._select_slots`)
    engine.generate_batch([p[:5] for p in prompts], config, method="ar")  # builds the static steps
    pointer, steps = engine.cache.keys.data_ptr(), dict(engine.target_step.steps)
    assert steps
    engine.generate_batch(prompts, config, method="ar")
    assert engine.cache.keys.data_ptr() == pointer
    assert all(engine.target_step.steps.get(key) is step for key, step in steps.items())
    assert engine.cache.batch_size == (1 if batch == 1 else 4)


def test_a_grown_cache_frees_the_old_one_before_allocating(llama, monkeypatch):
    """Growing the cache (a longer call, more rows) must not hold the old and the new together: at 32K x batch 16
    on the 8B shape the two did not fit on the GPU (a local reference kept the old one alive). A smaller batch
    works on the first rows of the cache it finds."""
    import gc
    import weakref

    from longspec.infer import target_step

    engine = SpeculativeEngine(llama, random_drafter(llama))
    engine.reserve(64, batch_size=2)
    allocate = target_step.StaticKVCache.for_target
    seen = []

    def spy(*args, **kwargs):
        gc.collect()
        seen.append(old() is None)
        return allocate(*args, **kwargs)

    monkeypatch.setattr(target_step.StaticKVCache, "for_target", spy)
    for needed, batch_size in ((128, 2), (128, 4)):  # longer, then more rows
        old = weakref.ref(engine.cache)
        engine.reserve(needed, batch_size=batch_size)
    assert seen == [True, True] and engine.cache.batch_size == 4
    engine.reserve(100, batch_size=1)  # fewer rows, fewer slots: the same storage, its first row
    assert len(seen) == 2 and engine.cache.batch_size == 1 and engine.cache.capacity == 4


def test_eos_and_max_new_tokens_truncate(llama):
    prompt = torch.randint(0, 256, (16,))
    ref = reference_greedy(llama, prompt, 12)
    eos = ref[5]
    engine = SpeculativeEngine(llama, random_drafter(llama))
    result = engine.generate(prompt, GenerationConfig(max_new_tokens=12, eos_token_ids=(eos,)))
    assert result.tokens == ref[: ref.index(eos) + 1]
    assert engine.generate(prompt, GenerationConfig(max_new_tokens=1)).tokens == ref[:1]


class TableDrafter(OracleDrafter):
    """Stub drafter proposing from a fixed [V, V] table of next-token logits keyed by the node's own token."""

    def __init__(self, config: DrafterConfig, table: torch.Tensor):
        self.config, self.table = config, table

    def hidden(self, input_ids, positions):
        return input_ids[..., None].float()

    def logits(self, hidden):
        return self.table[hidden[..., 0].long()]


def sampling_target(vocab: int):
    """A tiny llama target over `vocab` tokens with no special tokens and peaked logits (initializer_range 0.2), so
    the sampling tests' distributions are far from uniform and every token is a candidate."""
    return make_tiny_target(
        "llama",
        vocab_size=vocab,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        initializer_range=0.2,
    )


def sampling_marginals(target, prompt: torch.Tensor, vocab: int, top_k: int):
    """Exact target distributions (top-k, T=1), by enumeration: the joint of the first two generated tokens
    [V*V], the marginal of the 3rd [V], and the conditional table p(t2 | prompt, t1) [V, V]."""

    def next_probs(prefixes: torch.Tensor) -> torch.Tensor:  # [M, L] -> [M, V], top-k then softmax
        logits = target.model(prefixes).logits[:, -1]
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        return torch.softmax(logits.masked_fill(logits < kth, float("-inf")), dim=-1)

    p1 = next_probs(prompt[None])[0]  # [V]
    all_t1 = torch.arange(vocab)
    p2_given_1 = next_probs(torch.cat([prompt.expand(vocab, -1), all_t1[:, None]], 1))  # [V(t1), V]
    pairs = torch.cartesian_prod(all_t1, all_t1)  # [V*V, 2] (t1, t2)
    p3_given_12 = next_probs(torch.cat([prompt.expand(vocab * vocab, -1), pairs], 1))  # [V*V, V]
    joint_12 = (p1[:, None] * p2_given_1).flatten()  # [V*V]
    return joint_12, (joint_12[:, None] * p3_given_12).sum(0), p2_given_1


def sample_counts(engine, prompt, vocab: int, top_k: int, draws: int, widths):
    """`draws` seeded T=1 generations of 3 tokens -> (counts of the first two tokens jointly [V*V], of the 3rd
    [V], the number of accepted drafts)."""
    counts_12, counts_3 = torch.zeros(vocab * vocab), torch.zeros(vocab)
    accepted = 0
    for seed in range(draws):
        config = GenerationConfig(
            max_new_tokens=3, temperature=1.0, top_k=top_k, seed=seed, tree_widths=widths
        )
        result = engine.generate(prompt, config)
        counts_12[result.tokens[0] * vocab + result.tokens[1]] += 1
        counts_3[result.tokens[2]] += 1
        accepted += sum(result.stats.accepted)
    return counts_12, counts_3, accepted


@pytest.mark.slow
@pytest.mark.parametrize("widths", [(4, 8, 8), (1, 1)])
def test_sampling_generate_reproduces_target_distribution(chi_square, widths):
    """T=1 (top-k 10) through the whole engine: the first two generated tokens (jointly) and the 3rd, over many
    seeds, follow the target's exact distributions (enumerated with full forwards on a 16-token vocabulary). The stub drafter
    proposes the target's own likeliest tokens after the first one, so the root's children hold most of the
    mass and every branch of the acceptance rule runs often (a sampler that skips the renormalisation after
    a rejection fails this test: p = 4e-6 on the joint when checked by hand). A chain of two runs the chain's
    own draft (one draw per level) and acceptance (`sample_chain_path`)."""
    vocab, top_k, draws = 16, 10, 400
    target = sampling_target(vocab)
    prompt = torch.randint(0, vocab, (10,))
    joint_12, marginal_3, p2_given_1 = sampling_marginals(target, prompt, vocab, top_k)
    config = DrafterConfig.from_target_config(target.config, window=4)
    engine = SpeculativeEngine(target, TableDrafter(config, p2_given_1.clamp_min(1e-9).log()))
    counts_12, counts_3, accepted = sample_counts(engine, prompt, vocab, top_k, draws, widths)
    assert accepted > draws // 2  # the accept branch ran often, not only the residual one
    assert chi_square(counts_12, joint_12) > 1e-3
    assert chi_square(counts_3, marginal_3) > 1e-3


class ReducedTableDrafter(TableDrafter):
    """TableDrafter over a draft vocabulary: its logits are the table's columns of the draft ids (by draft id),
    mapped back to target ids by the real Drafter methods, as a reduced head's are."""

    def __init__(self, config: DrafterConfig, table: torch.Tensor, vocab: DraftVocab):
        super().__init__(config, table[:, vocab.ids])
        self.draft_vocab, self._draft_ids = vocab, vocab.ids


@pytest.mark.slow
@pytest.mark.parametrize("widths", [(4, 8, 8)])
def test_sampling_with_a_draft_vocabulary_reproduces_target_distribution(chi_square, widths):
    """The T=1 chi-square of the whole engine with a drafter over 10 of the 16 ids: the target's likeliest tokens
    outside the draft vocabulary are never drafted, so they come only from the residual max(p - q, 0) over the
    target's full vocabulary, and the output still follows the target's distribution exactly."""
    vocab, top_k, draws = 16, 10, 400
    target = sampling_target(vocab)
    prompt = torch.randint(0, vocab, (10,))
    joint_12, marginal_3, p2_given_1 = sampling_marginals(target, prompt, vocab, top_k)
    # leave out the first token's two likeliest continuations of the likeliest first token
    first = int(joint_12.view(vocab, vocab).sum(1).argmax())
    left_out = p2_given_1[first].topk(2).indices
    keep = torch.ones(vocab, dtype=torch.bool)
    keep[left_out] = False
    draft_vocab = DraftVocab(torch.arange(vocab)[keep][:10], vocab)
    config = DrafterConfig.from_target_config(target.config, window=4)
    drafter = ReducedTableDrafter(config, p2_given_1.clamp_min(1e-9).log(), draft_vocab)
    engine = SpeculativeEngine(target, drafter)
    counts_12, counts_3, accepted = sample_counts(engine, prompt, vocab, top_k, draws, widths)
    assert accepted > draws // 4  # drafts were accepted often, not only the residual branch
    assert counts_12.view(vocab, vocab)[:, left_out].sum() > 0  # the left-out ids still came out
    assert chi_square(counts_12, joint_12) > 1e-3
    assert chi_square(counts_3, marginal_3) > 1e-3


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral"])
def test_static_shape_rounds_equal_eager(family):
    """The path CUDA graphs capture (device-side cache length, index_copy_ writes, fixed-size sliding window),
    run uncaptured on CPU; prompts longer than Mistral's window of 16."""
    target = make_tiny_target(family)
    prompt = torch.randint(0, 256, (30,))
    ref = reference_greedy(target, prompt, 16)
    engine = SpeculativeEngine(target, random_drafter(target))
    for method in ("longspec", "ar", "pld"):
        result = engine.generate(
            prompt, GenerationConfig(max_new_tokens=16, static_shapes=True), method=method
        )
        assert result.tokens == ref, method
    # a second, longer call grows the cache once and still matches
    longer = torch.randint(0, 256, (70,))
    result = engine.generate(longer, GenerationConfig(max_new_tokens=8, static_shapes=True))
    assert result.tokens == reference_greedy(target, longer, 8)


@pytest.mark.parametrize("static", [False, True])
def test_static_rounds_run_one_ahead(llama, static, monkeypatch):
    """On static shapes round k + 1 is launched before round k settles (its tokens reach the host while the
    next round runs); eager rounds settle one by one. Both write the target's greedy output, and the last
    launched round is not wasted when max_new_tokens ends the call."""
    engine = SpeculativeEngine(llama, random_drafter(llama))
    events = []
    launch, finish = engine.runner.launch, engine.runner.settle

    def spy_launch(*args, **kwargs):
        out = launch(*args, **kwargs)
        events.append("L")
        return out

    def spy_finish(rnd):
        events.append("F")
        return finish(rnd)

    monkeypatch.setattr(engine.runner, "launch", spy_launch)
    monkeypatch.setattr(engine.runner, "settle", spy_finish)
    prompt = torch.randint(0, 256, (24,))
    config = GenerationConfig(max_new_tokens=20, static_shapes=static, tree_widths=(2, 2))
    result = engine.generate(prompt, config)
    assert result.tokens == reference_greedy(llama, prompt, 20)
    order = "".join(events)
    assert order.count("L") == order.count("F") == result.stats.rounds
    assert ("LLF" in order) == static and order.endswith("F")


def test_cuda_graphs_need_cuda(llama):
    engine = SpeculativeEngine(llama, random_drafter(llama))
    with pytest.raises(ValueError, match="CUDA"):
        engine.generate([1, 2, 3], GenerationConfig(max_new_tokens=4, cuda_graphs=True))


def test_bf16_drafter_keeps_fp32_rope_frequencies(llama):
    """Module.to(bfloat16) must not round RoPE frequencies (angles at 30K positions would be off by radians)."""
    drafter = random_drafter(llama).to(dtype=torch.bfloat16)
    assert drafter.rotary.inv_freq.dtype == torch.float32
    assert drafter.self_attn.q_proj.weight.dtype == torch.bfloat16


def test_no_gc_pauses_the_collector_and_restores_it():
    """What a capture runs under (`StaticStep`; the GPU test shows why): the cyclic collector off inside, and
    afterwards as it was, after an error too."""
    import gc

    from longspec.infer.graphs import no_gc

    assert gc.isenabled()
    with pytest.raises(RuntimeError), no_gc():
        assert not gc.isenabled()
        raise RuntimeError
    assert gc.isenabled()
    gc.disable()
    try:
        with no_gc():
            assert not gc.isenabled()
        assert not gc.isenabled()  # left off: it was off before
    finally:
        gc.enable()


def test_the_uncaptured_static_step_hands_out_its_outputs_as_a_graph_does():
    """`StaticStep(capture=False)`, the CPU twin of a captured step: its outputs are the same tensors every call,
    overwritten by the next call, as a graph's replay overwrites its static outputs (the twin handed out fresh
    tensors, so a read after the next call was right on the CPU and wrong on the GPU)."""
    from longspec.infer.graphs import StaticStep

    step = StaticStep(lambda x: (x * 2, [x + 1, None]), (torch.zeros(3),), capture=False)
    first = step(torch.ones(3))
    kept = first[0]
    second = step(torch.full((3,), 5.0))
    assert second[0] is kept and second[1][0] is first[1][0] and second[1][1] is None
    assert (
        kept.tolist() == [10.0] * 3 and second[1][0].tolist() == [6.0] * 3
    )  # the first call's values are gone


def test_generation_config_takes_plausible_types_and_names_the_field_it_refuses():
    """One eos id (a tokenizer's eos_token_id: an int, or None) and integers of other kinds are taken; a wrong type
    is one TypeError naming its field (a float max_new_tokens once failed deep in the cache's allocation, an int
    eos with "'int' object is not iterable", and eos_token_ids="12" meant the ids (1, 2))."""
    assert GenerationConfig(eos_token_ids=7).eos_token_ids == (7,)
    assert GenerationConfig(eos_token_ids=None).eos_token_ids == ()
    assert GenerationConfig(eos_token_ids=torch.tensor(7)).eos_token_ids == (7,)
    assert GenerationConfig(eos_token_ids=[7, torch.tensor(8)]).eos_token_ids == (7, 8)
    config = GenerationConfig(max_new_tokens=torch.tensor(5), temperature=1, top_p=1, tree_widths=[2, 2])
    assert (config.max_new_tokens, config.temperature, config.top_p) == (5, 1.0, 1.0)
    assert type(config.max_new_tokens) is int and config.tree_widths == (2, 2)
    for field, value in (
        ("max_new_tokens", 2.5), ("max_new_tokens", "8"), ("top_k", 2.0), ("seed", None), ("prefill_chunk", 1.0),
        ("temperature", None), ("temperature", "0.7"), ("top_p", "1"),
        ("eos_token_ids", "12"), ("eos_token_ids", 2.0), ("eos_token_ids", [None]),
        ("tree_widths", 4), ("tree_widths", "4-16"), ("tree_widths", [4.0]), ("tree", 4),
    ):  # fmt: skip
        with pytest.raises(TypeError, match=field):
            GenerationConfig(**{field: value})


def test_a_prompt_of_the_wrong_shape_or_kind_is_one_error(llama):
    """Prompts were cast to long and flattened: a [2, T] tensor given to `generate` decoded as one prompt of 2T
    tokens, a flat list of ids given to `generate_batch` as T one-token prompts, float ids were truncated; each
    is now one error. What a user plausibly passes for one prompt ([T], [1, T], list, numpy, int32) and for a
    batch (list, [B, T] tensor, generator) decodes as before."""
    engine = SpeculativeEngine(llama)
    config = GenerationConfig(max_new_tokens=3)
    prompt = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(0))
    ref = engine.generate(prompt, config, method="ar").tokens
    for same in (prompt[None], prompt.tolist(), prompt.numpy(), prompt.int()):
        assert engine.generate(same, config, method="ar").tokens == ref
    for batch in (torch.stack([prompt, prompt]), (p for p in [prompt, prompt])):
        assert [r.tokens for r in engine.generate_batch(batch, config, method="ar")] == [ref, ref]
    for call, error, match in (
        (
            lambda: engine.generate(torch.stack([prompt, prompt]), config, method="ar"),
            ValueError,
            r"shape \[2, 12\].*generate_batch",
        ),
        (
            lambda: engine.generate_batch(prompt.tolist(), config, method="ar"),
            TypeError,
            "prompt 0 is one token id",
        ),
        (lambda: engine.generate_batch(prompt, config, method="ar"), TypeError, "prompt 0 is one token id"),
        (lambda: engine.generate(prompt.float(), config, method="ar"), TypeError, "must be integers"),
        (lambda: engine.generate("some text", config, method="ar"), TypeError, "not text"),
        (lambda: engine.generate_batch("some text", config, method="ar"), TypeError, "not text"),
        (
            lambda: engine.generate([[1, 2], [3]], config, method="ar"),
            TypeError,
            "not a sequence of token ids",
        ),
    ):
        with pytest.raises(error, match=match):
            call()
    assert engine.generate(prompt, config, method="ar").tokens == ref


def test_a_config_that_is_not_a_generation_config_is_one_error(llama):
    """A dict, None, or the method passed where the config goes was an AttributeError on the config's first field
    read (`'str' object has no attribute 'cuda_graphs'`); now one TypeError naming the argument."""
    engine = SpeculativeEngine(llama)
    for config in ({"max_new_tokens": 4}, None, "ar"):
        with pytest.raises(TypeError, match="config must be a GenerationConfig"):
            engine.generate([1, 2, 3], config)
    assert (
        engine.generate([1, 2, 3], GenerationConfig(max_new_tokens=4), method="ar").stats.num_new_tokens == 4
    )


def test_prompts_outside_the_vocabulary_or_empty_are_one_error(llama):
    engine = SpeculativeEngine(llama, random_drafter(llama))
    config = GenerationConfig(max_new_tokens=4)
    vocab = llama.embed_tokens.num_embeddings
    for prompts, match in (
        ([[1, 2, vocab]], r"token ids must lie in \[0, "),
        ([[3, 4], [-1, 5]], r"token ids must lie in \[0, "),
        ([[1, 2], []], "empty prompt"),
        ([], "no prompts"),
    ):
        with pytest.raises(ValueError, match=match):
            engine.generate_batch(prompts, config)
    assert engine.generate([1, 2, vocab - 1], config).stats.num_new_tokens == 4


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("widths", [(2, 3, 2), (1, 1, 1, 1)])  # a tree, a chain
@pytest.mark.parametrize("batch", [1, 3])
def test_drafting_in_the_rings_spare_slots_equals_drafting_after_a_copy(
    llama, batch, widths, temperature, static
):
    """The engine's ring holds spare slots after its own, where a draft writes its nodes (`DraftNodes.in_place`,
    no copy of the ring); a ring without them is copied ahead of the nodes each draft. Same ring, same draft,
    bit for bit (tokens and, sampled, q), and neither draft touches the ring's slots or bookkeeping."""
    from longspec.drafter import DrafterCache

    engine = SpeculativeEngine(llama, random_drafter(llama))
    # Row 0's ring wrapped (catch-up appends past the window), row 1's partly empty (6 tokens), row 2's full.
    prompts = [torch.randint(0, 256, (n,)) for n in (30, 6, 21)[:batch]]
    config = GenerationConfig(temperature=temperature, max_new_tokens=4)
    engine.reserve(64, batch)
    engine.runner.start(prompts, config, None, history=True, ring=False)
    engine.draft_step.prefill([p[:-3] for p in prompts])
    engine.cache.sync_length()
    engine.draft_step.catch_up(engine.cache.lengths_t)
    ring = engine.drafter_cache
    assert ring.num_appended[0] > WINDOW  # wrapped: its newest tokens sit in its first slots
    layout = TreeLayout(widths)
    assert ring.with_nodes(layout.num_nodes) is not None
    copied = DrafterCache(engine.drafter.config, batch, ring.keys.dtype)  # no spare slots: the copy path
    for got, held in zip(
        (copied.keys, copied.values, copied.positions, copied.num_appended), ring._ring, strict=True
    ):
        got.copy_(held[:batch])
    before = [t.clone() for t in (ring.keys, ring.values, ring.positions, ring.num_appended)]
    roots = torch.randint(0, 256, (batch,))
    trees = []
    for cache in (ring, copied):
        engine.draft_step.cache = cache
        nodes = engine.drafter.draft_nodes(cache, torch.arange(layout.num_nodes))
        assert nodes.in_place == (cache is ring)
        generator = torch.Generator().manual_seed(1)
        trees.append(engine.runner.draft(roots, layout, static=static, config=config, generator=generator))
        trees[-1] = (trees[-1].tokens.clone(), None if temperature == 0 else trees[-1].draft_probs.clone())
    engine.draft_step.cache = ring
    (tokens, probs), (want_tokens, want_probs) = trees
    assert torch.equal(tokens, want_tokens)
    assert probs is None if temperature == 0 else torch.equal(probs, want_probs)
    after = (ring.keys, ring.values, ring.positions, ring.num_appended)
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
