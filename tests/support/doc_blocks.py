"""The documentation's shell examples as tests run them: the command lines of the first bash block under a heading
of README.md or of a docs/ page."""

from __future__ import annotations

from support.paths import REPO


def bash_lines(page: str, heading: str) -> list[str]:
    """The non-blank, non-comment lines of the first ```bash block after `heading` in `page` (a path from the
    repository root: README.md, docs/rounds.md, ...)."""
    text = (REPO / page).read_text(encoding="utf-8")
    section = text[text.index(heading):]
    block = section[section.index("```bash\n") + len("```bash\n"):]
    block = block[:block.index("```")]
    return [line for line in block.splitlines() if line.strip() and not line.startswith("#")]
