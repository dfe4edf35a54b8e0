"""Running `offline-rec` in the test process, through the same entry point as the console script."""

from __future__ import annotations


def cli_exit_code(*argv) -> int:
    """Run `offline-rec ARGV` (any value is turned into a string); its exit code.

    SystemExit(None) is a success (0), a non-integer code a failure (1); any other exception
    propagates, so a crash fails the test instead of passing for an exit code. Where only the code
    matters (or no capsys is at hand: a module-scoped fixture), `assert cli_exit_code(...) == 0`:
    pytest shows the command's captured output with the failure.
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


VLLM_IN_A_CHILD = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
"""The environment of a child `offline-rec` that builds a vLLM engine of its own on a CPU."""


def run_cli_process(*argv, env: dict | None = None, timeout: float = 900) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `offline-rec ARGV` run as a process of its own (`python -m offline_rec`).

    For a command that builds a vLLM engine: the test process keeps ONE vLLM engine per session, and a second
    one built and torn down in-process destroys the parallel state the session's engine uses.
    """
    import os
    import subprocess
    import sys

    from support.paths import REPO

    done = subprocess.run([sys.executable, "-m", "offline_rec", *map(str, argv)], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})
    return done.returncode, done.stdout, done.stderr
