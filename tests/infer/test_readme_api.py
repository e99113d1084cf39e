"""The README's Python usage, on a tiny target saved to disk: the same calls, in the same order."""

import torch

from longspec.drafter import Drafter, DrafterConfig
from longspec.infer import GenerationConfig, SpeculativeEngine
from longspec.target import TargetModel
from longspec.testing import save_tiny_target


def test_readme_python_usage(tmp_path):
    target_dir = save_tiny_target("llama", tmp_path / "target")
    target = TargetModel.from_pretrained(target_dir, dtype="float32", device="cpu")
    trained = Drafter(
        DrafterConfig.from_target_config(target.config, window=8), target.embed_tokens, target.lm_head
    )
    trained.save_pretrained(tmp_path / "export")
    drafter = Drafter.from_pretrained(tmp_path / "export", target, dtype=torch.float32, device="cpu")
    engine = SpeculativeEngine(target, drafter)
    assert target.packed is not None
    prompts = [list(range(3, 40)), list(range(7, 20))]
    config = GenerationConfig(max_new_tokens=12, static_shapes=True)
    results = engine.generate_batch(prompts, config)
    assert [r.tokens for r in results] == [engine.generate(p, config).tokens for p in prompts]
    for result in results:
        assert len(result.tokens) == 12 and result.stats.mean_accept_length >= 1.0
        assert all(p is None or 0.0 <= p <= 1.0 for p in result.stats.acceptance_profile)
