"""The README's shell examples as tests run them: the command lines of the first bash block under a heading."""

from __future__ import annotations

from support.paths import REPO


def readme_bash_lines(heading: str) -> list[str]:
    """The non-blank, non-comment lines of the first ```bash block after `heading` in README.md."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    section = text[text.index(heading):]
    block = section[section.index("```bash\n") + len("```bash\n"):]
    block = block[:block.index("```")]
    return [line for line in block.splitlines() if line.strip() and not line.startswith("#")]
