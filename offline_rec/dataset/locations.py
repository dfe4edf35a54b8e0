"""Where a dataset lives: a local folder, or a Hub reference `hf://datasets/ORG/NAME[@REVISION]`.

Only names and their parsing live here (no network): the Hub layer fetches, the dataset layer and
the cards only need to recognize a reference.
"""

from __future__ import annotations

import re

from offline_rec.errors import UserError

HF_DATASET_PREFIX = "hf://datasets/"

# A snapshot folder of the local Hub cache (what a resolved hf:// path points to):
# .../datasets--ORG--NAME/snapshots/<commit>; the Hub forbids "--" inside names, so the split is unambiguous.
_CACHE_SNAPSHOT = re.compile(r"datasets--([^/\\]+?)--([^/\\]+)[/\\]snapshots[/\\]([0-9a-f]{40})")


def is_hub_path(path) -> bool:
    """True for `hf://datasets/...` references."""
    return str(path).startswith(HF_DATASET_PREFIX)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def check_repo_id(repo_id: str) -> str:
    """`repo_id` when it is a valid Hub repo id (ORG/NAME), else UserError."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if repo_id.count("/") != 1:
        raise UserError(f"expected a Hub repo id ORG/NAME, got {repo_id!r}")
    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise UserError(f"invalid Hub repo id {repo_id!r}: {_first_line(e)}") from None
    return repo_id


def parse_hub_dataset_path(path: str) -> tuple[str, str | None]:
    """(repo id, revision or None) of `hf://datasets/ORG/NAME[@REVISION]`; UserError when malformed."""
    if not path.startswith(HF_DATASET_PREFIX):
        raise UserError(f"{path!r} is not a Hub dataset path; expected {HF_DATASET_PREFIX}ORG/NAME[@REVISION]")
    repo_id, _, revision = path[len(HF_DATASET_PREFIX):].rstrip("/").partition("@")
    if repo_id.count("/") != 1:
        raise UserError(f"{path!r}: expected {HF_DATASET_PREFIX}ORG/NAME[@REVISION]")
    return check_repo_id(repo_id), revision or None


def hub_dataset_reference(source: str) -> tuple[str, str | None] | None:
    """(repo id, revision or None) when `source` names a Hub dataset, else None (a local folder).

    Recognizes `hf://datasets/ORG/NAME[@REVISION]` and snapshot folders of the local Hub cache
    (what `resolve_dataset_path` returns for an hf:// path), whose revision is the commit.
    """
    if source.startswith(HF_DATASET_PREFIX):
        return parse_hub_dataset_path(source)
    match = _CACHE_SNAPSHOT.search(str(source))
    if match:
        return f"{match.group(1)}/{match.group(2)}", match.group(3)
    return None
