"""Measured round costs kept on disk, so the measurement is paid once per machine and model: a table is stored
per (device name, target and drafter shape, dtype, decoding mode, a fingerprint of the decode path's code) and
read back by later runs (`measure.measure_round_costs`); GenerationConfig.remeasure_costs measures again.

The folder: $LONGSPEC_CACHE_DIR, else $XDG_CACHE_HOME/longspec, else ~/.cache/longspec (under it round_costs/).
Files are written atomically; one that cannot be read is ignored with a warning (and measured again).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import warnings
from pathlib import Path

import torch

from longspec.atomic import write_json_atomic
from longspec.infer.candidates import parse
from longspec.infer.policy.costs import MeasuredCosts

__all__ = ["CACHE_ENV", "cache_dir", "cache_path", "load_costs", "save_costs"]

CACHE_ENV = "LONGSPEC_CACHE_DIR"
_FORMAT = 1
# The code a round's cost depends on: the decode path and what it runs.
_CODE = ("infer", "kernels", "modules", "drafter", "target.py")


def cache_dir() -> Path:
    """Where the round-cost tables live (see the module docstring)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser() / "round_costs"
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "longspec" / "round_costs"


@functools.cache
def code_fingerprint() -> str:
    """A hash of the decode path's source files: a table measured with other code is not reused."""
    root = Path(__file__).resolve().parents[2]  # the longspec package
    digest = hashlib.sha256()
    for name in _CODE:
        files = sorted((root / name).rglob("*.py")) if (root / name).is_dir() else [root / name]
        for path in files:
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{device.type}:{platform.machine()}:{platform.processor() or 'cpu'}:{torch.get_num_threads()}"


def _shape(config) -> dict:
    """A model config's plain fields (its shape), without what does not change a round's cost."""
    fields = config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))
    skip = {"target_fingerprint", "_name_or_path", "transformers_version", "torch_dtype", "dtype"}
    return {k: v for k, v in sorted(fields.items()) if k not in skip and not k.startswith("_")}


def cache_path(engine, mode: tuple) -> Path:
    """The table's file for this engine (device, target and drafter shape, dtype, code) in decoding `mode`."""
    key = {
        "device": _device_name(engine.device),
        "target": _shape(engine.target.config),
        "drafter": _shape(engine.drafter.config) if hasattr(engine.drafter, "config") else None,
        "dtype": str(engine.target.embed_tokens.weight.dtype),
        "mode": list(mode),
        "code": code_fingerprint(),
    }
    name = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:24]
    return cache_dir() / f"{name}.json"


def load_costs(path: Path) -> MeasuredCosts | None:
    """The table stored at `path`, or None: missing, or unreadable (then with a warning)."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if data["format"] != _FORMAT:
            raise ValueError(f"format {data['format']!r}, not {_FORMAT}")
        seconds = {}
        for key, value in data["seconds"].items():
            bucket, _, name = key.partition(":")
            seconds[(int(bucket), parse(name))] = float(value)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        warnings.warn(f"ignoring the round-cost cache {path} ({error!r}): measuring again", stacklevel=2)
        return None
    return MeasuredCosts(seconds=seconds)


def save_costs(path: Path, costs: MeasuredCosts) -> None:
    """Store `costs` at `path` atomically; a folder that cannot be written only loses the cache (a warning)."""
    try:
        write_json_atomic(path, {"format": _FORMAT, "seconds": costs.to_dict()})
    except OSError as error:
        warnings.warn(f"could not write the round-cost cache {path}: {error}", stacklevel=2)
