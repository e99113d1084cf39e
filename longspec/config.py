"""What training and evaluation configs share: the shipped YAML directory, the `target` schema and one
compose-and-validate helper.

The YAMLs live at the top of the repository (`configs/`: train.yaml, eval.yaml and the `target`, `stage`, `eval`,
`pipeline` groups) and ship inside the wheel as `longspec/configs`; `config_root` finds them either way, so a
wheel install composes the same configs as a source checkout, from any working directory. `longspec.train.config`
(TrainConfig) and `longspec.eval.config` (EvalConfig) build their schemas on `TargetConfig` and load through
`compose`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields, is_dataclass
from typing import TypeVar

from omegaconf import MISSING

__all__ = ["config_root", "MOVED_KEYS", "TargetConfig", "compose", "check", "Schema", "drafter_window"]


def config_root() -> str:
    """The directory of the YAML configs, absolute whatever the working directory: $LONGSPEC_CONFIG_DIR if set (a
    directory of your own), else a source checkout's configs/ beside the package (a checkout or an editable
    install), else the copy an installed wheel ships inside the package (longspec/configs)."""
    if os.environ.get("LONGSPEC_CONFIG_DIR"):
        return os.path.abspath(os.environ["LONGSPEC_CONFIG_DIR"])
    package = os.path.dirname(os.path.abspath(__file__))
    checkout = os.path.dirname(package)
    # pyproject.toml beside it: the checkout's own configs/, never a stray top-level `configs` of site-packages.
    if os.path.isfile(os.path.join(checkout, "pyproject.toml")) and os.path.isdir(
        os.path.join(checkout, "configs")
    ):
        return os.path.join(checkout, "configs")
    return os.path.join(package, "configs")


T = TypeVar("T")

# Keys that left a schema, each with where it lives now: an old spelling (an override, a YAML of your own) is one
# error saying so, not Hydra's "not in 'TargetConfig'". A moved key is never read from its old place.
MOVED_KEYS = {
    "target.anchor_max_len": "target.anchor_max_len is training-only and now stage.anchor_max_len (python -m "
    "longspec.train ... stage.anchor_max_len=N; null derives it from the target's context); evaluation does not "
    "take it",
}


def check(condition: bool, message: str) -> None:
    """A config rule: ValueError with `message` (naming the field) when it does not hold."""
    if not condition:
        raise ValueError(message)


class Schema:
    """Runs `validate()` after construction, except for the template instance Hydra's ConfigStore builds
    (required fields still "???"); `OmegaConf.to_object` refuses missing values before building the real one."""

    def __post_init__(self) -> None:
        if not any(getattr(self, f.name) == MISSING for f in fields(self)):
            self.validate()

    def validate(self) -> None:
        raise NotImplementedError


@dataclass(kw_only=True)
class TargetConfig(Schema):
    """The frozen target model: an HF directory / hub id (`path`), or a GGUF file (`gguf_file`)."""

    name: str = MISSING  # short name used in run names (llama31_8b, qwq_32b, tiny_llama, ...)
    path: str | None = (
        MISSING  # local HF model directory or hub id (null when gguf_file names the file alone)
    )
    # A GGUF target (de-quantized by transformers; needs `pip install 'longspec[gguf]'`): a file name inside
    # `path`, a path to a .gguf (path then null or its directory), or pkg://PACKAGE/FILE (a file shipped inside an
    # installed Python package). The tokenizer comes from the same file.
    gguf_file: str | None = None
    trust_remote_code: bool = False  # passed to transformers; off unless you trust the repository

    def validate(self) -> None:
        from longspec.target_source import is_gguf_name

        check(
            bool(self.path) or bool(self.gguf_file),
            "target.path must be a local model directory or a hub id (or set target.gguf_file)",
        )
        if self.gguf_file or is_gguf_name(self.path or ""):
            # Finds the file now (an installed package, a path), so a missing one is one clear line before
            # anything loads; a plain directory / hub id is checked where it is loaded, as before.
            try:
                self.source()
            except FileNotFoundError as e:
                raise ValueError(f"target: {e}") from None

    def source(self):
        """The resolved `longspec.target_source.ModelSource` (what the loaders take)."""
        from longspec.target_source import resolve_source

        return resolve_source(self.path, self.gguf_file)

    @property
    def display(self) -> str:
        """The target as one string for logs and messages (the GGUF file when there is one)."""
        return self.gguf_file or self.path


def drafter_window(window: int | None, drafter_dir: str | None, *, field: str) -> int:
    """The drafter window of a run: a saved drafter's own (at `drafter_dir`), else `window`, else the one default,
    `longspec.drafter.DEFAULT_WINDOW`. A `window` given with a saved drafter must agree with it: a conflict is an
    error, never silent precedence. `field` names the option in the message (drafter.window)."""
    import json

    from longspec.drafter import CONFIG_NAME, DEFAULT_WINDOW

    check(window is None or window >= 1, f"{field} must be >= 1, got {window}")
    saved = None
    if drafter_dir:
        try:  # an unreadable config.json is reported by the loader, with its own message
            with open(os.path.join(drafter_dir, CONFIG_NAME), encoding="utf-8") as f:
                saved = json.load(f).get("window")
        except (OSError, ValueError):
            saved = None
    if not isinstance(saved, int):
        return DEFAULT_WINDOW if window is None else window
    check(
        window is None or window == saved,
        f"{field}={window} but the drafter at {drafter_dir} was trained with window {saved}: drop {field} "
        "(a loaded drafter keeps its own)",
    )
    return saved


def compose(
    schema: type[T],
    *,
    schema_name: str,
    config_name: str,
    overrides: list[str] | None = None,
    config_dir: str | None = None,
    what: str = "config",
    moved: dict[str, str] | None = None,
) -> T:
    """Compose `<config_dir>/<config_name>.yaml` (default: `config_root()`) with Hydra overrides and
    validate it into `schema`. The YAML's defaults list names `schema_name`, under which `schema` is registered.

    Hydra's compose API rather than @hydra.main, so launchers' extra arguments, cwd and logging stay ours. A bad
    override, unknown key, wrong type or failed rule is a ValueError starting "invalid <what>: ". `moved`: this
    schema's own keys that left it (as MOVED_KEYS; a key below one is moved with it)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.config_store import ConfigStore
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    moved = {**MOVED_KEYS, **(moved or {})}
    for override in overrides or []:
        old = _moved_from(override.split("=", 1)[0].lstrip("+~"), moved)
        check(old is None, f"invalid {what}: {moved.get(old)} (got {override!r})")
    ConfigStore.instance().store(name=schema_name, node=schema)
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(
            config_dir=os.path.abspath(config_dir or config_root()), version_base=None
        ):
            cfg = hydra_compose(config_name=config_name, overrides=list(overrides or []))
        cfg = OmegaConf.to_object(cfg)
    except (HydraException, OmegaConfBaseException) as e:
        old = _moved_key(e, moved)
        if old is not None:  # a YAML of your own that still spells it the old way
            raise ValueError(f"invalid {what}: {moved[old]} (a config file sets {old})") from e
        # Hydra's message names the override; the cause names the field and the expected type.
        detail = str(e) if e.__cause__ is None else f"{e}: {e.__cause__}"
        raise ValueError(f"invalid {what}: {detail}") from e
    finally:
        GlobalHydra.instance().clear()
    assert isinstance(cfg, schema), type(cfg)
    # `+key=value` adds a key Hydra's struct mode would refuse as a plain override; OmegaConf.to_object then
    # sets it as a stray attribute nothing reads. Refuse it like any unknown key.
    stray = _stray_keys(cfg)
    check(not stray, f"invalid {what}: unknown field(s) {', '.join(stray)} (added with '+'; no such setting)")
    return cfg


def _stray_keys(obj, prefix: str = "") -> list[str]:
    """Attributes of the dataclasses in `obj` that are not their fields (dotted paths), recursively."""
    if isinstance(obj, (list, tuple)):
        return [k for i, item in enumerate(obj) for k in _stray_keys(item, f"{prefix}{i}.")]
    if not is_dataclass(obj):
        return []
    names = {f.name for f in fields(obj)}
    stray = [f"{prefix}{name}" for name in vars(obj) if name not in names and not name.startswith("_")]
    for name in names:
        stray += _stray_keys(getattr(obj, name), f"{prefix}{name}.")
    return stray


def _moved_from(key: str, moved: dict[str, str]) -> str | None:
    """The entry of `moved` that `key` is or lies below (`stage1.extra.0` -> `stage1.extra`), if any."""
    parts = key.split(".")
    return next((k for k in (".".join(parts[:n]) for n in range(len(parts), 0, -1)) if k in moved), None)


def _moved_key(error: BaseException | None, moved: dict[str, str]) -> str | None:
    """The `moved` entry an OmegaConf error (anywhere in `error`'s chain) is about, if any."""
    while error is not None:
        old = _moved_from(getattr(error, "full_key", None) or "", moved)
        if old is not None:
            return old
        error = error.__cause__ or error.__context__
    return None
