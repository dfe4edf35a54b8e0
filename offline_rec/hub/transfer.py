"""Share datasets and trained policies on the Hugging Face Hub: push, pull, hf:// dataset paths.

Every call to the Hub goes through `_HubClient`, the project's one boundary around
huggingface_hub (tests replace that class, nothing else). Around it:

- `push_dataset` validates the dataset, stages exactly what is published in a temporary folder
  (hard links of manifest.json and the shards the manifest lists, a card rendered for the repo)
  and uploads that folder, then tags the commit `schema-v{version}`. The local dataset is never
  written. Pushing again is safe: the Hub skips files it already holds with the same content,
  so a push retried after an interruption uploads only what is missing and completes.
- `pull_dataset` downloads a snapshot into the Hub cache (or reads it from there, offline too),
  copies it into a hidden folder next to `--out`, validates the copy (schema and the sha256 of
  every shard), makes its card pin the shards for `datasets` (`refresh_dataset_card`) and
  renames it into place: `--out` is either absent or a valid dataset.
- `resolve_dataset_path` turns `hf://datasets/ORG/NAME[@REVISION]` into a validated snapshot
  folder of the cache, so the trainer reads Hub datasets like local ones.
- `push_model` publishes a `save_pretrained` checkpoint with a generated model card.

Failures of the Hub or the network become one-line `UserError`s naming the fix (`_hub_errors`).
huggingface_hub is imported inside functions: importing this module stays cheap.
"""

from __future__ import annotations

import fnmatch
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from offline_rec import schema as S
from offline_rec.dataset.card import refresh_dataset_card, render_dataset_card
from offline_rec.dataset.format import read_manifest
from offline_rec.dataset.locations import HF_DATASET_PREFIX, check_repo_id, parse_hub_dataset_path
from offline_rec.errors import DataError, UserError
from offline_rec.hub.model_card import render_model_card

DATASET_REPO = "dataset"
MODEL_REPO = "model"
DEFAULT_BRANCH = "main"

# Above either limit a push goes through `upload_large_folder` where huggingface_hub has it
# (< 2.0); newer versions split and resume big uploads inside `upload_folder` itself.
LARGE_UPLOAD_BYTES = 1 << 30
LARGE_UPLOAD_FILES = 100

# Remote files a push replaces: a file matching these that the new upload lacks is deleted, so
# shards (or weights) left by an earlier, bigger push cannot mix with the new ones.
DATASET_REPLACED = [f"{S.DATA_DIR}/*.parquet"]
MODEL_REPLACED = ["*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json"]

LOGIN_FIX = "run `hf auth login` or pass --token (or set HF_TOKEN)"
PERSONAL_DATA_REMINDER = (
    "reminder: prompts and completions are published exactly as they were logged; "
    "make sure they hold no personal data you may not share"
)


def schema_tag(version: str) -> str:
    """The Hub tag that marks a revision in dataset schema `version`."""
    return f"schema-v{version}"


@dataclass
class PushResult:
    url: str  # the repo's page
    commit: str | None  # the commit the upload made (None where huggingface_hub does not say)
    tag: str  # schema tag on that commit
    files: list[str]  # paths uploaded, relative to the repo root


# --------------------------------------------------------------------------------------------
# the boundary


class _HubClient:
    """The project's only door to the Hub. Thin on purpose: no policy, no error handling."""

    def __init__(self, token: str | None = None):
        self.token = token

    def _api(self):
        from huggingface_hub import HfApi

        return HfApi(token=self.token)

    def has_token(self) -> bool:
        """Whether a token was given or saved (`hf auth login`, HF_TOKEN); no network."""
        from huggingface_hub import get_token

        return bool(self.token or get_token())

    def create_repo(self, repo_id: str, *, repo_type: str, private: bool | None) -> str:
        return str(self._api().create_repo(repo_id, repo_type=repo_type, private=private, exist_ok=True))

    def create_branch(self, repo_id: str, *, branch: str, repo_type: str) -> None:
        self._api().create_branch(repo_id, branch=branch, repo_type=repo_type, exist_ok=True)

    def upload_folder(
        self,
        repo_id: str,
        folder: Path,
        *,
        repo_type: str,
        revision: str | None,
        commit_message: str,
        replace_patterns: list[str],
        large: bool,
    ) -> str | None:
        """Upload every file of `folder`; returns the commit id (None where it is not known)."""
        api = self._api()
        if large and hasattr(api, "upload_large_folder"):
            return self._upload_large_folder(
                api, repo_id, folder, repo_type=repo_type, revision=revision, replace_patterns=replace_patterns
            )
        info = api.upload_folder(
            repo_id=repo_id,
            folder_path=folder,
            repo_type=repo_type,
            revision=revision,
            commit_message=commit_message,
            delete_patterns=replace_patterns,
        )
        return getattr(info, "oid", None)

    @staticmethod
    def _upload_large_folder(
        api, repo_id: str, folder: Path, *, repo_type: str, revision: str | None, replace_patterns: list[str]
    ) -> None:
        # upload_large_folder commits in many small, resumable steps but cannot delete: remote
        # files of an earlier push that match `replace_patterns` are deleted afterwards.
        api.upload_large_folder(repo_id=repo_id, folder_path=folder, repo_type=repo_type, revision=revision)
        uploaded = {p.relative_to(folder).as_posix() for p in Path(folder).rglob("*") if p.is_file()}
        stale = [
            f for f in api.list_repo_files(repo_id, repo_type=repo_type, revision=revision)
            if f not in uploaded and any(fnmatch.fnmatch(f, pattern) for pattern in replace_patterns)
        ]
        if stale:
            api.delete_files(
                repo_id,
                delete_patterns=stale,
                repo_type=repo_type,
                revision=revision,
                commit_message="offline-rec: remove stale files",
            )
        return None

    def create_tag(self, repo_id: str, *, tag: str, revision: str | None, repo_type: str) -> None:
        # exist_ok: a tag already there stays on the first revision it marked (tags do not move).
        self._api().create_tag(repo_id, tag=tag, revision=revision, repo_type=repo_type, exist_ok=True)

    def snapshot_download(self, repo_id: str, *, repo_type: str, revision: str | None) -> Path:
        """The repo's files in the local Hub cache (downloaded if needed); works offline from the cache.

        No `local_dir`: with HF_HUB_OFFLINE=1 `snapshot_download(local_dir=...)` fails even when
        the cache holds the snapshot, while the cache path itself is returned.
        """
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, repo_type=repo_type, revision=revision, token=self.token))


# --------------------------------------------------------------------------------------------
# errors


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _network_errors() -> tuple[type[BaseException], ...]:
    """Exception classes meaning 'the Hub could not be reached', across HTTP stacks of huggingface_hub versions."""
    classes: list[type[BaseException]] = [ConnectionError, TimeoutError]
    for module, names in (
        ("httpx2", ("TransportError",)),
        ("httpx", ("TransportError",)),
        ("requests", ("ConnectionError", "Timeout")),
    ):
        try:
            imported = __import__(module)
        except ImportError:
            continue
        classes += [getattr(imported, name) for name in names if hasattr(imported, name)]
    return tuple(classes)


def hub_user_error(error: BaseException, repo_id: str, revision: str | None, action: str) -> UserError | None:
    """The one-line UserError for an exception of huggingface_hub or the network; None for anything else.

    `action` completes "cannot ... REPO", e.g. "push to" or "pull".
    """
    from huggingface_hub import errors as E

    where = repo_id + (f"@{revision}" if revision else "")
    if isinstance(error, E.LocalTokenNotFoundError):
        return UserError(f"no Hugging Face token found to {action} {where}: {LOGIN_FIX}")
    if isinstance(error, E.GatedRepoError):  # a RepositoryNotFoundError: test it first
        return UserError(
            f"{repo_id} is gated: request access on its Hub page, then {LOGIN_FIX} with the account that has it"
        )
    if isinstance(error, E.RevisionNotFoundError):
        return UserError(
            f"revision {revision or DEFAULT_BRANCH!r} not found in {repo_id}: "
            f"check --revision (a branch, a tag such as schema-v{S.SCHEMA_VERSION}, or a commit)"
        )
    if isinstance(error, E.RepositoryNotFoundError):
        return UserError(
            f"cannot {action} {repo_id}: repository not found or not accessible; "
            f"check the name, and if it is private {LOGIN_FIX} with an account that can access it"
        )
    if isinstance(error, E.OfflineModeIsEnabled):  # a ConnectionError: test it before the network errors
        return UserError(f"cannot {action} {where}: HF_HUB_OFFLINE is set; unset it and retry")
    if isinstance(error, E.LocalEntryNotFoundError):
        return UserError(
            f"cannot {action} {where}: it is not in the local Hub cache and the Hub cannot be reached; "
            "connect (or unset HF_HUB_OFFLINE) and retry"
        )
    if isinstance(error, E.HfHubHTTPError):
        status = getattr(getattr(error, "response", None), "status_code", None)
        if status == 401:
            return UserError(f"cannot {action} {where}: the Hub refused the token (401); {LOGIN_FIX}")
        if status == 403:
            return UserError(
                f"cannot {action} {where}: permission denied (403); "
                f"use a token with write access to that namespace ({LOGIN_FIX})"
            )
        if status == 429 or (status is not None and status >= 500):
            return UserError(
                f"cannot {action} {where}: the Hub is unavailable (HTTP {status}); "
                "retry later (a retried push uploads only what is missing)"
            )
        return UserError(f"cannot {action} {where}: the Hub answered HTTP {status}: {_first_line(error)}")
    if isinstance(error, E.HFValidationError):
        return UserError(f"invalid Hub repo id {repo_id!r}: {_first_line(error)}")
    if isinstance(error, _network_errors()):
        return UserError(
            f"cannot {action} {where}: the Hub cannot be reached ({type(error).__name__}: {_first_line(error)}); "
            "check the network and retry (a retried push uploads only what is missing)"
        )
    return None


@contextmanager
def _hub_errors(repo_id: str, revision: str | None, action: str) -> Iterator[None]:
    try:
        yield
    except UserError:
        raise
    except Exception as error:
        mapped = hub_user_error(error, repo_id, revision, action)
        if mapped is None:
            raise
        raise mapped from None


# --------------------------------------------------------------------------------------------
# helpers


def _repo_and_revision(reference: str, revision: str | None) -> tuple[str, str | None]:
    """ORG/NAME or hf://datasets/ORG/NAME[@REVISION], with --revision; UserError when both name a revision."""
    if not reference.startswith(HF_DATASET_PREFIX):
        return check_repo_id(reference), revision
    repo_id, in_path = parse_hub_dataset_path(reference)
    if in_path and revision and in_path != revision:
        raise UserError(f"two revisions given: {in_path!r} in {reference!r} and --revision {revision!r}; keep one")
    return repo_id, in_path or revision


def _print_err(message: str) -> None:
    print(message, file=sys.stderr)


def _require_valid(path: Path, what: str, fix: str) -> dict:
    """The manifest of `path` when `validate_dataset` finds no error; DataError naming the first one otherwise."""
    from offline_rec.dataset.validate import check_dataset_for_use

    check_dataset_for_use(path, what=what, fix=fix)
    return read_manifest(path)


def _link_or_copy(source: Path, target: Path) -> None:
    """Hard-link `source` at `target` (no bytes copied), or copy it where links are impossible."""
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


@contextmanager
def _staging_folder(near: Path) -> Iterator[Path]:
    """A hidden temporary folder beside `near` (same filesystem: hard links work), else in the system temp dir;
    removed on exit."""
    near = near.resolve()  # "." must not put the folder inside `near` itself
    try:
        folder = Path(tempfile.mkdtemp(prefix=f".{near.name}.push-", dir=near.parent))
    except OSError:
        folder = Path(tempfile.mkdtemp(prefix="offline-rec-push-"))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _is_large(folder: Path) -> bool:
    files = [p for p in folder.rglob("*") if p.is_file()]
    return len(files) > LARGE_UPLOAD_FILES or sum(p.stat().st_size for p in files) > LARGE_UPLOAD_BYTES


def _relative_files(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


def _upload(
    client: _HubClient,
    repo_id: str,
    staging: Path,
    *,
    repo_type: str,
    private: bool,
    revision: str | None,
    commit_message: str,
    replace_patterns: list[str],
) -> tuple[str, str | None]:
    """Create the repo (and branch), upload `staging`; returns (repo url, commit id or None)."""
    url = client.create_repo(
        repo_id, repo_type=repo_type, private=private or None
    )  # None: the namespace's default visibility
    if revision and revision != DEFAULT_BRANCH:
        client.create_branch(repo_id, branch=revision, repo_type=repo_type)
    commit = client.upload_folder(
        repo_id,
        staging,
        repo_type=repo_type,
        revision=revision,
        commit_message=commit_message,
        replace_patterns=replace_patterns,
        large=_is_large(staging),
    )
    return url, commit


# --------------------------------------------------------------------------------------------
# datasets


def stage_dataset(dataset: Path, manifest: dict, staging: Path, *, license: str | None, repo_id: str) -> list[str]:
    """Fill `staging` with what a push publishes: manifest.json, the listed shards, a fresh card.

    Shards the manifest does not list (left by an interrupted writer) are not published.
    Returns the staged paths relative to `staging`.
    """
    _link_or_copy(dataset / S.MANIFEST_FILE, staging / S.MANIFEST_FILE)
    for shard in manifest[S.M_SHARDS]:
        _link_or_copy(dataset / shard["path"], staging / shard["path"])
    (staging / S.CARD_FILE).write_text(render_dataset_card(manifest, license, repo_id), encoding="utf-8")
    return _relative_files(staging)


def push_dataset(
    dataset: str | os.PathLike,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    token: str | None = None,
    license: str | None = None,
    echo: Callable[[str], None] = _print_err,
) -> PushResult:
    """Upload a valid, complete dataset to the Hub dataset repo `repo_id`; the local dataset is not modified.

    `revision` is the branch to push to (created if missing). `echo` receives the personal-data
    reminder, printed before anything is uploaded.
    """
    dataset = Path(dataset)
    check_repo_id(repo_id)
    client = _HubClient(token)
    if not client.has_token():
        raise UserError(f"no Hugging Face token found to push to {repo_id}: {LOGIN_FIX}")
    manifest = _require_valid(dataset, str(dataset), f"run `offline-rec validate {dataset}` and fix it before pushing")
    if not manifest.get(S.M_COMPLETE, True):
        raise DataError(
            f"{dataset} is incomplete (an interrupted collect?); finish it with `collect --resume` before pushing"
        )
    if not manifest[S.M_SHARDS]:
        raise DataError(f"{dataset} has no rows: nothing to push")
    version = manifest[S.M_SCHEMA_VERSION]
    tag = schema_tag(version)
    totals = manifest[S.M_TOTALS]
    message = f"offline-rec push: {totals['rows']} rows in {totals['groups']} groups (schema {version})"
    with _staging_folder(dataset) as staging:
        files = stage_dataset(dataset, manifest, staging, license=license, repo_id=repo_id)
        echo(PERSONAL_DATA_REMINDER)
        with _hub_errors(repo_id, revision, "push to"):
            url, commit = _upload(
                client,
                repo_id,
                staging,
                repo_type=DATASET_REPO,
                private=private,
                revision=revision,
                commit_message=message,
                replace_patterns=DATASET_REPLACED,
            )
            client.create_tag(repo_id, tag=tag, revision=commit or revision, repo_type=DATASET_REPO)
    return PushResult(url=url, commit=commit, tag=tag, files=files)


def _download(repo_id: str, revision: str | None, token: str | None) -> Path:
    with _hub_errors(repo_id, revision, "pull"):
        return _HubClient(token).snapshot_download(repo_id, repo_type=DATASET_REPO, revision=revision)


def _cache_fix(repo_id: str) -> str:
    return f"if the local Hub cache is corrupt, remove it (`hf cache rm dataset/{repo_id}`) and pull again"


def pull_dataset(
    reference: str, out: str | os.PathLike, *, revision: str | None = None, token: str | None = None
) -> Path:
    """Download the Hub dataset `reference` (ORG/NAME or hf://datasets/ORG/NAME[@REV]) into the new folder `out`.

    The copy is validated (schema, sha256 of every shard) before it is renamed into place: on
    any failure `out` does not exist. Works offline when the Hub cache holds the revision.
    """
    repo_id, revision = _repo_and_revision(reference, revision)
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"output {out} already exists; choose another --out")
    snapshot = _download(repo_id, revision, token)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{out.name}.pull-", dir=out.parent))
    try:
        _copy_dataset_files(snapshot, partial)
        where = repo_id + (f"@{revision}" if revision else "")
        manifest = _require_valid(partial, f"pulled {where}", f"nothing was kept; {_cache_fix(repo_id)}")
        # A card pushed by an older offline-rec (or edited on the Hub) would let `datasets` serve
        # the local copy from another same-named folder's cache entry: it is made to pin the shards.
        refresh_dataset_card(partial, manifest, repo_id)
        os.replace(partial, out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return out


def _copy_dataset_files(snapshot: Path, target: Path) -> None:
    """Copy the dataset files of a cache snapshot (symlinks into the cache's blobs) as plain files."""
    for name in (S.MANIFEST_FILE, S.CARD_FILE):
        if (snapshot / name).exists():
            shutil.copyfile(snapshot / name, target / name)
    if (snapshot / S.DATA_DIR).is_dir():
        shutil.copytree(snapshot / S.DATA_DIR, target / S.DATA_DIR)


def resolve_dataset_path(path: str, *, token: str | None = None, validate: bool = True) -> Path:
    """A local dataset folder for `path`: hf://datasets/ORG/NAME[@REVISION] is fetched into the Hub cache
    (offline from the cache when it holds it) and, with `validate`, validated (a caller that validates
    the data itself passes False); any other path is returned unchanged."""
    if not str(path).startswith(HF_DATASET_PREFIX):
        return Path(path)
    repo_id, revision = parse_hub_dataset_path(str(path))
    snapshot = _download(repo_id, revision, token)
    if validate:
        _require_valid(snapshot, str(path), _cache_fix(repo_id))
    return snapshot


# --------------------------------------------------------------------------------------------
# models


def _hub_model_id(model: str | None) -> str | None:
    """`model` when it names a Hub model (not an existing local folder), for the card's `base_model`."""
    if not model or Path(model).exists():
        return None
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(model)
    except HFValidationError:
        return None
    return model


def push_model(
    checkpoint_dir: str | os.PathLike,
    repo_id: str,
    *,
    private: bool = False,
    token: str | None = None,
    revision: str | None = None,
    algorithm: dict,
    training_data: list[str],
    eval_summary: dict | None,
    config: dict,
) -> str:
    """Upload a `save_pretrained` folder (model or LoRA adapter) as the Hub model repo `repo_id`; returns its URL.

    Every file of the folder is published (hidden files and an old README.md aside) with a
    generated model card: algorithm and hyper-parameters, training data, eval summary, config.
    `training_data` are the --data values as given (hf://datasets/... entries become the card's
    `datasets`). Weights of an earlier push that this one lacks are deleted from the repo.
    """
    checkpoint = Path(checkpoint_dir)
    check_repo_id(repo_id)
    if not checkpoint.is_dir():
        raise UserError(f"checkpoint {checkpoint} is not a directory")
    adapter = (checkpoint / "adapter_config.json").exists()
    if not adapter and not (checkpoint / "config.json").exists():
        raise UserError(f"{checkpoint} is not a save_pretrained folder (no config.json or adapter_config.json)")
    client = _HubClient(token)
    if not client.has_token():
        raise UserError(f"no Hugging Face token found to push to {repo_id}: {LOGIN_FIX}")
    card = render_model_card(
        repo_id,
        algorithm=algorithm,
        training_data=[str(source) for source in training_data],
        eval_summary=eval_summary,
        config=config,
        base_model=_hub_model_id(config.get("model")),
        library_name="peft" if adapter else "transformers",
    )
    with _staging_folder(checkpoint) as staging:
        for file in sorted(checkpoint.rglob("*")):
            relative = file.relative_to(checkpoint)
            if (
                file.is_file()
                and relative.as_posix() != S.CARD_FILE
                and not any(part.startswith(".") for part in relative.parts)
            ):
                _link_or_copy(file, staging / relative)
        (staging / S.CARD_FILE).write_text(card, encoding="utf-8")
        name = algorithm.get("name") or config.get("algorithm") or "offline-rec"
        with _hub_errors(repo_id, revision, "push to"):
            url, _ = _upload(
                client,
                repo_id,
                staging,
                repo_type=MODEL_REPO,
                private=private,
                revision=revision,
                commit_message=f"offline-rec: policy trained with {name}",
                replace_patterns=MODEL_REPLACED,
            )
    return url
