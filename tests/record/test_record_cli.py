"""`offline-rec record`: bad options are one-line errors (exit 2) before anything listens or is written."""

from __future__ import annotations

import socket

import pytest
from support.cli_support import run_cli


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--upstream", "localhost:8000"], "expected an http:// or https:// URL"),
        (["--redact-field", "messages..name"], "--redact-field 'messages..name'"),
        (["--logprobs-mode", "sampled"], "unknown --logprobs-mode 'sampled'"),
        (["--fsync-interval", "-1"], "--fsync-interval must be >= 0"),
        (["--rotate-mb", "0"], "--rotate-mb must be > 0"),
        (["--episode-idle-timeout", "0"], "--episode-idle-timeout must be > 0"),
        (["--max-body-mb", "0"], "--max-body-mb must be > 0"),
        (["--upstream-read-timeout", "-1"], "--upstream-read-timeout must be > 0"),
        (["--max-open-episodes", "0"], "--max-open-episodes must be >= 1"),
        (["--api-key", " "], "--api-key is empty"),
        (["--api-key-file", "/nonexistent/keys"], "cannot read --api-key-file /nonexistent/keys"),
    ],
)
def test_bad_options(capsys, tmp_path, extra, message):
    argv = ["record", "--upstream", "http://127.0.0.1:9", "--out", tmp_path / "rec", "--port", "0", *extra]
    code, _, err = run_cli(capsys, *argv)
    assert code == 2 and message in err, err
    assert not (tmp_path / "rec").exists() or not any((tmp_path / "rec").iterdir())


def test_out_is_a_file_or_port_taken(capsys, tmp_path):
    (tmp_path / "file").write_text("x")
    code, _, err = run_cli(capsys, "record", "--upstream", "http://127.0.0.1:9", "--out", tmp_path / "file")
    assert code == 2 and "is a file" in err
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, _, err = run_cli(capsys, "record", "--upstream", "http://127.0.0.1:9", "--out", tmp_path / "rec",
                               "--port", port)
    assert code == 2 and f"cannot listen on 127.0.0.1:{port}" in err
