"""The `offline-rec` command line: parses options and dispatches to the library.

Each command imports what it needs inside its body, so `offline-rec --help` stays instant and
importing this module imports neither torch nor transformers nor vLLM. Errors a user can cause
(`UserError`) are printed as one line and exit with code 2.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import List, Optional

import typer

from offline_rec import __version__
from offline_rec.errors import UserError

app = typer.Typer(
    name="offline-rec",
    help="Offline RL for LLMs from logged trajectories: regularized group-relative REINFORCE (REC, OPMD, AsymRE, RED).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"offline-rec {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version and exit."),
) -> None:
    """Offline RL for LLMs from logged trajectories."""


def _console():
    from rich.console import Console

    return Console()


def _print_json(obj) -> None:
    typer.echo(json.dumps(obj, indent=2, default=str))


# --------------------------------------------------------------------------------------------
# dataset checks


@app.command()
def validate(
    dataset: Path = typer.Argument(..., help="Dataset directory."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
    no_checksums: bool = typer.Option(False, "--no-checksums", help="Skip the sha256 check of shards (faster on huge datasets)."),
) -> None:
    """Check a dataset against the format; exit 0 when clean, 1 on problems, 2 on unusable input."""
    from offline_rec.validate import validate_dataset

    report = validate_dataset(dataset, check_checksums=not no_checksums)
    if as_json:
        _print_json(report.to_json())
    else:
        from offline_rec.display import print_validation

        print_validation(_console(), report)
    raise typer.Exit(0 if report.ok else 1)


@app.command()
def inspect(
    dataset: Path = typer.Argument(..., help="Dataset directory."),
    as_json: bool = typer.Option(False, "--json", help="Print the statistics as JSON."),
) -> None:
    """Describe a dataset: sizes, lengths, rewards, groups without signal, provenance."""
    from offline_rec.describe import describe_dataset

    stats = describe_dataset(dataset)
    if as_json:
        _print_json(stats)
    else:
        from offline_rec.display import print_description

        print_description(_console(), stats)


# --------------------------------------------------------------------------------------------


def main(argv: Optional[List[str]] = None) -> None:
    """Console entry point: runs the app, turning UserError into one line on stderr and exit 2."""
    try:
        app(args=argv, prog_name="offline-rec")
    except UserError as e:
        typer.echo(f"error: {e.message}", err=True)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        sys.exit(130)
