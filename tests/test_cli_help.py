"""The `--help` of every command is a contract: flag names, help lines, defaults and their order.

The stored texts (tests/snapshots/cli_help/) were written from the command line as it was before its
options moved onto the config dataclasses; a change to an option's flag, help or default shows here.
To accept an intended change: OFFLINE_REC_UPDATE_HELP=1 pytest tests/test_cli_help.py, then review the diff.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from offline_rec.cli import app

SNAPSHOTS = Path(__file__).parent / "snapshots" / "cli_help"
COMMANDS = ("", "validate", "inspect", "view", "import", "filter", "reward", "train", "push", "pull", "collect",
            "merge", "cache", "cache list", "cache clear", "eval", "record", "report", "demo", "rounds")


def help_text(command: str) -> str:
    result = CliRunner().invoke(app, [*command.split(), "--help"], prog_name="offline-rec", terminal_width=100,
                                env={"COLUMNS": "100", "NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    return result.output


@pytest.mark.parametrize("command", COMMANDS)
def test_help_text_is_unchanged(command):
    path = SNAPSHOTS / f"{command.replace(' ', '-') or 'offline-rec'}.txt"
    text = help_text(command)
    if os.environ.get("OFFLINE_REC_UPDATE_HELP"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.is_file(), f"no stored help for {command!r}: run with OFFLINE_REC_UPDATE_HELP=1"
    assert text == path.read_text()


def test_every_command_has_a_stored_help():
    def names(group, prefix=""):
        import typer.main

        click_group = typer.main.get_command(group)
        for name, command in click_group.commands.items():
            yield f"{prefix}{name}"
            if hasattr(command, "commands"):
                yield from (f"{prefix}{name} {sub}" for sub in command.commands)

    assert set(names(app)) == set(COMMANDS) - {""}
