"""Bad input never crashes with a traceback and never changes anything: a (defect) x (command) matrix.

Every dataset defect that `validate` reports as an error (the builders and expected problems of
tests/test_validate.py) makes `validate` exit 1 with the problem at its shard and row, and is handed
to every command that consumes a dataset. Each must refuse with exit 2 and exactly one stderr line
"error: ..." that names the problem's place (the shard, and the row for a row-level defect, or
manifest.json), leave the input byte for byte as it was and create no output. Commands run
in-process through `offline_rec.cli.main`: an exception other than the CLI's own exit would
escape to the test, so "exit 2" also means "no traceback". One case per command runs in a real
process as well.

`inspect` describes what it can read: it refuses only datasets it cannot read (a broken manifest,
an unreadable or missing shard); rows that break the format are `validate`'s job and are
described as they are.

Data that is valid but unusable for one command (null rewards for train, a prompt longer than the
model's context, an empty dataset), bad options (unknown algorithm, task, config key), bad models
and bad import files are cases of their own below, as is valid but degenerate data (singleton and
all-equal groups), which trains with a warning and counts in metrics.jsonl.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support.cli_support import run_cli
from support.datagen import make_rows, tree_digest, write_dataset
from support.defects import DEFECTS as VALIDATE_DEFECTS
from support.paths import REPO as ROOT

from offline_rec import schema as S
from offline_rec.dataset.validate import ERROR, validate_dataset
from offline_rec.hub import transfer as hub
from offline_rec.models.tiny import make_tiny_checkpoint

CONTEXT = 64  # the tiny model's max_position_embeddings

# Defects inspect cannot read past: the manifest, a shard's bytes or its columns.
UNREADABLE = {
    "truncated shard", "random bytes shard", "listed shard missing", "manifest missing",
    "manifest corrupt json", "unknown schema version", "reward stored as float64",
    "completion_ids as list<int64>", "missing column",
}
# Defects that edit the manifest after the card was written: the card no longer names the
# manifest's content, and inspect says so (the card warning) while describing the rows.
STALE_CARD = {"manifest rows disagree", "manifest sha256 disagrees"}
CONSUMERS = ("inspect", "train", "filter", "reward", "merge", "push", "eval-offline")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    """One tiny llama (57-token char vocabulary, context 64) shared by every case of the module."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("reliability-input") / "model", hidden_size=64, num_layers=1,
                                num_heads=2, max_position_embeddings=CONTEXT)


class NoHub:
    """Stands in for hub._HubClient: has a token, and fails the test if anything would be uploaded."""

    def __init__(self, token=None):
        pass

    def has_token(self):
        return True

    def __getattr__(self, name):
        raise AssertionError(f"push reached the Hub ({name}) with a dataset it should have refused")


@pytest.fixture(autouse=True)
def no_hub(monkeypatch):
    monkeypatch.setattr(hub, "_HubClient", NoHub)


def command(name: str, dataset: Path, out: Path, model: str) -> list[str]:
    """The argv of consuming command `name` reading `dataset` and writing (if it writes) `out`."""
    return {
        "inspect": ["inspect", dataset, "--json"],
        "train": [
            "train",
            "--data",
            dataset,
            "--model",
            model,
            "--algorithm",
            "rec-oneside-nois",
            "--out",
            out,
            "--max-steps",
            "1",
            "--set",
            "report_to=[]",
            "--set",
            "progress=false",
            "--set",
            "cpu=true",
            "--set",
            "save_every=0",
        ],
        "filter": ["filter", dataset, "--out", out],
        "reward": ["reward", dataset, "--task", "math", "--out", out, "--timeout", "0"],
        "merge": ["merge", dataset, "--out", out],
        "push": ["push", dataset, "org/name", "--token", "hf_fake"],
        "eval-offline": [
            "eval",
            "--offline",
            "--model",
            model,
            "--data",
            dataset,
            "--out",
            out,
            "--num-bootstrap",
            "0",
        ],
    }[name]


def assert_refused(capsys, argv, inputs: list[Path], out: Path | None, *fragments: str) -> str:
    """Exit 2, one stderr line "error: ..." holding each fragment, inputs unchanged, no output; the line."""
    before = {str(p): tree_digest(p) for p in inputs}
    parent_before = sorted(p.name for p in out.parent.iterdir()) if out is not None else None
    code, _, err = run_cli(capsys, *argv)
    lines = err.strip().splitlines()
    assert code == 2, f"exit {code}, stderr: {err}"
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for fragment in fragments:
        assert fragment in lines[0], f"{fragment!r} not in {lines[0]!r}"
    assert {str(p): tree_digest(p) for p in inputs} == before, "an input was modified"
    if out is not None:
        assert not out.exists(), f"{out} was created"
        # no hidden partial output left beside it either
        assert sorted(p.name for p in out.parent.iterdir()) == parent_before
    return lines[0]


def first_error_location(dataset: Path) -> list[str]:
    """What a refusal must name: the shard (or manifest.json) of the first error, and its row if it has one."""
    problem = next(p for p in validate_dataset(dataset).problems if p.severity == ERROR)
    where = [Path(problem.shard).name if problem.shard else S.MANIFEST_FILE]
    if problem.row is not None:
        where.append(f"row {problem.row}")
    return where


def outputs(tmp_path: Path) -> Path:
    folder = tmp_path / "outputs"
    folder.mkdir()
    return folder / "out"


# --------------------------------------------------------------------------------------------
# every validate error x every consuming command


def matrix():
    for defect in VALIDATE_DEFECTS:
        for consumer in CONSUMERS:
            if consumer == "inspect" and defect not in UNREADABLE:
                continue
            yield pytest.param(defect, consumer, id=f"{defect}-{consumer}")


@pytest.mark.parametrize("defect, consumer", list(matrix()))
def test_consumers_refuse_invalid_datasets_naming_the_place(tmp_path, capsys, model, defect, consumer):
    build, _ = VALIDATE_DEFECTS[defect]
    dataset = build(tmp_path)
    out = outputs(tmp_path)
    assert_refused(capsys, command(consumer, dataset, out, model), [dataset, Path(model)], out,
                   *first_error_location(dataset))


@pytest.mark.parametrize("defect", list(VALIDATE_DEFECTS))
def test_validate_exits_1_and_reports_each_defect_at_its_place(tmp_path, capsys, defect):
    build, expected = VALIDATE_DEFECTS[defect]
    dataset = build(tmp_path)
    before = tree_digest(dataset)
    code, out, err = run_cli(capsys, "validate", dataset, "--json")
    assert code == 1 and err == ""
    report = json.loads(out)
    assert {(p["code"], p["shard"], p["row"]) for p in report["problems"] if p["severity"] == ERROR} == expected
    assert tree_digest(dataset) == before


@pytest.mark.parametrize("defect", sorted(set(VALIDATE_DEFECTS) - UNREADABLE))
def test_inspect_describes_what_it_can_read(tmp_path, capsys, defect):
    dataset = VALIDATE_DEFECTS[defect][0](tmp_path)
    before = tree_digest(dataset)
    code, out, err = run_cli(capsys, "inspect", dataset, "--json")
    assert code == 0
    if defect in STALE_CARD:
        assert err.startswith("warning: datasets.load_dataset(") and err.count("\n") == 1, err
    else:
        assert err == ""
    stats = json.loads(out)
    assert stats["rows"] > 0
    # a NaN or inf reward is counted apart, not averaged into NaN moments
    reward = stats["reward"]
    assert reward["nonfinite"] == (1 if defect in ("nan reward", "inf reward") else 0)
    assert all(reward[k] == reward[k] and abs(reward[k]) != float("inf") for k in ("mean", "std", "min", "max"))
    assert tree_digest(dataset) == before


def test_refusal_in_a_real_process_is_one_line_without_traceback(tmp_path):
    dataset = VALIDATE_DEFECTS["positive logprob"][0](tmp_path)
    out = outputs(tmp_path)
    result = subprocess.run([sys.executable, "-m", "offline_rec", "filter", str(dataset), "--out", str(out)],
                            capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: ") and "part-00001.parquet" in line and "row 5" in line
    assert not out.exists()


# --------------------------------------------------------------------------------------------
# valid data some commands cannot use


def null_reward_dataset(tmp_path: Path) -> Path:
    groups = make_rows([2, 3], seed=3)
    groups[1][2][S.REWARD] = None  # shard part-00000, row 4
    return write_dataset(tmp_path / "ds", groups, groups_per_shard=2)


def test_null_rewards_are_a_warning_for_validate_and_refused_by_train(tmp_path, capsys, model):
    dataset = null_reward_dataset(tmp_path)
    report = validate_dataset(dataset)
    assert report.ok and [(p.code, p.row) for p in report.problems] == [("null-reward", 4)]
    out = outputs(tmp_path)
    assert_refused(capsys, command("train", dataset, out, model), [dataset], out,
                   "no reward", "part-00000.parquet", "offline-rec reward")


@pytest.mark.parametrize("consumer", ["filter", "reward", "merge", "inspect", "eval-offline"])
def test_null_rewards_pass_commands_that_do_not_need_them(tmp_path, capsys, model, consumer):
    dataset = null_reward_dataset(tmp_path)
    before = tree_digest(dataset)
    out = outputs(tmp_path)
    code, _, err = run_cli(capsys, *command(consumer, dataset, out, model))
    assert code == 0, err
    assert tree_digest(dataset) == before


def long_prompt_dataset(tmp_path: Path) -> Path:
    # group g0001's prompt has 2 * CONTEXT tokens: more than the model has positions for; the
    # refusal names the model's context and the first group too long for it
    groups = make_rows([2, 2], seed=4, prompt_lengths=[[3, 3], [2 * CONTEXT] * 2])
    return write_dataset(tmp_path / "ds", groups, groups_per_shard=2)


@pytest.mark.parametrize("consumer", ["train", "eval-offline"])
def test_a_prompt_longer_than_the_models_context_is_refused(tmp_path, capsys, model, consumer):
    dataset = long_prompt_dataset(tmp_path)
    assert validate_dataset(dataset).ok  # the format does not know the model
    out = outputs(tmp_path)
    assert_refused(capsys, command(consumer, dataset, out, model), [dataset], out, "context", str(CONTEXT), "g0001")


def empty_dataset(tmp_path: Path) -> Path:
    return write_dataset(tmp_path / "ds", [])


@pytest.mark.parametrize("consumer, fragment", [("train", "no rows"), ("push", "no rows"), ("eval-offline", "rows")])
def test_an_empty_dataset_is_refused_where_rows_are_needed(tmp_path, capsys, model, consumer, fragment):
    dataset = empty_dataset(tmp_path)
    report = validate_dataset(dataset)
    assert report.ok and [p.code for p in report.problems] == ["empty"]
    out = outputs(tmp_path)
    assert_refused(capsys, command(consumer, dataset, out, model), [dataset], out, fragment)


@pytest.mark.parametrize("consumer", ["inspect", "filter", "reward", "merge"])
def test_an_empty_dataset_passes_through_transformations(tmp_path, capsys, model, consumer):
    dataset = empty_dataset(tmp_path)
    before = tree_digest(dataset)
    out = outputs(tmp_path)
    code, _, err = run_cli(capsys, *command(consumer, dataset, out, model))
    assert code == 0, err
    assert tree_digest(dataset) == before
    if consumer != "inspect":
        assert validate_dataset(out).ok and json.loads((out / S.MANIFEST_FILE).read_text())[S.M_TOTALS]["rows"] == 0


# --------------------------------------------------------------------------------------------
# bad options


@pytest.fixture()
def clean(tmp_path) -> Path:
    return write_dataset(tmp_path / "ds", make_rows([2, 2, 3], seed=5), groups_per_shard=2)


def test_unknown_algorithm(tmp_path, capsys, model, clean):
    out = outputs(tmp_path)
    argv = command("train", clean, out, model)
    argv[argv.index("rec-oneside-nois")] = "rec-nope"
    assert_refused(capsys, argv, [clean], out, "unknown algorithm 'rec-nope'", "rec-oneside-nois")


def test_unknown_algorithm_field(tmp_path, capsys, model, clean):
    out = outputs(tmp_path)
    argv = command("train", clean, out, model) + ["--set", "algorithm.eps_hihg=0.3"]
    assert_refused(capsys, argv, [clean], out, "eps_hihg", "eps_high")


@pytest.mark.parametrize("where", ["--set", "config file"])
def test_unknown_config_key(tmp_path, capsys, model, clean, where):
    out = outputs(tmp_path)
    argv = command("train", clean, out, model)
    if where == "--set":
        argv += ["--set", "prompt_per_step=2"]
    else:
        config = tmp_path / "run.yaml"
        config.write_text("lr: 1.0e-3\nprompt_per_step: 2\n")
        argv += ["--config", config]
    line = assert_refused(capsys, argv, [clean], out, "unknown option 'prompt_per_step'",
                          "did you mean 'prompts_per_step'")
    if where == "config file":
        assert str(tmp_path / "run.yaml") in line


@pytest.mark.parametrize("consumer", ["reward", "eval"])
def test_unknown_task(tmp_path, capsys, model, clean, consumer):
    out = outputs(tmp_path)
    argv = (["reward", clean, "--task", "arithmetic", "--out", out] if consumer == "reward" else
            ["eval", "--model", model, "--task", "arithmetic", "--out", out, "--backend", "hf"])
    assert_refused(capsys, argv, [clean], out, "unknown task 'arithmetic'", "arith")


# --------------------------------------------------------------------------------------------
# missing or mismatched model and tokenizer


def model_without(tmp_path: Path, model: str, kind: str) -> str:
    """A copy of `model` lacking its tokenizer files or its weights."""
    copy = tmp_path / f"model-without-{kind}"
    shutil.copytree(model, copy)
    for f in copy.iterdir():
        is_weights = f.suffix == ".safetensors"
        if (kind == "weights") == is_weights and f.name not in ("config.json", "generation_config.json"):
            f.unlink()
    return str(copy)


@pytest.mark.parametrize("consumer", ["train", "eval-offline"])
@pytest.mark.parametrize("case", ["absent", "no tokenizer", "no weights", "other tokenizer", "vocabulary too small"])
def test_missing_or_mismatched_model(tmp_path, capsys, model, clean, consumer, case):
    dataset = clean
    if case == "absent":
        policy, fragment = str(tmp_path / "no-such-model"), "does not exist"
    elif case == "no tokenizer":
        policy, fragment = model_without(tmp_path, model, "tokenizer"), "tokenizer"
    elif case == "no weights":
        policy, fragment = model_without(tmp_path, model, "weights"), "model-without-weights"
    elif case == "other tokenizer":
        # the data records the hash of a tokenizer of other letters than the model's
        from offline_rec.models.loading import tokenizer_hash
        from offline_rec.models.tiny import build_char_tokenizer

        behavior = S.behavior_provenance(model="other", tokenizer_hash=tokenizer_hash(build_char_tokenizer("abc")))
        dataset = write_dataset(tmp_path / "other-ds", make_rows([2, 2], seed=5), behavior=behavior)
        policy, fragment = model, "tokenizer"
    else:
        # token ids up to 99 against the model's 57 embeddings
        dataset = write_dataset(tmp_path / "wide-ds", make_rows([2, 2], seed=5, vocab_size=100))
        policy, fragment = model, "token id"
    out = outputs(tmp_path)
    assert_refused(capsys, command(consumer, dataset, out, policy), [dataset, Path(model)], out, fragment)


# --------------------------------------------------------------------------------------------
# import files


def test_non_utf8_import_file_is_refused_with_its_line(tmp_path, capsys):
    good = {S.GROUP_ID: "g", S.SAMPLE_INDEX: 0, S.PROMPT: "1+1=", S.PROMPT_IDS: [5, 6], S.COMPLETION: "2",
            S.COMPLETION_IDS: [7, 2], S.BEHAVIOR_LOGPROBS: [-0.5, -0.25], S.REWARD: 1.0}
    src = tmp_path / "logs.jsonl"
    src.write_bytes(json.dumps(good).encode() + b"\n" + b'{"prompt": "caf\xe9 \xff"}\n')
    out = outputs(tmp_path)
    before = src.read_bytes()
    code, _, err = run_cli(capsys, "import", src, "--format", "rows", "--out", out)
    lines = err.strip().splitlines()
    assert code == 2 and "Traceback" not in err
    # the bad line first (file:line: reason), then the one error line
    assert lines[0] == f"{src}:2: not valid UTF-8 (byte 15 of the line)"
    assert lines[-1].startswith("error: ") and len(lines) == 2
    assert src.read_bytes() == before and not out.exists()
    # --skip-bad imports the good line and sets the bad one aside
    code, _, err = run_cli(capsys, "import", src, "--format", "rows", "--out", out, "--skip-bad")
    assert code == 0, err
    assert validate_dataset(out).ok
    (reject,) = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    assert (reject["line"], reject["code"]) == (2, "bad-utf8")


# --------------------------------------------------------------------------------------------
# valid but degenerate data trains


def test_singleton_and_all_equal_groups_train_with_a_warning_and_a_metric(tmp_path, capsys, model):
    # g0000: one response (no baseline, A = 0); g0001: rewards 1, 1, 1 (all equal, A = 0); g0002: 0, 1
    groups = make_rows([1, 3, 2], seed=6, rewards=[[1.0], [1.0, 1.0, 1.0], [0.0, 1.0]])
    dataset = write_dataset(tmp_path / "ds", groups, groups_per_shard=2)
    out = tmp_path / "run"
    argv = command("train", dataset, out, model)
    argv[argv.index("--max-steps") + 1] = "1"
    argv += ["--prompts-per-step", "3", "--set", "shuffle=false"]
    code, stdout, err = run_cli(capsys, *argv)
    assert code == 0, err
    (metrics,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert metrics["singleton_groups"] == 1
    # zero-variance groups are those of size >= 2 with equal rewards: g0001 of the 3
    assert metrics["zero_variance_group_fraction"] == pytest.approx(1 / 3)
    assert all(v == v for v in metrics.values() if isinstance(v, float))  # no NaN anywhere
    printed = stdout + err
    assert "warning" in printed and "no learning signal" in printed
