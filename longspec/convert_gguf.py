"""`python -m longspec.convert_gguf SRC OUT [--dtype bfloat16|float16|float32] [--overwrite]`: a GGUF target as an HF
model directory (config.json, model.safetensors, tokenizer files, generation config).

De-quantizing a GGUF takes a while (tens of seconds even for a small model on a CPU) and happens on every load; the HF
directory it becomes loads in a second and can be carried to a machine without the `gguf` package. The weights
are what transformers de-quantizes (Q4_1 etc. -> float32), then cast to --dtype; the tokenizer is the one rebuilt
from the file's metadata, so `target.path=OUT` and `target.gguf_file=SRC` give the same model, the same ids and
the same target fingerprint.

OUT is written as OUT.tmp-PID and renamed at the end: it appears whole or not at all. An existing OUT is replaced
(--overwrite) only if an earlier conversion wrote it (longspec.ownership); any other folder is refused.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

from longspec.cli import write_failure
from longspec.ownership import (
    MARKER_NAME,
    check_output_dir,
    remove_owned,
    resolve_output,
    swap_in,
    write_marker,
)

__all__ = ["convert_gguf", "main"]

TARGET_KIND = "converted target"  # the ownership marker's kind of the directories it writes

_DTYPES = ("bfloat16", "float16", "float32")


def convert_gguf(src: str, out: str, *, dtype: str = "bfloat16", overwrite: bool = False) -> str:
    """Write the GGUF `src` (a path or pkg://PACKAGE/FILE) as an HF directory at `out`; returns `out`."""
    import torch

    from longspec.target import _check_model_type
    from longspec.target_source import GGUFError, load_causal_lm, load_config, load_tokenizer, resolve_source

    if dtype not in _DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
    source = resolve_source(None, src)
    out = resolve_output(os.path.abspath(os.path.expanduser(out)))  # a symlink: its target is replaced
    if os.path.realpath(out) == os.path.realpath(source.repo):
        raise ValueError(f"OUT {out!r} is the directory that holds {source}: choose another directory")
    # Only a directory an earlier conversion wrote (its ownership marker, nothing added since) is replaced.
    if check_output_dir(out, TARGET_KIND, what="OUT", whole=True) and not overwrite:
        raise FileExistsError(f"OUT {out!r} exists and is not empty; pass --overwrite to replace it")
    if os.path.realpath(source.gguf_path).startswith(os.path.realpath(out) + os.sep):
        raise ValueError(f"OUT {out!r} contains the source {source}: replacing it would delete the source")

    config = load_config(source)
    _check_model_type(config)  # longspec targets only: a file of another family would convert but not load
    tokenizer = load_tokenizer(source)  # before the slow part: a bad tokenizer fails in a second
    model = load_causal_lm(source, config=config, dtype=getattr(torch, dtype))
    # transformers marks a model loaded from a GGUF as "quantized with gguf" and refuses to save it. For the
    # families longspec runs every weight is de-quantized into a plain tensor (checked), so the mark is dropped
    # and the directory loads as an ordinary checkpoint.
    packed = [name for name, param in model.named_parameters() if not param.is_floating_point()]
    if packed:
        raise GGUFError(
            f"{source}: weights still packed after loading ({packed[:3]}...); cannot write them as HF"
        )
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = f"{out.rstrip(os.sep)}.tmp-{os.getpid()}"
    remove_owned(tmp, TARGET_KIND)  # a leftover of an earlier process with this pid, if marked ours
    try:
        os.makedirs(tmp)
        write_marker(tmp, TARGET_KIND)  # first: a leftover of a killed conversion is provably ours
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        _load_as_written(os.path.join(tmp, "tokenizer_config.json"))
        write_marker(tmp, TARGET_KIND, files=[n for n in os.listdir(tmp) if n != MARKER_NAME])
        swap_in(tmp, out, TARGET_KIND)
    except BaseException as e:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp)  # this process's own temp dir
        cause = write_failure(e, os.path.dirname(tmp))
        if cause is not e:
            raise cause from None
        raise
    return out


def _load_as_written(tokenizer_config: str) -> None:
    """Make the directory's tokenizer load as tokenizer.json says. transformers records a class per architecture
    (e.g. Qwen2Tokenizer for a qwen2 file), and such a class rebuilds its own normalizer and pre-tokenizer on load
    (Qwen2's NFC + split regex), which the GGUF's tokenizer does not have: other ids for some texts, and another
    fingerprint. The generic backend takes tokenizer.json as it is."""
    with open(tokenizer_config) as f:
        data = json.load(f)
    data["tokenizer_class"] = "TokenizersBackend"
    with open(tokenizer_config, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")


def main(argv: list[str] | None = None) -> None:
    from longspec.cli import USER_ERRORS, ArgumentParser, one_line, os_error_line

    # longspec.cli's parser: a usage error is one line like any other (plain argparse printed its usage block)
    parser = ArgumentParser(prog="python -m longspec.convert_gguf", description=__doc__.split("\n\n")[0])
    parser.add_argument("src", help="the GGUF file (a path, or pkg://PACKAGE/FILE for one inside a package)")
    parser.add_argument("out", help="the HF model directory to write")
    parser.add_argument(
        "--dtype", default="bfloat16", choices=_DTYPES, help="weight dtype (default bfloat16)"
    )
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parser.parse_args(argv)
        out = convert_gguf(args.src, args.out, dtype=args.dtype, overwrite=args.overwrite)
    except (*USER_ERRORS, OSError) as e:
        if "--debug" in argv:
            raise
        print(f"error: {os_error_line(e) or one_line(e)}", file=sys.stderr)
        raise SystemExit(2) from None
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
