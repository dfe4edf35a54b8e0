"""Hub sharing: what a push uploads, the error mapping, pulls from a hand-laid Hub cache, push_model.

There is no network here. Pushes run against `FakeHub`, which replaces `offline_rec.hub.transfer._HubClient`
(the project's only boundary around huggingface_hub) and keeps an in-memory repo. Pulls run the
real `snapshot_download` with HF_HUB_OFFLINE=1 over a cache laid out by hand, in a subprocess
because huggingface_hub reads HF_HUB_OFFLINE when it is imported.
"""

from __future__ import annotations

import fnmatch
import hashlib
import inspect
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support.cli_support import run_cli
from support.datagen import make_rows, tree_digest, write_dataset
from support.datasets_support import old_style_card, rows_by_datasets, rows_by_pyarrow, use_private_datasets_cache
from support.paths import REPO as ROOT

from offline_rec import schema as S
from offline_rec.dataset.card import card_problem, split_front_matter
from offline_rec.errors import UserError
from offline_rec.hub import transfer as hub

REPO = "org/name"
COMMIT = "c" * 40


class FakeHub:
    """Stands in for `hub._HubClient`: records calls and keeps one in-memory repo per id.

    `FakeHub.fail = {"method": exception}` makes that method raise once.
    """

    calls: list[tuple[str, dict]] = []
    repos: dict[str, dict[str, bytes]] = {}
    fail: dict[str, BaseException] = {}
    token_present = True
    snapshot: Path | None = None  # what snapshot_download returns

    def __init__(self, token=None):
        self.token = token

    def _call(self, name, **kwargs):
        FakeHub.calls.append((name, kwargs))
        if name in FakeHub.fail:
            raise FakeHub.fail.pop(name)

    def has_token(self):
        return FakeHub.token_present or bool(self.token)

    def create_repo(self, repo_id, *, repo_type, private):
        self._call("create_repo", repo_id=repo_id, repo_type=repo_type, private=private)
        FakeHub.repos.setdefault(repo_id, {})
        return f"https://huggingface.co/{'datasets/' if repo_type == 'dataset' else ''}{repo_id}"

    def create_branch(self, repo_id, *, branch, repo_type):
        self._call("create_branch", repo_id=repo_id, branch=branch, repo_type=repo_type)

    def upload_folder(self, repo_id, folder, *, repo_type, revision, commit_message, replace_patterns, large):
        files = {p.relative_to(folder).as_posix(): p.read_bytes() for p in Path(folder).rglob("*") if p.is_file()}
        self._call(
            "upload_folder",
            repo_id=repo_id,
            folder=Path(folder),
            files=sorted(files),
            repo_type=repo_type,
            revision=revision,
            commit_message=commit_message,
            replace_patterns=replace_patterns,
            large=large,
        )
        repo = FakeHub.repos[repo_id]
        for name in [n for n in repo if n not in files and any(fnmatch.fnmatch(n, p) for p in replace_patterns)]:
            del repo[name]  # what delete_patterns does on the Hub
        repo.update(files)
        return COMMIT

    def create_tag(self, repo_id, *, tag, revision, repo_type):
        self._call("create_tag", repo_id=repo_id, tag=tag, revision=revision, repo_type=repo_type)

    def snapshot_download(self, repo_id, *, repo_type, revision):
        self._call("snapshot_download", repo_id=repo_id, repo_type=repo_type, revision=revision)
        return FakeHub.snapshot


@pytest.fixture()
def fake_hub(monkeypatch):
    FakeHub.calls, FakeHub.repos, FakeHub.fail, FakeHub.token_present, FakeHub.snapshot = [], {}, {}, True, None
    monkeypatch.setattr(hub, "_HubClient", FakeHub)
    return FakeHub


def calls_named(name):
    return [kwargs for called, kwargs in FakeHub.calls if called == name]


@pytest.fixture()
def dataset(tmp_path):
    # 3 groups (2 + 3 + 2 rows), 2 groups per shard: part-00000 holds 5 rows, part-00001 holds 2
    groups = make_rows([2, 3, 2], completion_lengths=[[1, 2], [3, 4, 5], [6, 7]])
    behavior = S.behavior_provenance(model="tiny-org/tiny", temperature=1.0, logprobs_source=S.LOGPROBS_SAMPLED)
    return write_dataset(tmp_path / "datasets" / "ds", groups, groups_per_shard=2, behavior=behavior)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# --------------------------------------------------------------------------------------------
# the staged folder


def test_staged_folder_holds_exactly_the_published_files_and_loads_with_datasets(dataset, tmp_path):
    from datasets import Features, List, Value, load_dataset

    (dataset / S.DATA_DIR / "part-00009.parquet").write_bytes(b"left by a crash")  # unlisted: never published
    staging = tmp_path / "staging"
    staging.mkdir()
    manifest = json.loads((dataset / S.MANIFEST_FILE).read_text())
    files = hub.stage_dataset(dataset, manifest, staging, license="cc-by-4.0", repo_id=REPO)
    assert files == ["README.md", "data/part-00000.parquet", "data/part-00001.parquet", "manifest.json"]

    loaded = load_dataset(str(staging), split="train", cache_dir=str(tmp_path / "hf-datasets-cache"))
    assert loaded.features == Features.from_arrow_schema(S.ARROW_SCHEMA)
    assert loaded.features[S.PROMPT_IDS] == List(Value("int32"))
    assert loaded.features[S.BEHAVIOR_LOGPROBS] == List(Value("float32"))
    assert loaded.features[S.LOSS_MASK] == List(Value("int8"))
    assert loaded.num_rows == 7  # 2 + 3 + 2
    assert sorted(len(ids) for ids in loaded[S.COMPLETION_IDS]) == [1, 2, 3, 4, 5, 6, 7]

    front, body = split_front_matter((staging / S.CARD_FILE).read_text())
    assert front["license"] == "cc-by-4.0"
    assert "| 7 | 3 | 28 | 2 |" in body  # rows, groups, 1+2+...+7 tokens, shards
    assert 'load_dataset("org/name", split="train")' in body


# --------------------------------------------------------------------------------------------
# push


def test_push_uploads_the_staged_files_and_tags_the_schema(fake_hub, dataset, capsys):
    before = tree_digest(dataset)
    code, out, err = run_cli(capsys, "push", dataset, REPO, "--license", "mit")
    assert code == 0, err
    assert "reminder: prompts and completions are published exactly as they were logged" in err
    assert f"pushed 4 files to https://huggingface.co/datasets/{REPO}, tagged schema-v1.0" in out

    names = [name for name, _ in FakeHub.calls]
    assert names == ["create_repo", "upload_folder", "create_tag"]  # no branch: main
    assert calls_named("create_repo") == [{"repo_id": REPO, "repo_type": "dataset", "private": None}]
    upload, = calls_named("upload_folder")
    assert upload["files"] == ["README.md", "data/part-00000.parquet", "data/part-00001.parquet", "manifest.json"]
    assert upload["revision"] is None and upload["replace_patterns"] == ["data/*.parquet"] and not upload["large"]
    assert upload["commit_message"] == "offline-rec push: 7 rows in 3 groups (schema 1.0)"
    assert calls_named("create_tag") == [
        {"repo_id": REPO, "tag": "schema-v1.0", "revision": COMMIT, "repo_type": "dataset"}
    ]

    remote = FakeHub.repos[REPO]
    manifest = json.loads(remote["manifest.json"])
    assert remote["manifest.json"] == (dataset / S.MANIFEST_FILE).read_bytes()
    for shard in manifest[S.M_SHARDS]:
        assert sha256(remote[shard["path"]]) == shard["sha256"]
    front, _ = split_front_matter(remote["README.md"].decode())
    assert front["license"] == "mit"
    assert tree_digest(dataset) == before  # the local card (no license, no repo id) is untouched
    assert sorted(os.listdir(dataset.parent)) == ["ds"]  # the staging folder is gone


def test_push_of_the_current_directory_stages_outside_it(fake_hub, dataset, capsys, monkeypatch):
    before = tree_digest(dataset)
    monkeypatch.chdir(dataset)
    code, _, err = run_cli(capsys, "push", ".", REPO)
    assert code == 0, err
    upload, = calls_named("upload_folder")
    assert upload["files"] == ["README.md", "data/part-00000.parquet", "data/part-00001.parquet", "manifest.json"]
    assert dataset not in upload["folder"].resolve().parents
    assert tree_digest(dataset) == before
    assert sorted(os.listdir(dataset.parent)) == ["ds"]


def test_push_private_to_a_branch(fake_hub, dataset, capsys):
    code, out, err = run_cli(capsys, "push", dataset, REPO, "--private", "--revision", "dev", "--token", "hf_x")
    assert code == 0, err
    assert [name for name, _ in FakeHub.calls] == ["create_repo", "create_branch", "upload_folder", "create_tag"]
    assert calls_named("create_repo")[0]["private"] is True
    assert calls_named("create_branch") == [{"repo_id": REPO, "branch": "dev", "repo_type": "dataset"}]
    assert calls_named("upload_folder")[0]["revision"] == "dev"
    assert "(branch dev)" in out


def test_push_twice_is_idempotent_and_a_retry_completes_an_interrupted_push(fake_hub, dataset, capsys):
    import httpx2

    FakeHub.fail = {"upload_folder": httpx2.ConnectError("connection reset by peer")}
    code, out, err = run_cli(capsys, "push", dataset, REPO)
    assert code == 2
    assert err.splitlines()[-1].startswith("error: cannot push to org/name: the Hub cannot be reached (ConnectError")
    assert "retry" in err.splitlines()[-1]

    assert run_cli(capsys, "push", dataset, REPO)[0] == 0
    first = dict(FakeHub.repos[REPO])
    assert run_cli(capsys, "push", dataset, REPO)[0] == 0  # same files again: same repo content
    assert FakeHub.repos[REPO] == first
    assert set(first) == {"README.md", "data/part-00000.parquet", "data/part-00001.parquet", "manifest.json"}


def test_a_smaller_push_replaces_the_shards_of_a_bigger_one(fake_hub, dataset, tmp_path, capsys):
    assert run_cli(capsys, "push", dataset, REPO)[0] == 0
    small = write_dataset(tmp_path / "small", make_rows([2]), groups_per_shard=2)
    assert run_cli(capsys, "push", small, REPO)[0] == 0
    assert sorted(FakeHub.repos[REPO]) == ["README.md", "data/part-00000.parquet", "manifest.json"]


def test_big_pushes_are_flagged_large(fake_hub, dataset, capsys, monkeypatch):
    monkeypatch.setattr(hub, "LARGE_UPLOAD_FILES", 3)  # 4 staged files > 3
    assert run_cli(capsys, "push", dataset, REPO)[0] == 0
    assert calls_named("upload_folder")[0]["large"] is True


def _http_error(cls, status):
    import httpx2

    response = httpx2.Response(status, request=httpx2.Request("POST", "https://huggingface.co/api/repos/create"))
    return cls(f"{status} Client Error: for url", response=response)


def _hub_error_cases():
    import httpx2
    import requests
    from huggingface_hub import errors as E

    return [
        ("create_repo", E.LocalTokenNotFoundError("Token is required"), "hf auth login"),
        ("create_repo", _http_error(E.HfHubHTTPError, 401), "refused the token (401)"),
        ("create_repo", _http_error(E.HfHubHTTPError, 403), "permission denied (403)"),
        ("create_repo", _http_error(E.RepositoryNotFoundError, 404), "repository not found or not accessible"),
        ("create_repo", _http_error(E.GatedRepoError, 403), "is gated: request access"),
        ("create_repo", E.OfflineModeIsEnabled("offline"), "HF_HUB_OFFLINE is set"),
        ("create_repo", httpx2.ConnectError("[Errno 111] Connection refused"), "the Hub cannot be reached"),
        ("create_repo", requests.ConnectionError("Max retries exceeded"), "the Hub cannot be reached"),
        ("upload_folder", _http_error(E.HfHubHTTPError, 503), "the Hub is unavailable (HTTP 503)"),
        ("upload_folder", _http_error(E.RevisionNotFoundError, 404), "revision 'main' not found"),
        ("upload_folder", httpx2.ReadTimeout("timed out"), "the Hub cannot be reached (ReadTimeout"),
        ("create_tag", _http_error(E.HfHubHTTPError, 409), "HTTP 409"),
    ]


@pytest.mark.parametrize(
    "method, error, expected",
    _hub_error_cases(),
    ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else None,
)
def test_hub_errors_become_one_line_and_exit_2_with_the_dataset_unchanged(
    fake_hub, dataset, capsys, method, error, expected
):
    before = tree_digest(dataset)
    FakeHub.fail = {method: error}
    code, out, err = run_cli(capsys, "push", dataset, REPO)
    assert code == 2
    error_lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1 and "\n" not in error_lines[0]
    assert expected in error_lines[0], error_lines[0]
    assert "Traceback" not in err
    assert tree_digest(dataset) == before
    assert sorted(os.listdir(dataset.parent)) == ["ds"]


def test_errors_that_are_not_the_hubs_are_not_disguised():
    assert hub.hub_user_error(RuntimeError("bug"), REPO, None, "push to") is None
    assert hub.hub_user_error(KeyError("x"), REPO, None, "pull") is None


def test_push_without_a_token_is_refused_before_anything(fake_hub, dataset, capsys):
    FakeHub.token_present = False
    code, _, err = run_cli(capsys, "push", dataset, REPO)
    assert code == 2 and "no Hugging Face token found" in err and "hf auth login" in err
    assert FakeHub.calls == []


def test_an_invalid_dataset_is_not_pushed(fake_hub, dataset, capsys):
    shard = dataset / S.DATA_DIR / "part-00001.parquet"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte: the sha256 no longer matches the manifest
    shard.write_bytes(bytes(data))
    code, _, err = run_cli(capsys, "push", dataset, REPO)
    assert code == 2 and "is not a valid dataset" in err and "sha256" in err
    assert FakeHub.calls == []


def test_an_incomplete_dataset_is_not_pushed(fake_hub, dataset, capsys):
    manifest = json.loads((dataset / S.MANIFEST_FILE).read_text())
    manifest[S.M_COMPLETE] = False
    (dataset / S.MANIFEST_FILE).write_text(json.dumps(manifest))
    code, _, err = run_cli(capsys, "push", dataset, REPO)
    assert code == 2 and "incomplete" in err
    assert calls_named("upload_folder") == []


@pytest.mark.parametrize("repo_id", ["noslash", "a/b/c", "org/bad--name", "org/.hidden"])
def test_a_bad_repo_id_is_refused(fake_hub, dataset, capsys, repo_id):
    code, _, err = run_cli(capsys, "push", dataset, repo_id)
    assert code == 2 and "repo id" in err
    assert FakeHub.calls == []


# --------------------------------------------------------------------------------------------
# the boundary itself, against the installed huggingface_hub's signatures


class RecordingApi:
    """An HfApi stand-in that checks each call's arguments against the installed HfApi's signature."""

    def __init__(self, with_large_folder=False, remote_files=()):
        self.calls = []
        self.remote_files = list(remote_files)
        if with_large_folder:
            self.upload_large_folder = lambda **kwargs: self.calls.append(("upload_large_folder", kwargs))

    def __getattr__(self, name):
        from huggingface_hub import HfApi

        real = getattr(HfApi, name)

        def record(*args, **kwargs):
            inspect.signature(real).bind(self, *args, **kwargs)  # TypeError on an unknown argument
            self.calls.append((name, kwargs))
            if name == "list_repo_files":
                return self.remote_files
            if name == "upload_folder":
                return type("CommitInfo", (), {"oid": COMMIT})()
            return f"https://huggingface.co/datasets/{args[0] if args else kwargs.get('repo_id')}"

        return record


def test_client_calls_fit_the_installed_huggingface_hub(tmp_path, monkeypatch):
    api = RecordingApi()
    client = hub._HubClient(token="hf_x")
    monkeypatch.setattr(client, "_api", lambda: api)
    client.create_repo(REPO, repo_type="dataset", private=None)
    client.create_branch(REPO, branch="dev", repo_type="dataset")
    commit = client.upload_folder(REPO, tmp_path, repo_type="dataset", revision="dev", commit_message="m",
                                  replace_patterns=["data/*.parquet"], large=True)
    client.create_tag(REPO, tag="schema-v1.0", revision=commit, repo_type="dataset")
    assert commit == COMMIT
    assert [name for name, _ in api.calls] == ["create_repo", "create_branch", "upload_folder", "create_tag"]
    assert api.calls[2][1]["delete_patterns"] == ["data/*.parquet"]
    assert api.calls[3][1]["exist_ok"] is True


def test_large_uploads_use_upload_large_folder_where_it_exists_and_remove_stale_shards(tmp_path, monkeypatch):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "part-00000.parquet").write_bytes(b"x")
    (tmp_path / "manifest.json").write_text("{}")
    api = RecordingApi(
        with_large_folder=True,
        remote_files=["README.md", ".gitattributes", "data/part-00000.parquet", "data/part-00001.parquet"],
    )
    client = hub._HubClient()
    monkeypatch.setattr(client, "_api", lambda: api)
    commit = client.upload_folder(REPO, tmp_path, repo_type="dataset", revision=None, commit_message="m",
                                  replace_patterns=["data/*.parquet"], large=True)
    assert commit is None
    assert [name for name, _ in api.calls] == ["upload_large_folder", "list_repo_files", "delete_files"]
    assert api.calls[2][1]["delete_patterns"] == ["data/part-00001.parquet"]  # only the shard the upload lacks


# --------------------------------------------------------------------------------------------
# pull and hf:// paths


def lay_out_hub_cache(hf_home: Path, dataset: Path, repo_id: str = REPO, commit: str = COMMIT) -> Path:
    """The Hub cache as huggingface_hub writes it: blobs, a snapshot of symlinks, refs/main; returns the snapshot."""
    repo_dir = hf_home / "hub" / f"datasets--{repo_id.replace('/', '--')}"
    snapshot = repo_dir / "snapshots" / commit
    for file in sorted(p for p in dataset.rglob("*") if p.is_file()):
        relative = file.relative_to(dataset)
        blob = repo_dir / "blobs" / sha256(file.read_bytes())
        blob.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(file, blob)
        link = snapshot / relative
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo_dir / "refs").mkdir(exist_ok=True)  # laid out again: a new commit becomes main
    (repo_dir / "refs" / "main").write_text(commit)
    return snapshot


def run_offline(hf_home: Path, *args):
    """Run `python ARGS` with HF_HUB_OFFLINE=1 and HF_HOME=hf_home (huggingface_hub reads both at import)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(hf_home), "PYTHONPATH": str(ROOT)}
    env.pop("HF_HUB_CACHE", None)
    env.pop("HF_TOKEN", None)
    return subprocess.run([sys.executable, *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_pull_from_the_offline_cache_gives_a_valid_local_dataset(dataset, tmp_path):
    lay_out_hub_cache(tmp_path / "hf", dataset)
    out = tmp_path / "pulled" / "ds"
    done = run_offline(tmp_path / "hf", "-m", "offline_rec", "pull", REPO, "--out", out)
    assert done.returncode == 0, done.stderr
    assert f"pulled {REPO} -> {out}" in done.stdout
    assert tree_digest(out) == tree_digest(dataset)
    assert not any(p.is_symlink() for p in out.rglob("*"))  # plain files, independent of the cache
    assert sorted(os.listdir(out.parent)) == ["ds"]


def pull_offline(hf_home: Path, *pulls: tuple[str, Path]) -> None:
    """`pull_dataset(repo, out)` for each pair, in one offline subprocess."""
    script = "from offline_rec.hub.transfer import pull_dataset\n" + "".join(
        f"pull_dataset({repo!r}, {str(out)!r})\n" for repo, out in pulls
    )
    done = run_offline(hf_home, "-c", script)
    assert done.returncode == 0, done.stderr


def published(dataset: Path, where: Path, card: str | None = None) -> Path:
    """The folder a push of `dataset` uploads (`card`: the README.md an earlier version would have uploaded)."""
    where.mkdir(parents=True)
    manifest = json.loads((dataset / S.MANIFEST_FILE).read_text())
    hub.stage_dataset(dataset, manifest, where, license="mit", repo_id=REPO)
    if card is not None:
        (where / S.CARD_FILE).write_text(card)
    return where


def same_shape(seed: int) -> list[list[dict]]:
    return make_rows([2, 3, 2], seed=seed, completion_lengths=[[1, 2], [3, 4, 5], [6, 7]])


def test_pulled_datasets_load_their_own_rows_with_datasets(tmp_path, monkeypatch):
    use_private_datasets_cache(monkeypatch, tmp_path / "hf-datasets")
    first, second, other = (
        write_dataset(tmp_path / "local" / str(seed) / "ds", same_shape(seed)) for seed in (1, 2, 3)
    )
    hf = tmp_path / "hf"
    lay_out_hub_cache(hf, published(first, tmp_path / "pushed-1"), "org/a", "1" * 40)
    lay_out_hub_cache(hf, published(other, tmp_path / "pushed-3"), "org/b", "3" * 40)
    x, y = tmp_path / "x" / "data", tmp_path / "y" / "data"  # two pulls into folders of one name
    pull_offline(hf, ("org/a", x), ("org/b", y))
    for pulled, source in ((x, first), (y, other)):
        assert rows_by_datasets(pulled) == rows_by_pyarrow(pulled) == rows_by_pyarrow(source)
    # The repo gets a new version; the folder is pulled again in place.
    lay_out_hub_cache(hf, published(second, tmp_path / "pushed-2"), "org/a", "2" * 40)
    shutil.rmtree(x)
    pull_offline(hf, ("org/a", x))
    assert rows_by_datasets(x) == rows_by_pyarrow(x) == rows_by_pyarrow(second)


def test_a_pulled_card_of_an_earlier_version_is_made_to_pin_the_shards(tmp_path, monkeypatch):
    use_private_datasets_cache(monkeypatch, tmp_path / "hf-datasets")
    pushed, local = (write_dataset(tmp_path / "local" / str(seed) / "ds", same_shape(seed)) for seed in (1, 2))
    for path in (pushed, local):  # both with the card that keyed the cache on "data" + that YAML
        (path / S.CARD_FILE).write_text(old_style_card(json.loads((path / S.MANIFEST_FILE).read_text())))
    neighbour = tmp_path / "z" / "data"
    shutil.copytree(local, neighbour)
    assert rows_by_datasets(neighbour) == rows_by_pyarrow(local)  # fills the cache entry of that old key
    hf = tmp_path / "hf"
    manifest = json.loads((pushed / S.MANIFEST_FILE).read_text())
    lay_out_hub_cache(hf, published(pushed, tmp_path / "pushed", card=old_style_card(manifest, license="mit")))
    out = tmp_path / "pulled" / "data"
    pull_offline(hf, (REPO, out))
    assert card_problem(out, manifest) is None
    front, _ = split_front_matter((out / S.CARD_FILE).read_text())
    assert front["license"] == "mit"  # the rest of the Hub card is kept
    assert rows_by_datasets(out) == rows_by_pyarrow(out) == rows_by_pyarrow(pushed)


def test_pull_of_a_corrupted_cache_is_refused_and_leaves_nothing(dataset, tmp_path):
    snapshot = lay_out_hub_cache(tmp_path / "hf", dataset)
    blob = (snapshot / S.DATA_DIR / "part-00000.parquet").resolve()
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))
    (tmp_path / "pulled").mkdir()
    done = run_offline(tmp_path / "hf", "-m", "offline_rec", "pull", REPO, "--out", tmp_path / "pulled" / "ds")
    assert done.returncode == 2
    last = done.stderr.strip().splitlines()[-1]
    assert (
        last.startswith(f"error: pulled {REPO} is not a valid dataset")
        and "sha256" in last
        and "hf cache rm dataset/org/name" in last
    )
    assert os.listdir(tmp_path / "pulled") == []


def test_pull_of_a_repo_missing_from_the_offline_cache(tmp_path):
    (tmp_path / "hf").mkdir()
    done = run_offline(tmp_path / "hf", "-m", "offline_rec", "pull", "org/absent", "--out", tmp_path / "out")
    assert done.returncode == 2
    assert (
        done.stderr.strip()
        .splitlines()[-1]
        .startswith("error: cannot pull org/absent: it is not in the local Hub cache")
    )
    assert not (tmp_path / "out").exists()


def test_resolve_dataset_path_offline(dataset, tmp_path):
    snapshot = lay_out_hub_cache(tmp_path / "hf", dataset)
    script = (
        "from offline_rec.hub.transfer import resolve_dataset_path as r\n"
        f"print(r('hf://datasets/{REPO}'))\n"
        f"print(r('hf://datasets/{REPO}@{COMMIT}'))\n"
        "print(r('some/local/dataset'))\n"
    )
    done = run_offline(tmp_path / "hf", "-c", script)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [str(snapshot), str(snapshot), "some/local/dataset"]


def test_resolve_dataset_path_validates_and_parses(fake_hub, dataset, tmp_path):
    FakeHub.snapshot = dataset
    assert hub.resolve_dataset_path(str(dataset)) == dataset  # local: unchanged, no Hub call
    assert FakeHub.calls == []
    assert hub.resolve_dataset_path(f"hf://datasets/{REPO}@schema-v1.0") == dataset
    assert calls_named("snapshot_download") == [{"repo_id": REPO, "repo_type": "dataset", "revision": "schema-v1.0"}]
    (dataset / S.DATA_DIR / "part-00000.parquet").write_bytes(b"not parquet")
    with pytest.raises(UserError, match="is not a valid dataset"):
        hub.resolve_dataset_path(f"hf://datasets/{REPO}")
    with pytest.raises(UserError, match="expected hf://datasets/ORG/NAME"):
        hub.resolve_dataset_path("hf://datasets/only-a-name")


def test_training_data_from_the_hub_is_validated_once_with_its_row_store(fake_hub, dataset, tmp_path, monkeypatch):
    """train reads hf:// data in the Hub cache (no copy) and validates it once, when its row store is built."""
    import offline_rec.dataset.validate as validate
    from offline_rec.dataset.format import open_dataset
    from offline_rec.training import checks, group_index

    FakeHub.snapshot = dataset
    checked = []
    real_check = validate.check_dataset_for_use
    monkeypatch.setattr(validate, "check_dataset_for_use", lambda path, **k: (checked.append(Path(path)),
                                                                              real_check(path, **k)))
    local = checks._local_path(f"hf://datasets/{REPO}")
    assert Path(local) == dataset and checked == []  # the snapshot folder itself, not validated yet
    for _ in range(2):  # a first run, then a resumed one
        index = group_index.index_datasets([open_dataset(local)], 100, False, cache_dir=tmp_path / "cache",
                                        validate=True, notes=lambda message: None)
        assert index.num_groups == 3
    assert checked == [dataset]


def test_pull_refuses_an_existing_output_and_conflicting_revisions(fake_hub, dataset, tmp_path):
    FakeHub.snapshot = dataset
    with pytest.raises(UserError, match="already exists"):
        hub.pull_dataset(REPO, dataset)
    with pytest.raises(UserError, match="two revisions"):
        hub.pull_dataset(f"hf://datasets/{REPO}@a", tmp_path / "x", revision="b")
    assert FakeHub.calls == []
    empty = tmp_path / "empty"
    empty.mkdir()
    assert hub.pull_dataset(f"hf://datasets/{REPO}@v", empty) == empty  # an empty folder may receive it
    assert calls_named("snapshot_download")[0]["revision"] == "v"
    assert tree_digest(empty) == tree_digest(dataset)


def test_pull_maps_hub_errors(fake_hub, tmp_path):
    from huggingface_hub import errors as E

    FakeHub.fail = {"snapshot_download": _http_error(E.RepositoryNotFoundError, 401)}
    with pytest.raises(UserError, match="cannot pull org/name: repository not found or not accessible"):
        hub.pull_dataset(REPO, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------------------------
# push_model


@pytest.fixture()
def checkpoint(tmp_path):
    folder = tmp_path / "run" / "final"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / "model.safetensors").write_bytes(b"weights")
    (folder / "tokenizer.json").write_text("{}")
    (folder / "README.md").write_text("old card")
    (folder / ".hidden").write_text("not published")
    return folder


def test_push_model_uploads_the_checkpoint_with_a_generated_card(fake_hub, checkpoint):
    before = tree_digest(checkpoint)
    url = hub.push_model(
        checkpoint, "org/policy",
        algorithm={"name": "rec-oneside-nois", "eps_low": 0.2},
        training_data=["hf://datasets/org/data@schema-v1.0", "local/ds"],
        eval_summary={"reward_mean": 0.5},
        config={"model": "tiny-org/base", "algorithm": "rec-oneside-nois"},
    )
    assert url == "https://huggingface.co/org/policy"
    assert calls_named("create_repo") == [{"repo_id": "org/policy", "repo_type": "model", "private": None}]
    upload, = calls_named("upload_folder")
    assert upload["files"] == ["README.md", "config.json", "model.safetensors", "tokenizer.json"]
    assert upload["repo_type"] == "model" and upload["replace_patterns"] == hub.MODEL_REPLACED
    remote = FakeHub.repos["org/policy"]
    assert remote["model.safetensors"] == b"weights"
    front, body = split_front_matter(remote["README.md"].decode())
    assert front["library_name"] == "transformers" and front["datasets"] == ["org/data"]
    assert front["tags"] == ["offline-rl", "rl", "reinforce", "offline-rec"]
    assert front["base_model"] == "tiny-org/base"
    assert (
        "Preset `rec-oneside-nois`" in body and "| `eps_low` | `0.2` |" in body and "| `reward_mean` | `0.5` |" in body
    )
    assert tree_digest(checkpoint) == before
    assert sorted(os.listdir(checkpoint.parent)) == ["final"]


def test_push_model_refuses_a_folder_that_is_not_a_checkpoint(fake_hub, tmp_path):
    with pytest.raises(UserError, match="not a save_pretrained folder"):
        hub.push_model(tmp_path, "org/policy", algorithm={}, training_data=[], eval_summary=None, config={})
    assert FakeHub.calls == []


def test_push_model_maps_hub_errors(fake_hub, checkpoint):
    from huggingface_hub import errors as E

    FakeHub.fail = {"upload_folder": _http_error(E.HfHubHTTPError, 403)}
    with pytest.raises(UserError, match="permission denied"):
        hub.push_model(
            checkpoint, "org/policy", algorithm={"name": "grpo"}, training_data=[], eval_summary=None, config={}
        )
    assert sorted(os.listdir(checkpoint.parent)) == ["final"]
