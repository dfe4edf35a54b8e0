"""How a benchmark measurement is declared, once: a `Key` (name, goal, what it compares), a `Part` (the keys one
function measures), and what is made from the declarations: the table, the JSON object and the key list.

A part's function takes the run's context and returns {key: value} for keys of its own declaration only (a key
it does not declare is an error); a key it leaves out is null. No key is declared by two parts
(`check_unique`, and tests/test_architecture.py from the source).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Key:
    """One number the benchmark reports."""

    name: str
    goal: str
    """The limit it is held to (">= 0.9", "<= 1.2 (flat)", "(2 = linear)"); "" for a number reported as is."""
    compares: str
    """What it measures against what, in a line."""
    needs: str = ""
    """What it needs to be measured at all ("vllm", "chromium", "full mode", ...); null where that is missing."""


@dataclass(frozen=True)
class Part:
    """A named group of keys (`--only NAME`) and the function that measures them from the run's context."""

    name: str
    measure: Callable[[dict], dict]
    keys: tuple[Key, ...]

    def pick(self, result: dict) -> dict:
        """This part's keys out of `result` (a child process's answer, which holds more: notes, per-round lists)."""
        return {key.name: result[key.name] for key in self.keys}

    def run(self, context: dict) -> dict[str, float | None]:
        """The part's measurements; a key it did not declare raises (it would be a number nobody describes)."""
        measured = self.measure(context)
        undeclared = sorted(set(measured) - {key.name for key in self.keys})
        if undeclared:
            raise RuntimeError(f"part {self.name!r} returned keys it does not declare: {', '.join(undeclared)}")
        return measured


def check_unique(keys) -> None:
    """Refuse a key name declared twice."""
    names = [key.name for key in keys]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise RuntimeError(f"benchmark keys declared twice: {', '.join(twice)}")


def key_list(parts) -> str:
    """Every key of `parts` with its goal and what it compares, one line each, by part: the list the benchmark's
    docstring and `--list` show."""
    lines = []
    for part in parts:
        lines.append(f"  [{part.name}]")
        for key in part.keys:
            needs = f" (needs {key.needs})" if key.needs else ""
            lines.append(f"    {key.name:<44} {key.goal:<14} {key.compares}{needs}")
    return "\n".join(lines)


def table_lines(parts, results: dict) -> list[str]:
    """The table: key, value (null where not measured), goal, what it compares."""
    lines = [f"{'key':<44} {'value':>11}  {'goal':<14} compares"]
    for part in parts:
        for key in part.keys:
            value = results.get(key.name)
            shown = "null" if value is None else (f"{value:.3f}" if abs(value) < 100 else f"{value:.0f}")
            lines.append(f"{key.name:<44} {shown:>11}  {key.goal:<14} {key.compares}")
    return lines


def write_json(path: Path, results: dict) -> None:
    """The flat JSON object: every value a number or null."""
    numbers = {key: (None if value is None else float(value)) for key, value in results.items()}
    path.write_text(json.dumps(numbers, indent=1) + "\n")
