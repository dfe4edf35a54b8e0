"""The production loop of docs/rounds.md (record -> import -> rounds --logs) runs as written: each command line of its
bash block in a shell (`offline-rec` being this checkout's `python -m offline_rec`), in front of the session's real vLLM
server, which stands for the block's first line (the tiny chat model: another port and served name); the test is
the day's clients, and their rewards."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from support.doc_blocks import bash_lines
from support.paths import REPO
from support.ports import free_port

from offline_rec import schema as S
from offline_rec.dataset.format import open_dataset

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PAGE, HEADING = "docs/rounds.md", "The production loop:"
PROMPTS = ["Name a colour.", "Say hello.", "Count to three.", "Name a fruit.", "Pick a number.", "Say yes or no."]
REWARD_MODULE = '''
def score(prompt, completion, fields):
    """1 for an answer of an even number of characters: a reward the tiny model's answers differ in."""
    return float(len(completion) % 2 == 0)
'''


def page_commands() -> list[str]:
    """The block's command lines, a line ending in a backslash joined with the next."""
    commands, pending = [], ""
    for line in bash_lines(PAGE, HEADING):
        pending += line.rstrip("\\").rstrip() + " " if line.endswith("\\") else line
        if not line.endswith("\\"):
            commands.append(pending)
            pending = ""
    return commands


def wait_for_port(port: int, process: subprocess.Popen, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            assert process.poll() is None and time.monotonic() < deadline, "record did not start"
            time.sleep(0.1)


@pytest.mark.timeout(1200)
def test_the_production_loop_runs_as_written(vllm_server, tmp_path):
    serve, record, import_, rounds, policy = page_commands()
    assert serve.startswith("python -m vllm.entrypoints.openai.api_server") and serve.endswith("&")
    assert record.endswith("&") and "--upstream http://127.0.0.1:8000" in record and "--port 8001" in record
    model = vllm_server.model_dir
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", MODEL=model, POLICY=model, N="1",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    shell = f'offline-rec() {{ "{sys.executable}" -m offline_rec "$@"; }}\n'

    def run(command: str) -> str:
        done = subprocess.run(["bash", "-c", shell + command], cwd=tmp_path, env=env, capture_output=True, text=True)
        assert done.returncode == 0, f"{command}\n{done.stdout}\n{done.stderr[-3000:]}"
        return done.stdout

    port = free_port()
    upstream = vllm_server.base_url.removesuffix("/v1")
    command = record.removesuffix("&").replace("http://127.0.0.1:8000", upstream).replace("8001", str(port))
    in_place = shell.replace("{ ", "{ exec ")  # the recorder replaces the shell: Ctrl-C (SIGINT) reaches it
    with open(tmp_path / "record.log", "w") as log:
        recorder = subprocess.Popen(["bash", "-c", in_place + command], cwd=tmp_path, env=env, stdout=log,
                                    stderr=subprocess.STDOUT)
    try:
        wait_for_port(port, recorder)
        rewards = []
        for seed, prompt in enumerate(PROMPTS):  # the day's clients, through the recorder
            reply = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=120, json={
                "model": vllm_server.served_name, "messages": [{"role": "user", "content": prompt}],
                "max_tokens": 6, "temperature": 1.0, "seed": seed}).json()
            text = reply["choices"][0]["message"]["content"]
            rewards.append({"id": reply["id"], "reward": float(len(text) % 2 == 0)})
    finally:
        recorder.send_signal(2)  # Ctrl-C: the recorder closes its files
        assert recorder.wait(timeout=60) == 0, (tmp_path / "record.log").read_text()[-3000:]
    assert 0 < sum(r["reward"] for r in rewards) < len(rewards)  # something to learn
    (tmp_path / "rewards-1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rewards))
    (tmp_path / "my_rewards.py").write_text(REWARD_MODULE)
    validation = [f"Say the number {number}." for number in range(128)]  # --validation-prompts' default
    for name, prompts in (("validation.jsonl", validation), ("test.jsonl", PROMPTS[:3])):
        (tmp_path / name).write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))

    run(import_)
    logged = open_dataset(tmp_path / "logs" / "rounds" / "round-1").to_table().to_pylist()
    assert sorted(row[S.REWARD] for row in logged) == sorted(r["reward"] for r in rewards)
    run(rounds)
    lines = [json.loads(line) for line in (tmp_path / "runs" / "production" / "rounds.jsonl").open()]
    assert [line["round"] for line in lines] == [0, 1] and lines[1]["trained"]
    assert lines[1]["data_rows"] == len(PROMPTS) and lines[1]["collect_samples"] == 0  # logs: nothing sampled
    summary = json.loads((tmp_path / "runs" / "production" / "summary.json").read_text())
    assert "round-2" in summary["stopped"] and "has not arrived" in summary["stopped"]
    assert run(policy + '\necho "$POLICY"').strip() == summary["last"]["policy"] == lines[1]["policy"]
