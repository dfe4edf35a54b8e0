"""micro_batch_tokens auto: 2048 on a CPU, 8192 on a GPU, set where the config is resolved (`build_config`, and
`loop.train` for a TrainConfig made directly); a value given always wins; --list-options shows auto, the run's saved
config the value it trained with."""

import pytest
import yaml
from support.train_support import config, write_dataset

from offline_rec.cli import main as cli_main
from offline_rec.errors import UserError
from offline_rec.training import distributed
from offline_rec.training.config import (
    AUTO,
    MICRO_BATCH_TOKENS_CPU,
    MICRO_BATCH_TOKENS_GPU,
    build_config,
    option_help,
    resolve_device_defaults,
    save_config,
)
from offline_rec.training.loop import train

REQUIRED = dict(data=["d"], model="m", algorithm="rec-logged", out="r")


@pytest.fixture
def gpu(monkeypatch):
    """A machine with a GPU, as `distributed.trains_on_gpu` sees it."""
    monkeypatch.setattr(distributed, "_gpu_available", lambda: True)


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(distributed, "_gpu_available", lambda: False)


def test_the_default_is_auto_until_resolved():
    assert dict((key, default) for key, _, default, _ in option_help())["micro_batch_tokens"] == AUTO == "auto"


def test_auto_is_2048_on_a_cpu_and_8192_on_a_gpu(monkeypatch):
    monkeypatch.setattr(distributed, "_gpu_available", lambda: False)
    assert build_config(options=REQUIRED).micro_batch_tokens == MICRO_BATCH_TOKENS_CPU == 2048
    monkeypatch.setattr(distributed, "_gpu_available", lambda: True)
    assert build_config(options=REQUIRED).micro_batch_tokens == MICRO_BATCH_TOKENS_GPU == 8192
    # cpu: true trains on the CPU although a GPU is there
    assert build_config(options={**REQUIRED, "cpu": True}).micro_batch_tokens == 2048
    assert build_config(options=REQUIRED, sets=["micro_batch_tokens=auto"]).micro_batch_tokens == 8192


@pytest.mark.parametrize("device", ["gpu", "no_gpu"])
def test_a_value_given_always_wins(request, tmp_path, device):
    request.getfixturevalue(device)
    assert build_config(options={**REQUIRED, "micro_batch_tokens": 8192}).micro_batch_tokens == 8192
    assert build_config(options={**REQUIRED, "micro_batch_tokens": 8192},
                        sets=["micro_batch_tokens=512"]).micro_batch_tokens == 512
    config_file = tmp_path / "c.yaml"
    config_file.write_text("micro_batch_tokens: 1024\n")
    assert build_config(config_file, REQUIRED).micro_batch_tokens == 1024


def test_a_resumed_run_keeps_the_budget_it_saved(tmp_path, no_gpu):
    """A run saved with the old default 8192 resumes at 8192 on a CPU: the saved config is the base, not auto."""
    out = tmp_path / "run"
    out.mkdir()
    save_config(build_config(options={**REQUIRED, "out": str(out), "micro_batch_tokens": 8192}), out / "config.yaml")
    assert build_config(options={**REQUIRED, "out": str(out), "resume": True}).micro_batch_tokens == 8192


def test_a_budget_that_is_not_a_number_or_auto_is_refused():
    with pytest.raises(UserError, match=r"micro_batch_tokens must be an integer >= 1 or auto, got 'big'"):
        build_config(options=REQUIRED, sets=["micro_batch_tokens=big"])
    with pytest.raises(UserError, match="got 0"):
        build_config(options=REQUIRED, sets=["micro_batch_tokens=0"])


def test_list_options_shows_auto(capsys):
    with pytest.raises(SystemExit) as ended:
        cli_main(["train", "--list-options"])
    assert ended.value.code == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("micro_batch_tokens "))
    assert "'auto'" in line and "2048 on a CPU" in line and "8192 on a GPU" in line


def test_the_saved_config_records_the_resolved_budget(tmp_path, model_dir, no_gpu):
    """A TrainConfig made directly (not through build_config) still says auto; the run resolves it, trains with it
    and saves it: RUN/config.yaml and the printed recipe hold 2048."""
    data = write_dataset(tmp_path / "d", model_dir, num_groups=2)
    made = config(tmp_path, model_dir, data, micro_batch_tokens=AUTO, max_steps=1)
    assert made.micro_batch_tokens == AUTO and resolve_device_defaults(made).micro_batch_tokens == 2048
    train(made)
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["micro_batch_tokens"] == 2048
