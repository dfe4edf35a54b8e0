"""The CLI skeleton: version, help of every command, no heavy imports, exit codes, --json, one-line user errors.

Most checks call `offline_rec.cli.main([...])` in process (fast); a few run real processes to see
what a user sees: the console script, `python -m offline_rec` and a fresh interpreter's modules.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import typer
from support.cli_support import run_cli as run_main
from support.datagen import make_rows, write_dataset
from support.paths import REPO as REPO_DIR

from offline_rec import __version__
from offline_rec import schema as S
from offline_rec.cli import app
from offline_rec.dataset.inspect import describe_dataset

HEAVY_MODULES = ("torch", "transformers", "vllm")


def run_process(*argv):
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, cwd=REPO_DIR, timeout=120)


def registered_commands():
    return sorted(typer.main.get_command(app).commands)


@pytest.fixture
def clean(tmp_path):
    return write_dataset(tmp_path / "clean", make_rows([2, 3, 2], seed=1))


@pytest.fixture
def defective(tmp_path):
    groups = make_rows([2, 2], seed=1)
    groups[1][0][S.BEHAVIOR_LOGPROBS] = groups[1][0][S.BEHAVIOR_LOGPROBS] + [-0.5]
    return write_dataset(tmp_path / "defective", groups, groups_per_shard=1)


# --------------------------------------------------------------------------------------------
# version, help, imports


def test_version_from_the_console_script():
    script = Path(sys.executable).with_name("offline-rec")
    if not script.exists():
        pytest.skip("the offline-rec console script is not installed in this environment")
    result = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=120)
    assert (result.returncode, result.stdout, result.stderr) == (0, f"offline-rec {__version__}\n", "")


def test_python_dash_m_help():
    result = run_process("-m", "offline_rec", "--help")
    assert result.returncode == 0, result.stderr
    assert "Usage: offline-rec" in result.stdout
    for command in registered_commands():
        assert command in result.stdout


def test_version_in_process(capsys):
    assert run_main(capsys, "--version") == (0, f"offline-rec {__version__}\n", "")


def test_app_help(capsys):
    code, out, err = run_main(capsys, "--help")
    assert code == 0 and err == ""
    assert "Offline RL for LLMs from logged trajectories" in out
    assert {"validate", "inspect"} <= set(registered_commands())


@pytest.mark.parametrize("command", registered_commands())
def test_every_registered_command_has_help(capsys, command):
    code, out, err = run_main(capsys, command, "--help")
    assert code == 0 and err == ""
    assert f"Usage: offline-rec {command}" in out


def test_importing_the_cli_and_running_help_imports_no_heavy_library():
    probe = (
        "import json, sys\n"
        "import offline_rec.cli\n"
        "for argv in (['--help'], ['validate', '--help'], ['inspect', '--help']):\n"
        "    try:\n"
        "        offline_rec.cli.main(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        f"print(json.dumps([m for m in {HEAVY_MODULES!r} if m in sys.modules]))\n"
    )
    result = run_process("-c", probe)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1]) == []


# --------------------------------------------------------------------------------------------
# validate and inspect


def test_validate_exit_codes(capsys, clean, defective, tmp_path):
    code, out, _ = run_main(capsys, "validate", str(clean))
    assert code == 0 and "valid: 7 rows, 3 groups checked; 0 error(s), 0 warning(s)" in out
    code, out, _ = run_main(capsys, "validate", str(defective))
    assert code == 1 and "INVALID" in out and "length-mismatch" in out
    code, _, err = run_main(capsys, "validate", str(tmp_path / "absent"))
    assert code == 2 and err.startswith("error:")


def test_validate_json(capsys, clean, defective):
    code, out, _ = run_main(capsys, "validate", str(clean), "--json")
    report = json.loads(out)
    assert code == 0 and report["ok"] is True and report["problems"] == []
    assert (report["rows_checked"], report["groups_checked"]) == (7, 3)

    code, out, _ = run_main(capsys, "validate", str(defective), "--json")
    report = json.loads(out)
    assert code == 1 and report["ok"] is False and report["errors"] == 1
    assert report["counts"] == {"error:length-mismatch": 1}
    (problem,) = report["problems"]
    # one group per shard: the second group is shard 1, its first response row 0
    assert (problem["shard"], problem["row"], problem["group_id"]) == ("data/part-00001.parquet", 0, "g0001")


def test_validate_no_checksums_option(capsys, clean):
    # the same rows rewritten uncompressed: other bytes, so only the sha256 check objects
    shard = clean / "data" / "part-00000.parquet"
    pq.write_table(pq.read_table(shard), shard, compression="none")
    assert run_main(capsys, "validate", str(clean))[0] == 1
    assert run_main(capsys, "validate", str(clean), "--no-checksums")[0] == 0


def test_inspect_json_equals_the_library_statistics(capsys, clean):
    code, out, err = run_main(capsys, "inspect", str(clean), "--json")
    assert code == 0 and err == ""
    expected = json.loads(json.dumps(describe_dataset(clean), default=str))
    assert json.loads(out) == expected
    assert expected["rows"] == 7 and expected["groups"] == 3


def test_inspect_text(capsys, clean):
    code, out, _ = run_main(capsys, "inspect", str(clean))
    assert code == 0 and "behavior provenance" in out and "rows" in out


# --------------------------------------------------------------------------------------------
# user errors: one line on stderr, "error:", exit 2, no traceback


def _missing(tmp_path):
    return tmp_path / "absent"


def _a_file(tmp_path):
    path = tmp_path / "file.parquet"
    path.write_bytes(b"x")
    return path


def _edited_manifest(text_of):
    def build(tmp_path):
        path = write_dataset(tmp_path / "ds", make_rows([2]))
        manifest = path / S.MANIFEST_FILE
        manifest.write_text(text_of(json.loads(manifest.read_text())))
        return path
    return build


def _corrupt_shard(tmp_path):
    path = write_dataset(tmp_path / "ds", make_rows([2]))
    (path / "data" / "part-00000.parquet").write_bytes(b"not parquet")
    return path


_wrong_version = _edited_manifest(lambda m: json.dumps({**m, S.M_SCHEMA_VERSION: "7.1"}))
_corrupt_manifest = _edited_manifest(lambda m: json.dumps(m)[:-5])

USER_ERRORS = [
    ("validate", _missing, "does not exist"),
    ("validate", _a_file, "is not a directory"),
    ("inspect", _missing, "does not exist"),
    ("inspect", _a_file, "is not a directory"),
    ("inspect", _wrong_version, "unknown schema_version '7.1'"),
    ("inspect", _corrupt_manifest, "manifest is not valid JSON"),
    ("inspect", _corrupt_shard, "cannot read the dataset's shards"),
]


@pytest.mark.parametrize("command, build, fragment", USER_ERRORS, ids=lambda x: getattr(x, "__name__", x))
def test_user_errors_are_one_line(capsys, tmp_path, command, build, fragment):
    code, out, err = run_main(capsys, command, str(build(tmp_path)))
    assert code == 2
    assert len(err.splitlines()) == 1 and err.startswith("error:") and err.endswith("\n")
    assert fragment in err
    assert "Traceback" not in out + err


def test_user_error_in_a_real_process_has_no_traceback(tmp_path):
    result = run_process("-m", "offline_rec", "inspect", str(_wrong_version(tmp_path)))
    assert result.returncode == 2
    assert result.stderr.startswith("error:") and len(result.stderr.splitlines()) == 1
    assert "Traceback" not in result.stdout + result.stderr


def test_validate_reports_a_wrong_schema_version_as_a_problem(capsys, tmp_path):
    # for validate an unknown version is a finding about the dataset (exit 1), not unusable input
    code, out, _ = run_main(capsys, "validate", str(_wrong_version(tmp_path)), "--json")
    report = json.loads(out)
    assert code == 1 and report["counts"] == {"error:manifest": 1}


def test_the_program_skips_the_teardown_only_after_a_command_that_asks(monkeypatch):
    from offline_rec import cli

    skipped = []
    monkeypatch.setattr(cli.os, "_exit", skipped.append)

    def asks():
        raise cli.ExitWithoutTeardown()

    monkeypatch.setattr(cli, "main", asks)
    cli.run()
    assert skipped == [0]
    monkeypatch.setattr(cli, "main", lambda: sys.exit(0))
    with pytest.raises(SystemExit) as done:
        cli.run()
    assert done.value.code == 0 and skipped == [0]
    assert isinstance(cli.ExitWithoutTeardown(), SystemExit) and cli.ExitWithoutTeardown().code == 0


@pytest.mark.parametrize("world_size, skips", [(1, False), (2, True)])
def test_train_skips_the_teardown_after_a_multi_process_run_only(monkeypatch, capsys, world_size, skips):
    # gloo's or DeepSpeed's native threads can abort a finished multi-process job's teardown (exit -6): every
    # such run ends without it, whatever its backend; a one-process run exits normally
    from offline_rec import cli, summaries
    from offline_rec.eval import hooks
    from offline_rec.training import config, loop

    skipped = []
    monkeypatch.setattr(cli.os, "_exit", skipped.append)
    monkeypatch.setattr(config, "build_config", lambda *args: "resolved")
    monkeypatch.setattr(hooks, "training_hooks", lambda resolved: None)
    monkeypatch.setattr(loop, "train", lambda resolved, hooks: {"world_size": world_size, "distributed": "FSDP"})
    monkeypatch.setattr(summaries, "train_line", lambda summary: "trained")
    monkeypatch.setattr(sys, "argv", ["offline-rec", "train", "--data", "d", "--model", "m"])
    if skips:
        cli.run()
        assert skipped == [0]
    else:
        with pytest.raises(SystemExit) as done:
            cli.run()
        assert done.value.code in (0, None) and skipped == []
    assert "trained" in capsys.readouterr().out
