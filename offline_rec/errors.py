"""Errors a user can cause. The CLI prints their message as one line and exits with their code."""

from __future__ import annotations

import errno


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
