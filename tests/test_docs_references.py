"""References into the documentation resolve: every quote of a docs/paper.md section anywhere in the repository
(advice that `inspect` prints, presets' measured source, configs, docstrings) names a heading the page has, and
every link of the README reaches a file and, where it names one, a heading of it; the set-up page gives the
README's two set-up commands as they are. (Links inside docs/ are checked by `mkdocs build --strict`, .ci/run.)"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from markdown.extensions.toc import slugify
from support.doc_blocks import bash_lines
from support.paths import REPO

PAPER_QUOTE = re.compile(r'docs/paper\.md,?\s\(?"([^"]{3,200})"')
LINK = re.compile(r"\]\(([^)\s]+)\)")


def headings(page) -> list[str]:
    """The section titles of a Markdown page (fenced code left out: a `# comment` there is no heading)."""
    text = re.sub(r"^```.*?^```$", "", page.read_text(encoding="utf-8"), flags=re.S | re.M)
    return [line.lstrip("#").strip() for line in text.splitlines() if re.match(r"#{1,6} ", line)]


def as_prose(text: str) -> str:
    """`text` with Python's implicit string concatenation, escaped quotes and comment leaders of wrapped lines
    undone, so a quote wrapped over lines reads as one line."""
    text = re.sub(r'"\n\s*f?"', "", text).replace('\\"', '"')
    return re.sub(r"\s*\n\s*(#+\s)?", " ", text)


def paper_quotes() -> list[tuple[str, str]]:
    """(file, quoted title) for every `docs/paper.md, "Title"` in the repository's tracked text files."""
    names = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    this_file = Path(__file__).resolve().relative_to(REPO).as_posix()  # its examples quote sections that are not
    quotes = []
    for name in set(names) - {this_file}:
        if name.rsplit(".", 1)[-1] in ("py", "md", "yaml", "yml", "sh") and (REPO / name).is_file():
            quotes += [(name, title) for title in PAPER_QUOTE.findall(as_prose((REPO / name).read_text("utf-8")))]
    return quotes


def test_every_quoted_paper_section_is_a_heading_of_the_paper():
    titles = set(headings(REPO / "docs" / "paper.md"))
    quotes = paper_quotes()
    assert len(quotes) >= 20  # the advice, the presets, configs and docstrings quote it
    assert [(name, title) for name, title in quotes if title not in titles] == []


def test_quotes_wrapped_over_lines_are_read_whole():
    # what the test above reads: wrapped docstrings, implicit concatenation and comment lines included
    wrapped = ('x (docs/paper.md, "Does the recipe beat RFT on a "\n        "real model?\\") y\n'
               '# docs/paper.md "Rare\n# positives"')
    assert PAPER_QUOTE.findall(as_prose(wrapped)) == ["Does the recipe beat RFT on a real model?", "Rare positives"]


def test_every_link_of_the_readme_reaches_a_file_and_its_heading():
    text = (REPO / "README.md").read_text(encoding="utf-8")
    links = [link for link in LINK.findall(text) if "://" not in link]
    assert len(links) >= 15
    for link in links:
        path, _, anchor = link.partition("#")
        target = REPO / path if path else REPO / "README.md"
        assert target.is_file(), link
        if anchor:
            assert anchor in {slugify(title, "-") for title in headings(target)}, link


def test_the_set_up_page_gives_the_readmes_two_set_up_commands():
    heading = "Run the demo (builds a virtualenv"
    for page in ("README.md", "docs/install.md"):
        assert bash_lines(page, heading) == ["bash scripts/install.sh && .venv/bin/offline-rec demo --out runs/demo"]
        assert bash_lines(page, "Install everything and run the tests") == ["bash scripts/test.sh"]
