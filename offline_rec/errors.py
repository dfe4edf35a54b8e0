"""Errors a user can cause. The CLI prints their message as one line and exits with their code."""

from __future__ import annotations


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
