"""The policy's numerics checks and counters: bf16 weights against the learning rate, optimizer steps, the backend.

- `check_update_precision`: a bf16 weight w keeps 8 significant bits, so w + lr rounds back to w
  when lr is below half its spacing (2^-8 * 2^floor(log2 |w|)); hand-computed cases around that edge,
  and the CLI refusing `model_dtype: bfloat16` with lr 1e-6 in one line, with the fix, writing nothing.
- `optimizer_steps` counts what AdamW's own state says, through accelerate's wrapper.
- one process: summary.json says "distributed": "NO" and optimizer_steps == steps.
"""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch
from support.cli_support import cli_exit_code
from support.train_support import config, tiny_model, write_dataset

from offline_rec.errors import UserError
from offline_rec.training.loop import train
from offline_rec.training.policy import check_update_precision, optimizer_steps


class _Weights(torch.nn.Module):
    def __init__(self, values, dtype=torch.bfloat16, trainable=True):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.tensor(values, dtype=dtype), requires_grad=trainable)


def test_bf16_weights_that_cannot_take_an_update_of_lr_are_refused_with_the_fix():
    # The bf16 numbers next to 1.0 are 1 - 2^-8 and 1 + 2^-7: 1 + lr rounds to 1 for lr < 2^-8 = 0.0039.
    ones = _Weights([1.0, 1.0, 1.0])
    with pytest.raises(UserError, match=r"w \+ lr rounds back to w for 100% .*model_dtype: float32 with "
                                        r"mixed_precision: bf16"):
        check_update_precision(ones, 0.003, "bfloat16")
    check_update_precision(ones, 0.005, "bfloat16")  # 1.005 rounds to 1 + 2^-7: the update happens
    # Near 0.02 (the usual init scale) the spacing is 2^-13: lr 1e-6 is lost, lr 1e-4 is not.
    small = _Weights([0.02, -0.02, 0.015, 0.03])
    with pytest.raises(UserError, match="lr 1e-06"):
        check_update_precision(small, 1e-6, "bfloat16")
    check_update_precision(small, 1e-4, "bfloat16")


def test_the_refusal_needs_most_of_the_trainable_weights_to_be_lost():
    # 2 of 4 bf16 weights lose an update of 0.003 (the two 1.0s; 1e-3 + 0.003 is representable): not more than half.
    check_update_precision(_Weights([1.0, 1.0, 1e-3, 1e-3]), 0.003, "bfloat16")
    check_update_precision(_Weights([1.0, 1.0, 1.0], trainable=False), 1e-6, "bfloat16")  # frozen: not trained
    check_update_precision(_Weights([1.0, 1.0, 1.0], dtype=torch.float32), 1e-6, "float32")  # fp32 keeps it


def test_optimizer_steps_are_read_from_adamw_state():
    model = _Weights([1.0, 2.0], dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    assert optimizer_steps(optimizer) == 0
    for _ in range(3):
        model.weight.sum().backward()
        optimizer.step()
    assert optimizer_steps(optimizer) == 3

    class Wrapper:  # accelerate's AcceleratedOptimizer (and DeepSpeed's) keep the torch one as .optimizer
        def __init__(self, inner):
            self.optimizer = inner

    assert optimizer_steps(Wrapper(Wrapper(optimizer))) == 3


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("policy")
    model = tiny_model(root / "model")
    return root, model, write_dataset(root / "data", model, num_groups=4)


def test_cli_refuses_bf16_weights_with_a_too_small_lr(small_run, tmp_path):
    root, model, data = small_run
    run = tmp_path / "run"
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = cli_exit_code("train", "--data", data, "--model", model, "--algorithm", "grpo", "--out", str(run),
                             "--lr", "1e-6", "--set", "model_dtype=bfloat16", "--set", "progress=false")
    message = err.getvalue()
    assert code == 2 and message.startswith("error: model_dtype bfloat16 cannot represent updates of lr 1e-06")
    assert "mixed_precision: bf16" in message and len(message.strip().splitlines()) == 1
    assert not run.exists()


def test_one_process_summary_says_what_ran(small_run, tmp_path):
    root, model, data = small_run
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        summary = train(config(tmp_path, model, data, max_steps=2, micro_batch_tokens=32))
    finally:
        torch.set_num_threads(threads)
    assert summary["distributed"] == "NO" and "fsdp_version" not in summary and "zero_stage" not in summary
    assert summary["optimizer_steps"] == summary["steps"] == 2
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["optimizer_steps"] == 2
