"""The decoding-method registry: the one list the engine, `run_method` and the eval config read."""

import pytest
import torch

from longspec.eval.config import EvalConfig
from longspec.infer.baselines import run_method
from longspec.infer.engine import GenerationConfig, SpeculativeEngine
from longspec.infer.methods import ALL_METHODS, ENGINE_METHODS, HF_METHODS, METHODS, get_method
from longspec.testing import make_tiny_target


def test_registry_partitions_the_methods_by_runner():
    assert set(ENGINE_METHODS) == {"longspec", "ar", "pld"}
    assert set(HF_METHODS) == {"vanilla_hf", "vanilla_fa"}
    assert {m.runner for m in METHODS.values()} == {"engine", "hf", "hf_compile"}
    assert [n for n, m in METHODS.items() if m.needs_drafter] == ["longspec"]
    assert get_method("pld").drafts == "ngram"
    with pytest.raises(ValueError, match="unknown method 'medusa'; choose one of longspec,"):
        get_method("medusa")


def test_engine_runs_only_its_methods_and_longspec_needs_a_drafter():
    target = make_tiny_target("llama")
    engine = SpeculativeEngine(target)
    config = GenerationConfig(max_new_tokens=2)
    with pytest.raises(
        ValueError, match="unknown engine method 'vanilla_hf'; choose one of longspec, ar, pld"
    ):
        engine.generate([1, 2, 3], config, method="vanilla_hf")
    with pytest.raises(ValueError, match="'longspec' needs a drafter"):
        engine.generate([1, 2, 3], config, method="longspec")
    # run_method dispatches by runner: an engine method without an engine gets a drafterless one
    assert run_method("ar", torch.tensor([1, 2, 3]), config, target=target).stats.method == "ar"


def test_eval_config_validates_against_the_registry():
    with pytest.raises(
        ValueError, match=r"unknown method\(s\) \['medusa'\]; choose from " + ", ".join(ALL_METHODS)
    ):
        EvalConfig(method=["medusa"])
