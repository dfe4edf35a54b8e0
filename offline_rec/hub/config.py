"""Every option of `offline-rec push` and `pull` (`PushConfig`, `PullConfig`), once.

Each field carries its flag, help line and default (`offline_rec.options`); the CLI builds the commands from
them and hands the values to offline_rec/hub/transfer.py. Light on purpose (no huggingface_hub): the CLI
imports it to declare its options.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from offline_rec.options import argument, option, required


@dataclass(frozen=True)
class PushConfig:
    """What `offline-rec push` uploads, and where."""

    dataset: Path = argument(help="Dataset directory.")
    repo_id: str = argument(help="Hub dataset repo, created if missing.", metavar="ORG/NAME")
    private: bool = option(
        False, "--private", help="Create the repo private (an existing repo keeps its visibility).")
    revision: str | None = option(None, "--revision", help="Branch to push to, created if missing (default main).")
    token: str | None = option(
        None, "--token", help="Hub token with write access (default: `hf auth login` or HF_TOKEN).")
    license: str | None = option(
        None, "--license", help="License id for the card, e.g. cc-by-4.0 (default: the manifest's, else 'other').")


@dataclass(frozen=True)
class PullConfig:
    """What `offline-rec pull` downloads, and where."""

    repo_id: str = argument(help="Hub dataset repo (or hf://datasets/ORG/NAME[@REVISION]).", metavar="ORG/NAME")
    out: Path = required("--out", "-o", help="New directory for the dataset.")
    revision: str | None = option(
        None, "--revision", help="Branch, tag (e.g. schema-v1.0) or commit (default main).")
    token: str | None = option(None, "--token", help="Hub token, for private or gated repos.")
