"""The engine on a GPU (marker `gpu`: run on a CUDA machine, never in CI): what CUDA graphs capture computes
what the eager reference computes. fp32, so the lossless check needs no near-tie allowance."""

import pytest
import torch
from infer_helpers import random_drafter, reference_greedy
from test_policy import CyclingCosts

from longspec.infer.baselines import run_method
from longspec.infer.candidates import DEFAULT_TREE_WIDTHS
from longspec.infer.engine import GenerationConfig, SpeculativeEngine
from longspec.testing import make_tiny_target

pytestmark = pytest.mark.gpu

BIG = DEFAULT_TREE_WIDTHS


def _cuda_target(family: str):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return make_tiny_target(family).to("cuda")


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "qwen3"])
def test_graph_rounds_are_lossless_fixed_and_auto(family):
    """T = 0: longspec replaying CUDA graphs (fixed big tree, and tree=auto with the tree changing between rounds)
    and our graph AR equal the target's greedy output computed with plain full forwards."""
    target = _cuda_target(family)
    prompt = torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(1)).cuda()
    ref = reference_greedy(target, prompt, 40)
    fixed = SpeculativeEngine(target, random_drafter(target).cuda())
    auto = SpeculativeEngine(target, random_drafter(target).cuda(), costs=CyclingCosts())
    for engine, method, kwargs in (
        (fixed, "longspec", {"tree_widths": BIG}),
        (auto, "longspec", {}),
        (fixed, "ar", {}),
    ):
        result = engine.generate(
            prompt, GenerationConfig(max_new_tokens=40, cuda_graphs=True, **kwargs), method=method
        )
        assert result.tokens == ref, (family, method, kwargs)
    assert len(auto.generate(prompt, GenerationConfig(max_new_tokens=40, cuda_graphs=True)).stats.trees) >= 2


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_graph_lookup_forests_are_lossless(family):
    """Every round a lookup forest (tree="lookup16x4": the split-KV kernel's forest tail inside the captured
    verify), alone and in a ragged batch: == the target's greedy output; drafts were accepted."""
    from test_lookup import _repetitive

    target = _cuda_target(family)
    prompts = [_repetitive(seed, n).cuda() for seed, n in ((4, 300), (3, 170), (2, 233))]
    refs = [reference_greedy(target, p, 40) for p in prompts]
    engine = SpeculativeEngine(target, random_drafter(target).cuda())
    config = GenerationConfig(max_new_tokens=40, cuda_graphs=True, tree="lookup16x4")
    result = engine.generate(prompts[0], config)
    assert result.tokens == refs[0] and set(result.stats.trees) == {"lookup16x4"}
    assert sum(result.stats.accepted) > 0
    assert [r.tokens for r in engine.generate_batch(prompts, config)] == refs


@pytest.mark.parametrize("rule", ["rrs", "deterministic"])
def test_graph_sampling_equals_eager(rule):
    """T = 1: the captured rounds draw and accept exactly as the eager reference (same seed, same tokens)."""
    target = _cuda_target("llama")
    engine = SpeculativeEngine(target, random_drafter(target).cuda(), costs=CyclingCosts())
    prompt = torch.randint(0, 256, (200,), generator=torch.Generator().manual_seed(2)).cuda()
    outputs = []
    for graphs in (False, True):
        config = GenerationConfig(
            max_new_tokens=32, temperature=1.0, top_p=0.95, sampling_rule=rule, cuda_graphs=graphs, seed=5
        )
        outputs.append(engine.generate(prompt, config).tokens)
    assert outputs[0] == outputs[1] and len(outputs[0]) == 32


def test_hf_compile_baseline_is_greedy():
    target = _cuda_target("llama")
    prompt = torch.randint(0, 256, (100,), generator=torch.Generator().manual_seed(3)).cuda()
    result = run_method("hf_compile", prompt, GenerationConfig(max_new_tokens=24), target=target)
    assert result.tokens == reference_greedy(target, prompt, 24)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_measured_round_costs_then_auto_generation(temperature):
    """What the eval's warm-up does on a GPU: measure every candidate's captured round per context bucket, then
    decode with tree=auto on those costs (greedy output still the target's)."""
    target = _cuda_target("llama")
    engine = SpeculativeEngine(target, random_drafter(target).cuda())
    prompt = torch.randint(0, 256, (600,), generator=torch.Generator().manual_seed(4)).cuda()
    config = GenerationConfig(max_new_tokens=24, temperature=temperature, cuda_graphs=True, seed=1)
    engine.reserve(prompt.numel() + 24 + config.max_round_nodes + 1)
    costs = engine.measure_round_costs(config, [prompt.numel()])
    assert {w for _, w in costs.seconds} == set(config.candidates) and min(costs.seconds.values()) > 0
    result = engine.generate(prompt, config)
    assert len(result.tokens) == 24 and sum(result.stats.trees.values()) == result.stats.rounds
    if temperature == 0:
        assert result.tokens == reference_greedy(target, prompt, 24)


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_graph_batch_is_lossless_per_sequence(family):
    """A ragged batch (prompts of 100, 250 and 300 tokens, one finishing early on an EOS) replaying CUDA graphs
    of batch 3: every sequence equals its own greedy output, for longspec (fixed tree) and our graph AR."""
    target = _cuda_target(family)
    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, 256, (n,), generator=gen).cuda() for n in (100, 250, 300)]
    refs = [reference_greedy(target, p, 32) for p in prompts]
    eos = refs[0][3]
    expected = [r[: r.index(eos) + 1] if eos in r else r for r in refs]
    engine = SpeculativeEngine(target, random_drafter(target).cuda())
    for method in ("longspec", "ar"):
        config = GenerationConfig(
            max_new_tokens=32, tree_widths=(4, 8, 8), cuda_graphs=True, eos_token_ids=(eos,)
        )
        results = engine.generate_batch(prompts, config, method=method)
        assert [r.tokens for r in results] == expected, (family, method)


@pytest.mark.parametrize("method", ["longspec", "pld"])
def test_graph_batch_buckets_and_shrinks_losslessly(method):
    """Captured steps of a bucketed batch (5 prompts -> 8 slots) that shrinks twice as rows meet their EOS
    (8 -> 4 -> 2 or 1): the commit step, the compaction and the re-captures on the way keep every sequence
    equal to its own greedy output; then tree="auto" at that batch size, measured round costs and all."""
    target = _cuda_target("qwen2")
    gen = torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, 256, (n,), generator=gen).cuda() for n in (60, 130, 90, 200, 75)]
    refs = [reference_greedy(target, p, 24) for p in prompts]
    eos = (refs[0][2], refs[1][4], refs[3][6])
    expected = [next((r[: i + 1] for i, t in enumerate(r) if t in eos), r) for r in refs]
    engine = SpeculativeEngine(target, random_drafter(target).cuda())
    config = GenerationConfig(
        max_new_tokens=24, tree_widths=(2, 4), cuda_graphs=True, eos_token_ids=eos, shrink_min_tokens=0
    )
    assert [r.tokens for r in engine.generate_batch(prompts, config, method=method)] == expected
    assert engine.cache.batch_size < 8
    if method == "longspec":
        auto = GenerationConfig(max_new_tokens=24, cuda_graphs=True, eos_token_ids=eos, shrink_min_tokens=0)
        assert [r.tokens for r in engine.generate_batch(prompts, auto)] == expected


def test_host_copies_reuse_pinned_buffers_only_after_their_round_settled():
    """Two rounds in flight get two pinned buffers; a settled round's buffer (and event) serves the next round,
    so decoding allocates no host memory per round; every read returns its own round's values."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from longspec.infer.runner import HostCopies

    copies = HostCopies()
    first = copies.start(torch.arange(5, device="cuda"))
    second = copies.start(torch.arange(5, device="cuda") + 10)
    assert first[0].is_pinned() and first[0].data_ptr() != second[0].data_ptr()
    assert copies.read(*first) == list(range(5))
    third = copies.start(torch.arange(5, device="cuda") + 20)
    assert third[0].data_ptr() == first[0].data_ptr() and third[1] is first[1]
    assert copies.read(*second) == list(range(10, 15)) and copies.read(*third) == list(range(20, 25))


def test_capture_survives_dead_graphs_collected_during_it():
    """A dead engine's captured graphs, freed only by the cyclic garbage collector, must not be destroyed while
    another step captures (that invalidates the capture): with the collector forced to run on every allocation,
    a step still captures and replays. The failure this pins down: a mistral test's draft capture failed
    when the previous test's engines were collected during it."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import gc

    from longspec.infer.graphs import StaticStep

    def dead_cycle():
        holder = {"step": StaticStep(lambda x: x * 2, [torch.ones(4, device="cuda")], capture=True)}
        holder["self"] = holder  # a reference cycle: only the cyclic collector frees it

    threshold = gc.get_threshold()
    try:
        gc.collect()
        gc.disable()
        for _ in range(3):
            dead_cycle()
        gc.enable()
        gc.set_threshold(1)  # a collection at (nearly) every allocation, captures included
        step = StaticStep(lambda x: (x + 1).sum(), [torch.ones(4, device="cuda")], capture=True)
        assert float(step(torch.full((4,), 2.0, device="cuda"))) == 12.0
    finally:
        gc.set_threshold(*threshold)
        gc.enable()


@pytest.mark.parametrize("batch, context", [(16, 4096), (4, 8000)])
def test_graph_batch_at_long_context_equals_each_row_alone(batch, context):
    """The shapes where the real SmolLM2 batch table found batched graph AR leaving the target's greedy text (bf16,
    gaps of 10.25 and 3.5 logits; docs/notes/benchmark-log.md, "real-text SmolLM2 batches"): a ragged batch at 4K /
    8K context decoding 256 tokens, in fp32 (no near-ties), batched graph AR and batched longspec each equal every
    row decoded alone by graph AR."""
    target = make_tiny_target("llama", max_position_embeddings=8192 + 512).to("cuda")
    gen = torch.Generator().manual_seed(12)
    prompts = [torch.randint(0, 256, (context - 3 * row,), generator=gen).cuda() for row in range(batch)]
    engine = SpeculativeEngine(target, random_drafter(target).cuda())
    config = GenerationConfig(max_new_tokens=256, cuda_graphs=True, tree_widths=(2, 2, 2))
    engine.reserve_for([p.numel() for p in prompts], config)
    batched = {
        m: [r.tokens for r in engine.generate_batch(prompts, config, method=m)] for m in ("ar", "longspec")
    }
    alone = [engine.generate(p, config, method="ar").tokens for p in prompts]
    for method, outputs in batched.items():
        wrong = [row for row in range(batch) if outputs[row] != alone[row]]
        assert not wrong, (method, wrong)
