"""Where the tests find the repository, themselves and their fixtures (tests live in subfolders)."""

from pathlib import Path

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
FIXTURES = TESTS / "fixtures"
