"""Running `offline-rec` in the test process, through the same entry point as the console script."""

from __future__ import annotations


def cli_exit_code(*argv) -> int:
    """Run `offline-rec ARGV` (any value is turned into a string); its exit code.

    SystemExit(None) is a success (0), a non-integer code a failure (1); any other exception
    propagates, so a crash fails the test instead of passing for an exit code.
    """
    from offline_rec.cli import main

    try:
        main([str(a) for a in argv])
    except SystemExit as exited:
        return exited.code if isinstance(exited.code, int) else (0 if exited.code is None else 1)
    return 0


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `offline-rec ARGV`, read from pytest's capsys."""
    code = cli_exit_code(*argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err
