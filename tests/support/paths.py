"""Where the tests find the repository, themselves and their fixtures (tests live in subfolders)."""

from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
"""tests/: the folder on sys.path (pyproject's pythonpath) that makes `support` importable, in child processes too."""
REPO = TESTS.parent
FIXTURES = TESTS / "fixtures"
