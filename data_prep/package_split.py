"""Re-split a registry corpus by package: every file of the named packages is held out, no file of theirs trains
(issue 45).

    python -m data_prep.package_split --corpus DIR --heldout-packages sqlalchemy,docutils --out DIR2

The registry corpus holds out single files (a hash of each path), so a held-out file's package -- its other
modules, its docs -- is still in training. Repository-level evaluation needs the stronger split: DIR2/heldout.jsonl
holds every row (both splits of DIR) of the named packages, DIR2/train.jsonl every row of the others, and
DIR2/manifest.json the corpus manifest with the package split recorded. Every tool reading a corpus directory
(instruct_suite, repo_suite, instruct_prompts, long_documents, bundle) reads DIR2 as it is.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

from longspec.cli import ArgumentParser, UserError
from longspec.ownership import claim_output_dir

__all__ = ["split_by_package", "SPLIT_RULE"]

SPLIT_RULE = "by package: every file of a held-out package is held out, every file of another package trains"


def split_by_package(*, corpus: Path, heldout_packages: list[str], out: Path) -> dict:
    """Write out/{train,heldout}.jsonl and out/manifest.json; -> the manifest."""
    manifest_in = corpus / "manifest.json"
    if not manifest_in.is_file():
        raise FileNotFoundError(
            f"{manifest_in} not found (build the corpus first: python -m data_prep.registry_corpus)"
        )
    if out.resolve() == corpus.resolve():
        raise UserError(f"--out {out} is the corpus itself; name a new directory")
    manifest = json.loads(manifest_in.read_text(encoding="utf-8"))
    known = [entry["name"] for entry in manifest["sources"]]
    unknown = sorted(set(heldout_packages) - set(known))
    if unknown or not heldout_packages:
        raise UserError(f"--heldout-packages {','.join(unknown) or '(none)'}: not in the corpus; choose from "
                        f"{', '.join(known)}")  # fmt: skip
    if set(heldout_packages) == set(known):
        raise UserError("--heldout-packages names every package of the corpus: nothing would train")
    claim_output_dir(out, "corpus", what="--out")  # a corpus directory, as registry_corpus writes one
    files: Counter = Counter()
    per_package: dict[str, Counter] = {}
    with open(out / "train.jsonl.part", "w", encoding="utf-8") as train, \
            open(out / "heldout.jsonl.part", "w", encoding="utf-8") as heldout:  # fmt: skip
        for name in ("train.jsonl", "heldout.jsonl"):
            with open(corpus / name, encoding="utf-8") as f:
                for line in f:
                    if not line.strip():
                        continue
                    source = json.loads(line)["source"]
                    split = "heldout" if source in heldout_packages else "train"
                    (heldout if split == "heldout" else train).write(
                        line if line.endswith("\n") else line + "\n"
                    )
                    files[split] += 1
                    per_package.setdefault(source, Counter())[split] += 1
    for name in ("train.jsonl", "heldout.jsonl"):
        (out / f"{name}.part").replace(out / name)
    manifest |= {
        "split_rule": SPLIT_RULE,
        "heldout_packages": sorted(heldout_packages),
        "file_split": {"rule": manifest.get("split_rule"), "heldout_frac": manifest.get("heldout_frac")},
        "files": dict(files),
        "files_per_package": {k: dict(v) for k, v in sorted(per_package.items())},
        "split_from": str(corpus),
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return manifest


def _main(argv: list[str]) -> int:
    p = ArgumentParser(prog="python -m data_prep.package_split", description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", type=Path, required=True, help="a registry corpus directory")
    p.add_argument("--heldout-packages", required=True, help="comma-separated package (source) names")
    p.add_argument("--out", type=Path, required=True, help="the re-split corpus directory")
    args = p.parse_args(argv)
    packages = [name.strip() for name in args.heldout_packages.split(",") if name.strip()]
    manifest = split_by_package(corpus=args.corpus, heldout_packages=packages, out=args.out)
    print(json.dumps({"files": manifest["files"], "heldout_packages": manifest["heldout_packages"]}))
    return 0


def main(argv: list[str] | None = None) -> int:
    from longspec.cli import run_cli  # one line on stderr and exit 2 for a user error, like every CLI here

    return run_cli(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
