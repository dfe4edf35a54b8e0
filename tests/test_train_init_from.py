"""init_from: a run continued on new data keeps the earlier run's AdamW state and policy version."""

import json

import pytest
import torch

from offline_rec.cli import main as cli_main
from offline_rec.train import train

from test_train_support import config, state_dict_of, tiny_model, write_dataset


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory, model_dir):
    return write_dataset(tmp_path_factory.mktemp("data") / "d", model_dir, num_groups=4)


def _metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _run(tmp_path, model_dir, data_dir, name, steps, **overrides):
    # One step = every group (prompts_per_step >= groups): each step sees the same rows whatever
    # the shuffle, so a continued run can reproduce an uninterrupted one exactly.
    settings = dict(out=str(tmp_path / name), prompts_per_step=4, max_steps=steps, lr=3e-3)
    settings.update(overrides)
    train(config(tmp_path, model_dir, data_dir, **settings))
    return tmp_path / name


def test_a_continued_run_is_the_uninterrupted_run(tmp_path, model_dir, data_dir):
    straight = _run(tmp_path, model_dir, data_dir, "straight", 4)
    first = _run(tmp_path, model_dir, data_dir, "first", 2)
    continued = _run(tmp_path, model_dir, data_dir, "continued", 2, init_from=str(first))
    fresh = _run(tmp_path, model_dir, data_dir, "fresh", 2, model=str(first / "final"))  # weights only

    expected = state_dict_of(straight / "final")
    got, restarted = state_dict_of(continued / "final"), state_dict_of(fresh / "final")
    assert max((got[k] - v).abs().max().item() for k, v in expected.items()) < 1e-6
    # Restarting AdamW (bias correction from step 1 again) gives other weights: the test can tell.
    assert max((restarted[k] - v).abs().max().item() for k, v in expected.items()) > 1e-4

    # The trained policy's version goes on from the first run's 2 updates, and staleness with it.
    lines = _metrics(continued)
    assert [m["step"] for m in lines] == [1, 2]
    assert [m["trained_policy_version"] for m in lines] == [2, 3]
    assert [m["staleness"] for m in lines] == [pytest.approx(v - m["policy_version_mean"]) for v, m in zip([2, 3], lines)]
    assert [m["trained_policy_version"] for m in _metrics(fresh)] == [0, 1]
    assert [m["staleness"] + 2 for m in _metrics(fresh)] == pytest.approx([m["staleness"] for m in lines])
    assert [m["loss"] for m in lines] == pytest.approx([m["loss"] for m in _metrics(straight)[2:]], abs=1e-6)
    state = json.loads((continued / "checkpoints" / "step-000002" / "trainer_state.json").read_text())
    assert (state["policy_version_start"], state["policy_version"]) == (2, 4)

    # Its own lr and schedule: the first run's hyper-parameters are not carried over.
    other_lr = _run(tmp_path, model_dir, data_dir, "other-lr", 1, init_from=str(first), lr=1e-4)
    assert _metrics(other_lr)[0]["lr"] == pytest.approx(1e-4)


def test_a_resumed_continuation_keeps_its_version_start(tmp_path, model_dir, data_dir):
    import shutil

    first = _run(tmp_path, model_dir, data_dir, "first", 1)
    source = str(first / "checkpoints" / "step-000001")
    continued = _run(tmp_path, model_dir, data_dir, "continued", 2, init_from=source, save_every=1)
    expected = state_dict_of(continued / "final")
    # As if it had been killed after its first step: the resume starts from ITS checkpoint.
    shutil.rmtree(continued / "final")
    shutil.rmtree(continued / "checkpoints" / "step-000002")
    _run(tmp_path, model_dir, data_dir, "continued", 2, init_from=source, save_every=1, resume=True)
    assert [m["trained_policy_version"] for m in _metrics(continued)] == [1, 2]
    got = state_dict_of(continued / "final")
    assert max((got[k] - v).abs().max().item() for k, v in expected.items()) == 0


@pytest.mark.parametrize("case", ["missing", "final-folder", "lora-mismatch"])
def test_init_from_errors_are_one_line_and_write_nothing(tmp_path, model_dir, data_dir, capsys, case):
    first = _run(tmp_path, model_dir, data_dir, "first", 1)
    extra = []
    if case == "missing":  # the named option; the other cases give the YAML key with --set
        source, expected = tmp_path / "nowhere", "neither a training run with checkpoints"
        extra = ["--init-from", str(source)]
    elif case == "final-folder":
        source, expected = first / "final", "has no optimizer state: start from it with --model"
    else:
        source, expected = first, "holds full weights but this run trains a LoRA adapter"
        extra = ["--set", "lora_r=4"]
    run = tmp_path / "run"
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["train", "--data", data_dir, "--model", model_dir, "--algorithm", "grpo", "--out", str(run),
                  "--set", "progress=false", "--set", "cpu=true",
                  *(extra if case == "missing" else ["--set", f"init_from={source}", *extra])])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert err.startswith("error: ") and expected in err and err.count("\n") == 1
    assert not run.exists()
