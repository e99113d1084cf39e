"""Ownership of outputs: a command deletes or replaces only what this project wrote, as proven by a marker file it
wrote there itself (`.longspec`: the kind of output, the command, and for a directory replaced whole the files it
holds), never by a file name. A directory that is not empty and carries no marker of the kind is the user's and is
refused with one line, `--overwrite` or not; nothing is removed through a symlink.

Cross-cutting (tests/test_layers.py): convert_gguf, export, every data_prep command, the trainer, eval and the
pipeline call it before they write an output folder. It imports only longspec.atomic."""

from __future__ import annotations

import json
import os
import shutil
import sys

from longspec.atomic import write_json_atomic

__all__ = [
    "MARKER_NAME",
    "NotOursError",
    "check_output_dir",
    "claim_output_dir",
    "claim_output_file",
    "is_ours",
    "read_marker",
    "removable",
    "remove_owned",
    "resolve_output",
    "swap_in",
    "write_marker",
]

MARKER_NAME = ".longspec"
_FORMAT = 1


class NotOursError(FileExistsError):
    """An output path holds something this project did not write (a user error: one line, exit status 2)."""


def _command() -> str:
    return " ".join(["python", *sys.argv]) if sys.argv and sys.argv[0] else "python"


def read_marker(directory: str | os.PathLike) -> dict | None:
    """The marker of `directory`, or None when it has none (or one that is not ours: not a JSON object of ours)."""
    path = os.path.join(os.fspath(directory), MARKER_NAME)
    if os.path.islink(path) or not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            marker = json.load(f)
    except (OSError, ValueError):
        return None
    if (
        not isinstance(marker, dict)
        or marker.get("format") != _FORMAT
        or not isinstance(marker.get("kind"), str)
    ):
        return None
    return marker


def write_marker(
    directory: str | os.PathLike, kind: str, *, command: str | None = None, files: list[str] | None = None
) -> None:
    """Mark `directory` as a `kind` output of this project (`files`: every entry of a directory replaced whole)."""
    marker = {"format": _FORMAT, "kind": kind, "command": command or _command()}
    if files is not None:
        marker["files"] = sorted(files)
    write_json_atomic(os.path.join(os.fspath(directory), MARKER_NAME), marker)


def is_ours(directory: str | os.PathLike, kind: str) -> bool:
    marker = read_marker(directory)
    return marker is not None and marker["kind"] == kind


def resolve_output(path: str | os.PathLike) -> str:
    """The path to write for an output named `path`: a symlink's target (the link stays, pointing to the new
    output), else `path` itself."""
    path = os.fspath(path).rstrip(os.sep) or os.fspath(path)
    return os.path.realpath(path) if os.path.islink(path) else path


def _not_ours(directory: str, kind: str, what: str) -> NotOursError:
    marker = read_marker(directory)
    if marker is not None:
        return NotOursError(
            f"{what} {directory!r} holds another longspec output ({marker['kind']}, not {kind}): "
            "choose another directory"
        )
    return NotOursError(
        f"{what} {directory!r} is not empty and was not written by longspec (no {MARKER_NAME} marker): "
        "choose another directory or empty it yourself"
    )


def check_output_dir(
    directory: str | os.PathLike, kind: str, *, what: str = "output", whole: bool = False
) -> bool:
    """Refuse (NotOursError) an output directory a `kind` command may not write into: a file, or a directory that
    is not empty and not marked as a `kind` output; `whole` (the directory is replaced whole): also one holding an
    entry its marker does not list (a user's file put there later). Returns whether it holds an earlier output."""
    directory = os.fspath(directory)
    if os.path.lexists(directory) and not os.path.isdir(directory):
        raise NotOursError(f"{what} {directory!r} exists and is not a directory")
    if not os.path.isdir(directory) or not os.listdir(directory):
        return False
    if not is_ours(directory, kind):
        raise _not_ours(directory, kind, what)
    if whole:
        listed = set(read_marker(directory).get("files", [])) | {MARKER_NAME}
        foreign = sorted(set(os.listdir(directory)) - listed)
        if foreign:
            raise NotOursError(
                f"{what} {directory!r} also holds {foreign[:5]}, which longspec did not write there: "
                "move them out or choose another directory"
            )
    return True


def claim_output_dir(
    directory: str | os.PathLike, kind: str, *, what: str = "output", command: str | None = None
) -> bool:
    """check_output_dir, then create `directory` and mark it as a `kind` output (before the first file goes in).
    Returns whether it held an earlier output."""
    directory = os.fspath(directory)
    existed = check_output_dir(directory, kind, what=what)
    os.makedirs(directory, exist_ok=True)
    if not existed or command is not None:
        write_marker(directory, kind, command=command)
    return existed


def _file_marker(path: str) -> str:
    """The marker of an output that is one file: `.NAME.longspec` beside it (a folder's marker cannot vouch for one
    file in a folder that is the user's)."""
    folder, name = os.path.split(os.path.abspath(path))
    return os.path.join(folder, f".{name}{MARKER_NAME}")


def claim_output_file(path: str | os.PathLike, kind: str, *, what: str = "--out") -> None:
    """Before a `kind` command writes the one-file output `path`: refuse (NotOursError) a directory, or an existing
    file or symlink without this command's marker beside it; then mark the path as ours (before the first byte, so a
    killed run's partial file is provably ours on the rerun)."""
    path = os.fspath(path)
    if os.path.isdir(path) and not os.path.islink(path):
        raise NotOursError(f"{what} {path!r} is a directory: give the path of the file to write")
    marker_path = _file_marker(path)
    if os.path.lexists(path):
        marker = None
        if os.path.isfile(marker_path) and not os.path.islink(marker_path):
            try:
                with open(marker_path, encoding="utf-8") as f:
                    marker = json.load(f)
            except (OSError, ValueError):
                marker = None
        if not (isinstance(marker, dict) and marker.get("format") == _FORMAT and marker.get("kind") == kind):
            raise NotOursError(
                f"{what} {path!r} exists and was not written by this longspec command (no "
                f"{os.path.basename(marker_path)} beside it): choose another path or remove it yourself"
            )
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_json_atomic(marker_path, {"format": _FORMAT, "kind": kind, "command": _command()})


def _through_symlink(path: str, root: str) -> bool:
    """`path` (below `root`) or a directory between them is a symlink."""
    relative = os.path.relpath(path, root)
    assert not relative.startswith(os.pardir), (path, root)
    return os.path.realpath(path) != os.path.join(os.path.realpath(root), relative)


def remove_owned(
    path: str | os.PathLike, kind: str, *, root: str | os.PathLike | None = None, what: str = ""
) -> None:
    """Remove the `kind` output directory `path`, only if its marker proves it ours and (with `root`, the output
    folder it lies in) no symlink leads there; a missing `path` is fine. Symlinks inside are removed, not
    followed (shutil.rmtree)."""
    path = os.fspath(path)
    if not os.path.lexists(path):
        return
    label = f"{what} {path!r}" if what else repr(path)
    if os.path.islink(path) or (root is not None and _through_symlink(path, os.fspath(root))):
        raise NotOursError(
            f"{label} is reached through a symlink: longspec removes nothing outside its output"
        )
    if not os.path.isdir(path):
        raise NotOursError(f"{label} exists and is not a directory")
    if not removable(path, kind):
        raise _not_ours(path, kind, what or "directory")
    _rmtree_marker_last(path)


def _rmtree_marker_last(path: str) -> None:
    """shutil.rmtree, the marker removed last: a removal cut short (a kill) leaves a directory still proven ours,
    which the next run finishes removing, not an unmarked one that nothing may touch."""
    with os.scandir(path) as entries:
        for entry in entries:
            if entry.name == MARKER_NAME:
                continue
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                os.remove(entry.path)
    marker = os.path.join(path, MARKER_NAME)
    if os.path.lexists(marker):
        os.remove(marker)
    os.rmdir(path)


def removable(directory: str | os.PathLike, kind: str) -> bool:
    """Whether `directory` is ours to remove as a `kind` output: empty, marked as one, or holding nothing but its
    marker being written (a write_marker cut short by a kill, in a folder this project had just created)."""
    names = os.listdir(directory)
    return (
        not names or is_ours(directory, kind) or all(name.startswith(MARKER_NAME + ".tmp-") for name in names)
    )


def swap_in(tmp: str, out: str, kind: str) -> None:
    """Replace the directory `out` (absent, or a `kind` output already checked as ours) by the finished `tmp`, by
    renames: at every instant `out` is the old output, absent, or the new one. The old one is removed after."""
    old = f"{out}.old-{os.getpid()}"
    if os.path.lexists(old):
        remove_owned(old, kind)
    moved = os.path.isdir(out)
    if moved:
        os.rename(out, old)
    try:
        os.rename(tmp, out)
    except BaseException:
        if moved and not os.path.lexists(out):
            os.rename(old, out)  # put the previous output back
        raise
    if moved:
        remove_owned(old, kind)
