"""How every `python -m ...` entry point reports a user error: one line on stderr, exit status 2, no traceback.

    def _main(argv: list[str]) -> int | None: ...     # raises UserError / ValueError / FileNotFoundError ...
    def main(argv: list[str] | None = None) -> int:  # the console script and `python -m` both come here
        return run_cli(_main, argv)
    if __name__ == "__main__":
        sys.exit(main())

A traceback is for bugs; a wrong path, a bad flag value or an input with no usable row is the user's to fix, and
the fix is in the message. `--debug` (anywhere on the command line, removed before `main` sees it) or
`HYDRA_FULL_ERROR=1` re-raises, so the full traceback is one flag away.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
from collections.abc import Callable, Sequence

__all__ = [
    "UserError",
    "USER_ERRORS",
    "ArgumentParser",
    "run_cli",
    "one_line",
    "os_error_line",
    "write_failure",
]


class UserError(Exception):
    """A mistake the user can fix (a path, a flag, an unusable input); the message says what and how."""


# What a CLI reports as one line. ValueError covers config validation (`__post_init__`) and JSON/Unicode
# decoding; the OSError subset covers paths the user named. Anything else is a bug and keeps its traceback.
USER_ERRORS: tuple[type[BaseException], ...] = (
    UserError,
    ValueError,
    FileNotFoundError,
    FileExistsError,
    NotADirectoryError,
    IsADirectoryError,
    PermissionError,
)


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors (a missing argument, a bad value) are UserErrors, so `run_cli` prints them as
    the same one line as every other user error instead of the usage block; `--help` is unchanged."""

    def error(self, message: str):
        raise UserError(f"{self.prog}: {message} (see --help)")


def one_line(error: BaseException) -> str:
    """The error as one line: its message with inner newlines folded (a multi-line message is still one error)."""
    text = " ".join(part.strip() for part in str(error).splitlines() if part.strip())
    return text or type(error).__name__


# The machine's own errors while writing: the user's to fix (free space, another folder), so one line, no traceback.
_OS_REASONS = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "the file system is read-only",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
}


def os_error_line(error: BaseException) -> str | None:
    """The one line for a full disk, a read-only folder or a permission error (naming the path), else None."""
    if not isinstance(error, OSError) or error.errno not in _OS_REASONS:
        return None
    where = f" at {error.filename!r}" if error.filename else ""
    return f"{_OS_REASONS[error.errno]}{where}: free some space, or choose a writable output folder"


def write_failure(error: BaseException, directory: str) -> BaseException:
    """A writer that does not report the errno (torch.save's C++ writer: "enforce fail at inline_container.cc";
    safetensors' Rust writer): probe `directory` with a small write of our own. Returns the probe's OSError naming
    `directory` (a full disk, a read-only folder: one line via os_error_line), else `error` itself."""
    if isinstance(error, OSError) or not isinstance(error, Exception):
        return error
    probe = os.path.join(directory, f".write-probe-{os.getpid()}")
    try:
        with open(probe, "wb") as f:
            f.write(bytes(1 << 20))
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        return OSError(e.errno, e.strerror, directory) if e.errno in _OS_REASONS else error
    finally:
        if os.path.lexists(probe):
            os.remove(probe)
    return error


def _debug_requested(argv: Sequence[str]) -> bool:
    return "--debug" in argv or os.environ.get("HYDRA_FULL_ERROR") == "1"


def run_cli(fn: Callable[[list[str]], int | None], argv: Sequence[str] | None = None) -> int:
    """Run `fn(argv)` and return the process exit status: `fn`'s own (None = 0), or 2 after printing
    `error: <message>` for a user error (the usage errors of `ArgumentParser` included)."""
    args = list(sys.argv[1:] if argv is None else argv)
    debug = _debug_requested(args)
    args = [a for a in args if a != "--debug"]
    try:
        status = fn(args)
    except USER_ERRORS as e:
        if debug:
            raise
        print(f"error: {os_error_line(e) or one_line(e)}", file=sys.stderr, flush=True)
        return 2
    except OSError as e:
        if debug or os_error_line(e) is None:
            raise
        print(f"error: {os_error_line(e)}", file=sys.stderr, flush=True)
        return 2
    return 0 if status is None else int(status)
