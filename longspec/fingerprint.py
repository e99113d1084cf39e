"""Target fingerprint: what a drafter checkpoint must agree on with the target it is loaded onto.

A drafter reads the target's embeddings, LM head and last-layer KV, and rotates with the target's RoPE, so a
drafter trained for one target is silently wrong on another with different shapes, rope settings or tokenizer.
The fingerprint is a small JSON-able dict stored in the drafter's config.json and compared at load time.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

__all__ = ["target_fingerprint", "tokenizer_hash", "fingerprint_mismatches"]


def _jsonable(x: Any) -> Any:
    # Round-trip through JSON so a fresh fingerprint compares equal to one read back from config.json.
    return json.loads(json.dumps(x, sort_keys=True))


def tokenizer_hash(tokenizer) -> str:
    """sha256 over the vocabulary (token -> id) and the special tokens: equal iff ids mean the same strings."""
    payload = {
        "vocab": sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1]),
        "special": {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())},
    }
    return hashlib.sha256(json.dumps(payload, ensure_ascii=False).encode()).hexdigest()


def target_fingerprint(hf_config, tokenizer=None) -> dict[str, Any]:
    """The fields of an HF target config (and optionally its tokenizer) that a drafter depends on."""
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    fp = {
        "model_type": hf_config.model_type,
        "hidden_size": hf_config.hidden_size,
        "num_attention_heads": hf_config.num_attention_heads,
        "num_key_value_heads": hf_config.num_key_value_heads,
        "head_dim": head_dim,
        "vocab_size": hf_config.vocab_size,
        "rope_parameters": dict(getattr(hf_config, "rope_parameters", None) or {}),
    }
    if tokenizer is not None:
        fp["tokenizer_sha256"] = tokenizer_hash(tokenizer)
    return _jsonable(fp)


def fingerprint_mismatches(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Human-readable differences, one per field. A field missing on either side is not compared (e.g. a
    checkpoint saved without a tokenizer, or a target loaded without one)."""
    saved, current = _jsonable(saved), _jsonable(current)
    return [
        f"{key}: drafter was trained for {saved[key]!r}, target has {current[key]!r}"
        for key in sorted(saved.keys() & current.keys())
        if saved[key] != current[key]
    ]
