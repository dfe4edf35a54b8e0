"""Groups for prompts answered once: `collect --prompts-from` (fresh answers from the logged prompt_ids, under the
logged group ids), `merge --join-groups` (logged + fresh rows in one group, each with its own behavior and
log-probs), `reward --reward-model` over the joined groups and `train` on them, end to end through the CLI on a
ChatML byte-level BPE chat model; and the loss of a mixed group against a value worked out by hand."""

from __future__ import annotations

import json
import math

import pytest
import torch
from support.cli_support import run_cli
from support.losses import loss_and_metrics
from support.sampling_support import raw_logprobs
from support.traffic_support import BEHAVIOR, write_logged

from offline_rec import schema as S
from offline_rec.dataset.format import DatasetWriter, make_row, open_dataset
from offline_rec.dataset.merge import join_groups
from offline_rec.dataset.validate import validate_dataset
from offline_rec.loss.advantages import group_advantages
from offline_rec.loss.presets import get_objective
from offline_rec.models.loading import load_model, load_tokenizer
from offline_rec.models.tiny import (
    build_chat_tokenizer,
    build_tiny_reward_model,
    make_chat_checkpoint,
    save_tiny,
)


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> str:
    return make_chat_checkpoint(tmp_path_factory.mktemp("chat") / "model")


def test_collect_join_reward_train_end_to_end(chat_model, tmp_path, capsys):
    logged = write_logged(tmp_path / "logged", chat_model)
    tokenizer = load_tokenizer(chat_model)
    fresh = tmp_path / "fresh"
    code, _, err = run_cli(capsys, "collect", "--model", chat_model, "--prompts-from", logged, "--task", "arith",
                           "-k", 3, "--max-new-tokens", 8, "--backend", "hf", "--batch-size", 2, "--out", fresh, "-q")
    assert code == 0, err
    logged_groups = {g[0][S.GROUP_ID]: g for g in open_dataset(logged).iter_groups()}
    fresh_groups = {g[0][S.GROUP_ID]: g for g in open_dataset(fresh).iter_groups()}
    assert fresh_groups.keys() == logged_groups.keys()
    model = load_model(chat_model)
    for gid, rows in fresh_groups.items():
        logged_row = logged_groups[gid][0]
        assert [r[S.SAMPLE_INDEX] for r in rows] == [0, 1, 2]
        for row in rows:
            # the logged ids as they are: group 0's differ from a re-tokenization of the same text
            assert row[S.PROMPT_IDS] == logged_row[S.PROMPT_IDS] and row[S.PROMPT] == logged_row[S.PROMPT]
            assert json.loads(row[S.META]) == json.loads(logged_row[S.META])
            assert row[S.REWARD] in (0.0, 1.0) and row[S.BEHAVIOR] == chat_model
            want = raw_logprobs(model, row[S.PROMPT_IDS], row[S.COMPLETION_IDS])
            assert (want - torch.tensor(row[S.BEHAVIOR_LOGPROBS])).abs().max().item() < 1e-4
    assert logged_groups["chatcmpl-0"][0][S.PROMPT_IDS] != tokenizer(logged_groups["chatcmpl-0"][0][S.PROMPT])[
        "input_ids"]
    assert open_dataset(fresh).task["prompts"] == f"dataset:{logged}"

    joined = tmp_path / "joined"
    code, out, _ = run_cli(capsys, "merge", "--join-groups", logged, fresh, "--out", joined)
    assert code == 0 and "joined 3 of 3 groups: 4 logged + 9 fresh rows" in out
    assert validate_dataset(joined).ok
    dataset = open_dataset(joined)
    assert [b["model"] for b in dataset.behavior["behaviors"]] == [BEHAVIOR, chat_model]
    for group in dataset.iter_groups():
        gid = group[0][S.GROUP_ID]
        own = logged_groups[gid]
        assert [r[S.SAMPLE_INDEX] for r in group] == list(range(len(own) + 3))
        assert group[:len(own)] == own  # the logged rows unchanged, logged log-probs and all
        assert [{k: v for k, v in r.items() if k != S.SAMPLE_INDEX} for r in group[len(own):]] == \
            [{k: v for k, v in r.items() if k != S.SAMPLE_INDEX} for r in fresh_groups[gid]]

    # one reward for every row of a group, logged or fresh: a reward model's (meta messages under its template)
    reward_tokenizer = build_chat_tokenizer()
    reward_model = build_tiny_reward_model(reward_tokenizer, arch="qwen2", num_heads=2, num_kv_heads=1,
                                           max_position_embeddings=1024)
    reward_dir = save_tiny(reward_model, reward_tokenizer, tmp_path / "rm")
    code, out, _ = run_cli(capsys, "reward", joined, "--reward-model", reward_dir, "--normalize", "zscore",
                           "--out", tmp_path / "rewarded", "-q")
    assert code == 0 and "rewarded 13/13 rows" in out
    code, _, err = run_cli(capsys, "train", "--data", tmp_path / "rewarded", "--model", chat_model, "--algorithm",
                           "rec-oneside-is", "--out", tmp_path / "run", "--set", "max_steps=2", "--set",
                           "prompts_per_step=2", "--set", "progress=false", "--set", "report_to=[]", "--set",
                           "save_every=0", "--set", "cpu=true")
    assert code == 0, err
    assert (tmp_path / "run" / "final" / "config.json").is_file()


def test_join_refuses_fresh_answers_to_other_prompts(chat_model, tmp_path, capsys):
    logged = write_logged(tmp_path / "logged", chat_model, num_groups=2)
    other = tmp_path / "other"
    tokenizer = load_tokenizer(chat_model)
    writer = DatasetWriter(other, behavior=open_dataset(logged).behavior, task={"name": "arith"})
    writer.add_group([make_row(group_id="chatcmpl-0", sample_index=0, prompt="x",
                               prompt_ids=tokenizer("x")["input_ids"], completion="y", completion_ids=[5],
                               behavior_logprobs=[-1.0])])
    writer.close()
    code, _, err = run_cli(capsys, "merge", "--join-groups", logged, other, "--out", tmp_path / "joined")
    assert code == 2 and "answers another prompt" in err and not (tmp_path / "joined").exists()
    code, _, err = run_cli(capsys, "merge", "--join-groups", logged, "--out", tmp_path / "joined")
    assert code == 2 and "takes two datasets" in err
    code, _, err = run_cli(capsys, "collect", "--model", chat_model, "--prompts-from", logged, "--prompts", "p.jsonl",
                           "--task", "arith", "--out", tmp_path / "f")
    assert code == 2 and "--prompts or --prompts-from" in err


def test_loss_of_a_mixed_group_by_hand(tmp_path):
    """One logged answer (2 tokens, reward 1) joined with two fresh ones (1 and 2 tokens, reward 0); the loss
    of rec-oneside-is (one-side clip, W = rho, token mean) from each row's own behavior log-probs.

    A = r - mean = [2/3, -1/3, -1/3]. Policy log-probs chosen: logged [-1.1, -1.5] against blogp [-1.0, -2.0]:
    rho = [e^-0.1, e^0.5]; A > 0 keeps rho <= 1.2: token 1 only. Fresh 1: [-0.5] against [-0.5]: rho 1, kept.
    Fresh 2: [-0.9, -0.7] against [-0.3, -0.7]: rho = [e^-0.6 = 0.549, 1]; A < 0 keeps rho >= 0.8: token 2.
    loss = sum(-M * rho * A * logp) / 5 tokens
         = (-(e^-0.1)(2/3)(-1.1) - (1)(-1/3)(-0.5) - (1)(-1/3)(-0.7)) / 5
         = (0.7333 e^-0.1 - 0.4) / 5 = 0.0527094...
    """
    ids = [5, 6, 7]
    logged = DatasetWriter(tmp_path / "logged", behavior=S.behavior_provenance(model="prod"), task={})
    logged.add_group([make_row(group_id="g", sample_index=0, prompt="p", prompt_ids=ids, completion="ab",
                               completion_ids=[8, 9], behavior_logprobs=[-1.0, -2.0], reward=1.0, behavior="prod")])
    logged.close()
    fresh = DatasetWriter(tmp_path / "fresh", behavior=S.behavior_provenance(model="policy"), task={})
    fresh.add_group([
        make_row(group_id="g", sample_index=0, prompt="p", prompt_ids=ids, completion="c", completion_ids=[10],
                 behavior_logprobs=[-0.5], reward=0.0, behavior="policy"),
        make_row(group_id="g", sample_index=1, prompt="p", prompt_ids=ids, completion="de", completion_ids=[11, 12],
                 behavior_logprobs=[-0.3, -0.7], reward=0.0, behavior="policy"),
    ])
    fresh.close()
    join_groups(tmp_path / "logged", tmp_path / "fresh", tmp_path / "joined")
    rows = open_dataset(tmp_path / "joined").to_table().to_pylist()
    assert [r[S.BEHAVIOR] for r in rows] == ["prod", "policy", "policy"]
    spec = get_objective("rec-oneside-is")
    advantages, _ = group_advantages(spec, torch.tensor([r[S.REWARD] for r in rows]), [r[S.GROUP_ID] for r in rows])
    width = 2
    blogp = torch.tensor([r[S.BEHAVIOR_LOGPROBS] + [0.0] * (width - len(r[S.BEHAVIOR_LOGPROBS])) for r in rows])
    mask = torch.tensor([[1] * len(r[S.COMPLETION_IDS]) + [0] * (width - len(r[S.COMPLETION_IDS])) for r in rows])
    logp = torch.tensor([[-1.1, -1.5], [-0.5, 0.0], [-0.9, -0.7]], dtype=torch.float64)
    loss, _ = loss_and_metrics(spec, logp, blogp.double(), advantages.double(), mask)
    expected = ((2 / 3) * 1.1 * math.exp(-0.1) - 0.5 / 3 - 0.7 / 3) / 5
    assert abs(loss.item() - expected) < 1e-6 and abs(expected - 0.0527094) < 1e-6


@pytest.mark.vllm
def test_prompts_from_with_the_vllm_backend(tmp_path, capsys, vllm_tiny_model, the_session_engine):
    """vLLM samples from the logged prompt ids as they are (group 0's are not the tokenizer's own encoding), and
    logs the log-probs of what it sampled (temperature 1: the model's, equal to a transformers forward)."""
    logged = write_logged(tmp_path / "logged", vllm_tiny_model)
    code, _, err = run_cli(capsys, "collect", "--model", vllm_tiny_model, "--prompts-from", logged, "--task", "arith",
                           "-k", 2, "--max-new-tokens", 8, "--backend", "vllm", "--out", tmp_path / "fresh", "-q")
    assert code == 0, err
    logged_ids = {g[0][S.GROUP_ID]: g[0][S.PROMPT_IDS] for g in open_dataset(logged).iter_groups()}
    model = load_model(vllm_tiny_model)
    rows = open_dataset(tmp_path / "fresh").to_table().to_pylist()
    assert len(rows) == 6 and {r[S.GROUP_ID] for r in rows} == logged_ids.keys()
    for row in rows:
        assert row[S.PROMPT_IDS] == logged_ids[row[S.GROUP_ID]]
        want = raw_logprobs(model, row[S.PROMPT_IDS], row[S.COMPLETION_IDS])
        assert (want - torch.tensor(row[S.BEHAVIOR_LOGPROBS])).abs().max().item() < 1e-4
