import pytest
import torch
from infer_helpers import random_drafter, reference_greedy

from longspec.infer.baselines import (
    ALL_METHODS,
    hf_attn_implementation,
    hf_generate_batch,
    run_method,
    using_attn_implementation,
)
from longspec.infer.engine import GenerationConfig, SpeculativeEngine
from longspec.testing import make_tiny_target


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_every_method_reproduces_greedy(family):
    target = make_tiny_target(family)
    prompt = torch.randint(0, 256, (24,))
    ref = reference_greedy(target, prompt, 10)
    engine = SpeculativeEngine(target, random_drafter(target))
    for method in ALL_METHODS:
        result = run_method(method, prompt, GenerationConfig(max_new_tokens=10), target=target, engine=engine)
        assert result.tokens == ref, method
        assert result.stats.rounds == 9 or method in ("longspec", "pld")


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "qwen3"])
@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_hf_batch_equals_each_prompt_alone(family, implementation):
    """The batched HF baseline (vanilla_hf / vanilla_fa at batch_size > 1): prompts of different lengths,
    left-padded (Mistral's window 16 < the longest prompt), one of them ending early on an EOS, each row's output
    its own greedy output."""
    target = make_tiny_target(family)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=gen) for n in (30, 9, 21)]
    refs = [reference_greedy(target, p, 12) for p in prompts]
    eos = refs[1][3]
    expected = [r[: r.index(eos) + 1] if eos in r else r for r in refs]
    assert len(expected[1]) <= 4 < max(len(e) for e in expected)
    config = GenerationConfig(max_new_tokens=12, eos_token_ids=(eos,))
    results = hf_generate_batch(target.model, prompts, config, attn_implementation=implementation)
    assert [r.tokens for r in results] == expected
    assert [r.stats.num_new_tokens for r in results] == [len(e) for e in expected]
    assert len({r.stats.decode_s for r in results}) == 1  # one decode for the batch


def test_hf_attention_choice_and_restore():
    target = make_tiny_target("llama")
    assert hf_attn_implementation("vanilla_hf", target.model) == "eager"
    assert hf_attn_implementation("vanilla_fa", target.model) == "sdpa"  # CPU fp32: no flash-attn
    before = target.model.config._attn_implementation
    run_method("vanilla_hf", [1, 2, 3], GenerationConfig(max_new_tokens=2), target=target)
    assert target.model.config._attn_implementation == before
    with pytest.raises(ValueError, match="unknown method"):
        run_method("medusa", [1], GenerationConfig(max_new_tokens=2), target=target)
    # the switch is undone on the way out, also when the forward inside raises
    with pytest.raises(RuntimeError, match="boom"):
        with using_attn_implementation(target.model, "eager"):
            assert target.model.config._attn_implementation == "eager"
            raise RuntimeError("boom")
    assert target.model.config._attn_implementation == before


def test_sampling_baselines_are_seeded():
    target = make_tiny_target("qwen2")
    config = GenerationConfig(max_new_tokens=6, temperature=0.9, top_p=0.95, seed=3)
    a = run_method("vanilla_fa", [5, 6, 7], config, target=target).tokens
    b = run_method("vanilla_fa", [5, 6, 7], config, target=target).tokens
    c = run_method("ar", [5, 6, 7], config, target=target).tokens
    assert a == b == c  # same sampler, same RNG stream, same target distribution


def test_prompt_lookup_drafts():
    from longspec.infer.pld import prompt_lookups

    def pld(context, num_draft):  # PLD's one draft
        return [d.tolist() for d in prompt_lookups(torch.tensor(context), num_draft, 3)]

    assert pld([5, 6, 7, 8, 9, 1, 2, 5, 6, 7], 3) == [[8, 9, 1]]  # trigram 5 6 7 seen before
    assert pld([1, 2, 3, 1], 5) == [[2, 3, 1]]  # unigram fallback
    assert pld([1, 2, 3, 4], 5) == []  # nothing matches
