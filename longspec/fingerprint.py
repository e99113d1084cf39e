"""Target fingerprint: what a drafter checkpoint must agree on with the target it is loaded onto.

A drafter reads the target's embeddings, LM head and last-layer KV, and rotates with the target's RoPE, so a
drafter trained for one target is silently wrong on another with different shapes, depth, rope settings or
tokenizer. The fingerprint is a small JSON-able dict stored in the drafter's config.json and compared at load time.

The tokenizer part hashes the tokenizer's content, not one serialization of it: the same tokenizer written by two
transformers versions, or rebuilt from a GGUF's metadata, has the same hash; a changed token, merge, special token,
normalizer or pre-tokenizer changes it.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

__all__ = [
    "FINGERPRINT_VERSION",
    "target_fingerprint",
    "tokenizer_hash",
    "tokenizer_content",
    "fingerprint_mismatches",
]

# 2: + num_hidden_layers, tokenizer_vocab_size, and a content hash of the tokenizer (v1 hashed get_vocab() and
# str(special_tokens_map), which changed between transformers versions for the same tokenizer).
FINGERPRINT_VERSION = 2
_TOKENIZER_KEYS = ("tokenizer_sha256", "tokenizer_vocab_size")

# Serialization-only fields of tokenizers' JSON: they change offsets or decoding, never the ids of a text.
_IRRELEVANT_KEYS = frozenset({"trim_offsets"})
# BPE options as tokenizers writes them when unset; older/newer serializations may omit or add them.
_BPE_DEFAULTS = {
    "dropout": None,
    "unk_token": None,
    "continuing_subword_prefix": None,
    "end_of_word_suffix": None,
    "fuse_unk": False,
    "byte_fallback": False,
    "ignore_merges": False,
}


def _jsonable(x: Any) -> Any:
    # Round-trip through JSON so a fresh fingerprint compares equal to one read back from config.json.
    return json.loads(json.dumps(x, sort_keys=True))


def _canonical_component(node: Any) -> Any:
    """A normalizer / pre-tokenizer definition with serialization noise removed: keys sorted (by the final
    json.dumps), serialization-only keys dropped, nested `Sequence`s flattened and a one-element or empty
    Sequence replaced by its element / None."""
    if isinstance(node, list):
        return [_canonical_component(x) for x in node]
    if not isinstance(node, dict):
        return node
    node = {k: _canonical_component(v) for k, v in node.items() if k not in _IRRELEVANT_KEYS}
    if node.get("type") == "Sequence":
        key = "normalizers" if "normalizers" in node else "pretokenizers"
        flat = []
        for item in node.get(key) or []:
            if isinstance(item, dict) and item.get("type") == "Sequence":
                flat.extend(item.get("normalizers") or item.get("pretokenizers") or [])
            elif item is not None:
                flat.append(item)
        if not flat:
            return None
        if len(flat) == 1:
            return flat[0]
        return {"type": "Sequence", "items": flat}
    return node


def _is_byte_level(pre_tokenizer: Any) -> bool:
    """Whether a canonical pre-tokenizer maps text to bytes (a ByteLevel step, alone or in a Sequence)."""
    if not isinstance(pre_tokenizer, dict):
        return False
    steps = pre_tokenizer.get("items") if pre_tokenizer.get("type") == "Sequence" else [pre_tokenizer]
    return any(isinstance(step, dict) and step.get("type") == "ByteLevel" for step in steps or [])


def _merge_pair(merge: Any) -> list[str]:
    # tokenizers < 0.20 wrote merges as "a b", later versions as ["a", "b"].
    if isinstance(merge, str):
        left, sep, right = merge.partition(" ")
        return [left, right] if sep else [merge]
    return list(merge)


def tokenizer_content(tokenizer) -> dict[str, Any]:
    """The parts of a (fast) HF tokenizer that decide which ids a text gets, in a canonical form.

    model: its type, vocab (token -> id, sorted by id), merges (as pairs, in rank order) and options; added
    tokens (id, content, special and matching flags, sorted by id); the normalizer and pre-tokenizer definitions
    (`_canonical_component`); the special-token roles (bos/eos/unk/pad -> id); and the ids that
    `add_special_tokens=True` wraps around a text (the post-processor's effect, whatever its serialization)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(
            f"{type(tokenizer).__name__} is not a fast tokenizer: longspec needs tokenizers' JSON"
        )
    data = json.loads(backend.to_str())
    model = data.get("model") or {}
    model_type = model.get("type")
    vocab = model.get("vocab")
    if isinstance(vocab, dict):
        vocab = sorted(vocab.items(), key=lambda kv: (kv[1], kv[0]))
    options = {k: v for k, v in model.items() if k not in ("type", "vocab", "merges")}
    if model_type == "BPE":
        # tokenizers writes "" and None interchangeably for unset affixes.
        options = {**_BPE_DEFAULTS, **{k: (None if v == "" else v) for k, v in options.items()}}
    pre_tokenizer = _canonical_component(data.get("pre_tokenizer"))
    if model_type == "BPE" and _is_byte_level(pre_tokenizer):
        # Byte-level BPE maps every byte to a vocab symbol, so no piece is ever unknown: the unknown-token options
        # cannot change an id. Converters differ on them for the same tokenizer (transformers 5.17 writes
        # byte_fallback / fuse_unk / unk_token for a GGUF's gpt2 tokenizer, 5.24 does not), so they are left out.
        options = {k: v for k, v in options.items() if k not in ("unk_token", "byte_fallback", "fuse_unk")}
    added = sorted(
        (
            t["id"],
            t["content"],
            bool(t.get("special")),
            bool(t.get("normalized")),
            bool(t.get("lstrip")),
            bool(t.get("rstrip")),
            bool(t.get("single_word")),
        )
        for t in data.get("added_tokens") or []
    )
    roles = {role: getattr(tokenizer, f"{role}_token_id", None) for role in ("bos", "eos", "unk", "pad")}
    probe = "a"
    with_special = tokenizer(probe, add_special_tokens=True)["input_ids"]
    plain = tokenizer(probe, add_special_tokens=False)["input_ids"]
    start = next((i for i in range(len(with_special)) if with_special[i : i + len(plain)] == plain), 0)
    wrapping = [with_special[:start], with_special[start + len(plain) :]]
    return _jsonable(
        {
            "model": {
                "type": model_type,
                "vocab": vocab,
                "merges": [_merge_pair(m) for m in model.get("merges") or []],
                "options": options,
            },
            "added_tokens": added,
            "normalizer": _canonical_component(data.get("normalizer")),
            "pre_tokenizer": pre_tokenizer,
            "special_token_ids": roles,
            "special_wrapping": wrapping,
        }
    )


def tokenizer_hash(tokenizer) -> str:
    """sha256 of `tokenizer_content`: equal iff the two tokenizers give every text the same ids."""
    payload = json.dumps(tokenizer_content(tokenizer), sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(payload.encode()).hexdigest()


def target_fingerprint(hf_config, tokenizer=None) -> dict[str, Any]:
    """The fields of an HF target config (and optionally its tokenizer) that a drafter depends on."""
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    fp = {
        "fingerprint_version": FINGERPRINT_VERSION,
        "model_type": hf_config.model_type,
        "num_hidden_layers": hf_config.num_hidden_layers,
        "hidden_size": hf_config.hidden_size,
        "num_attention_heads": hf_config.num_attention_heads,
        "num_key_value_heads": hf_config.num_key_value_heads,
        "head_dim": head_dim,
        "vocab_size": hf_config.vocab_size,
        "rope_parameters": dict(getattr(hf_config, "rope_parameters", None) or {}),
    }
    if tokenizer is not None:
        fp["tokenizer_sha256"] = tokenizer_hash(tokenizer)
        fp["tokenizer_vocab_size"] = len(tokenizer)
    return _jsonable(fp)


def fingerprint_mismatches(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Human-readable problems, one per field: a differing value, or a target field the saved fingerprint does
    not record (written by an older longspec: it cannot be verified, so it is refused, not skipped). The
    tokenizer fields are compared only when both sides have a tokenizer (a checkpoint saved without one, or a
    target loaded without one); a version-1 tokenizer hash is of another form and is reported as such."""
    saved, current = _jsonable(saved), _jsonable(current)
    old = saved.get("fingerprint_version", 1) < FINGERPRINT_VERSION
    problems = []
    for key in sorted(current):
        if key == "fingerprint_version":
            continue
        if key in _TOKENIZER_KEYS and not any(k in saved for k in _TOKENIZER_KEYS):
            continue  # the drafter was saved without a tokenizer
        if key not in saved or (old and key == "tokenizer_sha256"):
            problems.append(
                f"{key}: not recorded in the drafter's fingerprint (saved by an older longspec, fingerprint "
                f"v{saved.get('fingerprint_version', 1)}), target has {current[key]!r}; retrain, or add the value "
                "to target_fingerprint in its config.json if you know it was trained for this target"
            )
        elif saved[key] != current[key]:
            problems.append(f"{key}: drafter was trained for {saved[key]!r}, target has {current[key]!r}")
    return problems
