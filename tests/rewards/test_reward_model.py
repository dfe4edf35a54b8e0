"""`offline-rec reward --reward-model`: scores equal a direct forward pass of the text the module docstring
says is scored (ChatML template, meta messages, no template), invariant to batching and row order, a run
interrupted after a shard resumed to the same output with every row scored once, z-score normalization by
hand, a classifier label's log-prob, and the bad-input matrix (one line, exit 2)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from support.cli_support import VLLM_IN_A_CHILD, run_cli, run_cli_process
from support.datagen import tree_digest, write_dataset

from offline_rec import schema as S
from offline_rec.dataset.format import make_row, open_dataset
from offline_rec.errors import UserError
from offline_rec.models.tiny import (
    build_bpe_tokenizer,
    build_chat_tokenizer,
    build_tiny_model,
    build_tiny_reward_model,
    chat_messages,
    save_tiny,
)
from offline_rec.rewards import reward_model as rm
from offline_rec.rewards.sequence_classifier import load_reward_model

PROMPTS = ["Zoë paid 12 € for 3 crêpes; how much is one?", "小明有 5 个苹果, 吃了 2 个. 还剩几个?",
           "What is 7 + 8? 🙂", "Ünïcödé: naïve façade, 42 km."]
COMPLETIONS = ["4 €", "还剩 3 个", "15", "ok", " it is 15!", "", "Zoë: 4"]


def logged_groups(with_messages: bool = False) -> list[list[dict]]:
    """Four groups of 1-3 unrewarded logged answers (non-ASCII text); group 1's meta holds chat messages."""
    groups = []
    conversations = chat_messages(2, seed=3)
    for g, prompt in enumerate(PROMPTS):
        meta = {"answer": str(g)}
        if with_messages and g == 1:
            meta["messages"] = conversations[0]
        rows = []
        for i in range(1 + g % 3):
            completion = COMPLETIONS[(g * 2 + i) % len(COMPLETIONS)]
            rows.append(make_row(group_id=f"q{g}", sample_index=i, prompt=prompt, prompt_ids=[4, 5, 6],
                                 completion=completion, completion_ids=[7] * 3, behavior_logprobs=[-0.5] * 3,
                                 behavior="prod", meta=meta))
        groups.append(rows)
    return groups


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A Qwen2 (GQA) reward model with the ChatML template, a Llama one without a chat template, a 3-label
    classifier, and a causal LM (not a reward model)."""
    root = tmp_path_factory.mktemp("reward-models")
    chat = build_chat_tokenizer()
    plain = build_bpe_tokenizer(PROMPTS * 20 + COMPLETIONS * 20, vocab_size=400)
    plain.chat_template = None
    return {
        "chat": save_tiny(build_tiny_reward_model(chat, arch="qwen2", num_heads=2, num_kv_heads=1, seed=1),
                          chat, root / "chat"),
        "plain": save_tiny(build_tiny_reward_model(plain, arch="llama", seed=2), plain, root / "plain"),
        "labels": save_tiny(build_tiny_reward_model(chat, arch="llama", labels=("bad", "ok", "good"), seed=3),
                            chat, root / "labels"),
        "causal": save_tiny(build_tiny_model(chat, arch="qwen2"), chat, root / "causal"),
    }


@pytest.fixture
def logged(tmp_path):
    return write_dataset(tmp_path / "logged", logged_groups(with_messages=True), groups_per_shard=1,
                         task={"name": "traffic", "reward_function": None})


def rewards_of(path) -> dict:
    return {(r[S.GROUP_ID], r[S.SAMPLE_INDEX]): r[S.REWARD] for r in open_dataset(path).to_table().to_pylist()}


def direct_forward(model_dir: str, sequences: list[list[int]], label_index: int | None = None) -> list[float]:
    """The score of an unbatched forward pass of the reward model over each token id sequence."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    scores = []
    for ids in sequences:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0]
        scores.append(float(logits[0] if label_index is None else torch.log_softmax(logits, -1)[label_index]))
    return scores


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """A conversation rendered with the chat template, tokenized without adding special tokens."""
    return tokenizer(tokenizer.apply_chat_template(messages, tokenize=False), add_special_tokens=False)["input_ids"]


def direct_scores(model_dir: str, groups, label_index: int | None = None) -> dict:
    """Each row's score from an unbatched forward of the text built here by hand from the docstring's rule."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = [r for g in groups for r in g]
    sequences = []
    for row in rows:
        if tokenizer.chat_template:
            meta = json.loads(row[S.META])
            turns = meta.get("messages") or [{"role": "user", "content": row[S.PROMPT]}]
            sequences.append(chat_ids(tokenizer, [*turns, {"role": "assistant", "content": row[S.COMPLETION]}]))
        else:
            sequences.append(tokenizer(row[S.PROMPT] + row[S.COMPLETION])["input_ids"])
    scores = direct_forward(model_dir, sequences, label_index)
    return {(row[S.GROUP_ID], row[S.SAMPLE_INDEX]): score for row, score in zip(rows, scores)}


@pytest.mark.parametrize("kind", ["chat", "plain"])
def test_scores_equal_a_direct_forward(models, logged, tmp_path, capsys, kind):
    before = tree_digest(logged)
    code, out, _ = run_cli(capsys, "reward", logged, "--reward-model", models[kind], "--out", tmp_path / "scored",
                           "--quiet")
    assert code == 0 and "rewarded 7/7 rows in 4 groups" in out
    assert tree_digest(logged) == before
    got, want = rewards_of(tmp_path / "scored"), direct_scores(models[kind], logged_groups(with_messages=True))
    assert got.keys() == want.keys()
    assert all(abs(got[k] - want[k]) < 1e-5 for k in want), (got, want)
    assert len(set(want.values())) >= 5  # the texts differ, so do the scores
    # The meta messages matter for the chat model: the same row scored from its prompt alone differs.
    if kind == "chat":
        bare = direct_scores(models[kind], logged_groups(with_messages=False))
        assert abs(bare[("q1", 0)] - want[("q1", 0)]) > 1e-4 and bare[("q0", 0)] == want[("q0", 0)]
    manifest = open_dataset(tmp_path / "scored").manifest
    block = manifest[S.M_TASK]["reward_model"]
    assert block["model"] == models[kind] and block["normalize"] == "none" and block["label"] is None
    assert manifest[S.M_TASK]["previous"]["name"] == "traffic"
    assert not rm.scores_dir(tmp_path / "scored").exists()  # the scores of a finished run are removed


def test_batch_and_order_invariant(models, tmp_path):
    groups = logged_groups(with_messages=True)
    forward = write_dataset(tmp_path / "fwd", groups, groups_per_shard=3)
    backward = write_dataset(tmp_path / "bwd", groups[::-1], groups_per_shard=1)
    scorer = load_reward_model(models["chat"])
    one_by_one = rm.score_with_reward_model(forward, tmp_path / "a", models["chat"], max_batch_tokens=1,
                                            progress=False, scorer=scorer)
    rm.score_with_reward_model(backward, tmp_path / "b", models["chat"], max_batch_tokens=100000, progress=False,
                               scorer=scorer)
    a, b = rewards_of(tmp_path / "a"), rewards_of(tmp_path / "b")
    assert one_by_one["rewarded"] == 7 and a.keys() == b.keys()
    assert all(abs(a[k] - b[k]) < 1e-5 for k in a)


class Killed(BaseException):
    """Stands for kill -9: nothing after it runs (no except/finally of the library catches a BaseException)."""


def test_resume_scores_every_row_once(models, logged, tmp_path, monkeypatch):
    scorer = load_reward_model(models["chat"])
    scored_rows = []
    real_score = scorer.score

    def counting(seqs, max_batch_tokens=16384):
        scored_rows.append(len(seqs))
        return real_score(seqs, max_batch_tokens)

    monkeypatch.setattr(scorer, "score", counting)
    real_shard = rm._score_shard
    calls = []

    def dies_on_third_shard(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise Killed
        return real_shard(*args, **kwargs)

    monkeypatch.setattr(rm, "_score_shard", dies_on_third_shard)
    with pytest.raises(Killed):
        rm.score_with_reward_model(logged, tmp_path / "scored", models["chat"], progress=False, scorer=scorer)
    folder = rm.scores_dir(tmp_path / "scored")
    assert sorted(p.name for p in folder.glob("scores-*")) == ["scores-00000.parquet", "scores-00001.parquet"]
    assert not (tmp_path / "scored").exists()
    (folder / ".scores-00002.parquet.tmp").write_bytes(b"torn write")  # what a kill mid-write leaves
    monkeypatch.setattr(rm, "_score_shard", real_shard)
    summary = rm.score_with_reward_model(logged, tmp_path / "scored", models["chat"], progress=False, scorer=scorer)
    # shards hold groups q0 (1 row), q1 (2), q2 (3), q3 (1): the first two were done before the kill
    assert (summary["resumed"], summary["scored_now"]) == (3, 4)
    assert sum(scored_rows) == 7  # every row scored once over the two runs
    rm.score_with_reward_model(logged, tmp_path / "whole", models["chat"], progress=False, scorer=scorer)
    assert rewards_of(tmp_path / "scored") == rewards_of(tmp_path / "whole")
    assert not folder.exists()


def test_zscore_by_hand(models, logged, tmp_path, capsys):
    assert run_cli(capsys, "reward", logged, "--reward-model", models["plain"], "--out", tmp_path / "raw", "-q")[0] == 0
    assert run_cli(capsys, "reward", logged, "--reward-model", models["plain"], "--out", tmp_path / "z", "-q",
                   "--normalize", "zscore")[0] == 0
    raw, z = rewards_of(tmp_path / "raw"), rewards_of(tmp_path / "z")
    values = list(raw.values())
    mean = sum(values) / len(values)
    std = (sum((v - mean) ** 2 for v in values) / len(values)) ** 0.5
    assert all(abs(z[k] - (raw[k] - mean) / std) < 1e-4 for k in raw)
    block = open_dataset(tmp_path / "z").manifest[S.M_TASK]["reward_model"]
    assert block["normalize"] == "zscore" and abs(block["mean"] - mean) < 1e-5 and abs(block["std"] - std) < 1e-5


def test_classifier_label_log_prob(models, logged, tmp_path, capsys):
    code, _, _ = run_cli(capsys, "reward", logged, "--reward-model", models["labels"], "--reward-label", "good",
                         "--out", tmp_path / "scored", "-q")
    assert code == 0
    got = rewards_of(tmp_path / "scored")
    want = direct_scores(models["labels"], logged_groups(with_messages=True), label_index=2)
    assert all(abs(got[k] - want[k]) < 1e-5 and got[k] < 0 for k in want)


@pytest.mark.parametrize("args, message", [
    (["--reward-model", "{tmp}/nowhere"], "does not exist"),
    (["--reward-model", "{causal}"], "is not a sequence-classification model"),
    (["--reward-model", "{labels}"], "choose the one to score with --reward-label"),
    (["--reward-model", "{labels}", "--reward-label", "great"], "has no label 'great'"),
    (["--reward-model", "{chat}", "--reward-label", "good"], "has no label 'good'"),
    (["--reward-model", "{chat}", "--normalize", "minmax"], "unknown normalization 'minmax'"),
    (["--reward-model", "{chat}", "--backend", "onnx"], "unknown reward backend 'onnx'"),
    (["--reward-model", "{chat}", "--task", "arith"], "exactly one of --task, --reward-model or --judge"),
    (["--reward-model", "{chat}", "--data-parallel-size", "0"], "--data-parallel-size must be >= 1"),
    ([], "exactly one of --task, --reward-model or --judge"),
])
def test_bad_input_one_line_exit_2(models, logged, tmp_path, capsys, args, message):
    args = [a.format(tmp=tmp_path, **models) for a in args]
    code, out, err = run_cli(capsys, "reward", logged, *args, "--out", tmp_path / "scored", "-q")
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "scored").exists()


def test_a_loaded_scorer_is_not_spread_over_workers(models, logged, tmp_path):
    scorer = load_reward_model(models["chat"])
    for spread in ({"data_parallel_size": 2}, {"ray_address": "auto"}):
        with pytest.raises(UserError, match="a loaded reward model is one scorer"):
            rm.score_with_reward_model(logged, tmp_path / "scored", models["chat"], progress=False, scorer=scorer,
                                       **spread)
    assert not (tmp_path / "scored").exists() and not rm.scores_dir(tmp_path / "scored").exists()


def test_unfinished_scores_of_another_model_refused(models, logged, tmp_path, capsys):
    folder = rm.scores_dir(tmp_path / "scored")
    folder.mkdir()
    (folder / "run.json").write_text(json.dumps({"model": "another"}))
    code, _, err = run_cli(capsys, "reward", logged, "--reward-model", models["chat"], "--out", tmp_path / "scored")
    assert code == 2 and "unfinished run with other inputs or model settings" in err


def test_episode_kept_messages_score_the_whole_conversation(tmp_path, capsys):
    """`import --keep-messages` of two-call tool episodes: the episode row scores as a direct forward over the
    whole conversation (every turn and the final answer) under the reward model's template; each row of
    --split-episodes scores its own call's messages plus its reply; without --keep-messages nothing changes."""
    from support.chat_logs import logged_episode
    from transformers import AutoTokenizer

    # a Qwen2 (GQA) reward model with the ChatML template and room for whole conversations (300-600 tokens)
    model = save_tiny(build_tiny_reward_model(build_chat_tokenizer(), arch="qwen2", num_heads=2, num_kv_heads=1,
                                              max_position_embeddings=1024, seed=4), build_chat_tokenizer(),
                      tmp_path / "rm")
    tokenizer = AutoTokenizer.from_pretrained(model)
    eos = tokenizer.eos_token_id
    replies = [tokenizer(text)["input_ids"] + [eos] for text in (" José pays 9,50 €", " 小明有五个苹果 🍎", " tacos")]
    lines = [logged_episode(tokenizer, replies[0], replies[1], "e1"),
             logged_episode(tokenizer, replies[2], replies[0], "e2", seed=1)]
    src = tmp_path / "episodes.jsonl"
    src.write_text("".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines), encoding="utf-8")
    imports = {"kept": (["--keep-messages"], 2), "plain": ([], 2),
               "split": (["--keep-messages", "--split-episodes"], 4)}  # name: flags, rows
    for name, (flags, count) in imports.items():
        code, _, err = run_cli(capsys, "import", src, "--format", "openai", "--tokenizer", model, *flags,
                               "--out", tmp_path / name)
        assert code == 0, err
        code, out, err = run_cli(capsys, "reward", tmp_path / name, "--reward-model", model, "--out",
                                 tmp_path / f"{name}-scored", "-q")
        assert code == 0 and f"rewarded {count}/{count} rows" in out, err  # none too long

    def rows(name):
        return {r[S.GROUP_ID] + str(json.loads(r[S.META]).get("episode_call", "")): r
                for r in open_dataset(tmp_path / name).to_table().to_pylist()}

    whole = [[*line["calls"][-1]["request"]["messages"],
              {"role": "assistant", "content": line["calls"][-1]["response"]["choices"][0]["message"]["content"]}]
             for line in lines]
    assert [m["role"] for m in whole[0]] == ["system", "user", "assistant", "tool", "assistant"]
    kept, scored = rows("kept"), rows("kept-scored")
    assert [json.loads(kept[g][S.META]) for g in ("e1", "e2")] == [
        {"episode_id": g, S.META_MESSAGES: messages, S.META_MESSAGES_INCLUDE_COMPLETION: True}
        for g, messages in zip(("e1", "e2"), whole)]
    want = direct_forward(model, [chat_ids(tokenizer, messages) for messages in whole])
    assert all(abs(scored[g][S.REWARD] - w) < 1e-5 for g, w in zip(("e1", "e2"), want)), (scored, want)

    # without --keep-messages: the meta and the rule of before (the first prompt as the user's turn, the
    # decoded episode tail as the assistant's), which scores differently
    plain = rows("plain")
    assert {g: json.loads(r[S.META]) for g, r in plain.items()} == {"e1": {"episode_id": "e1"},
                                                                    "e2": {"episode_id": "e2"}}
    assert [plain[g][S.COMPLETION_IDS] for g in plain] == [kept[g][S.COMPLETION_IDS] for g in plain]
    before = direct_scores(model, [[r] for r in plain.values()])
    assert all(abs(rows("plain-scored")[g][S.REWARD] - before[g, 0]) < 1e-5 for g in plain)
    assert all(abs(before[g, 0] - w) > 1e-4 for g, w in zip(("e1", "e2"), want))

    # --split-episodes: each call's row keeps its own request messages; its reply is appended
    split, split_scored = rows("split"), rows("split-scored")
    for g, line in zip(("e1", "e2"), lines):
        for number, call in enumerate(line["calls"], start=1):
            meta = json.loads(split[f"{g}{number}"][S.META])
            assert meta[S.META_MESSAGES] == call["request"]["messages"]
            assert S.META_MESSAGES_INCLUDE_COMPLETION not in meta
    by_hand = direct_scores(model, [[r] for r in split.values()])
    assert all(abs(split_scored[k][S.REWARD] - by_hand[r[S.GROUP_ID], r[S.SAMPLE_INDEX]]) < 1e-5
               for k, r in split.items())
    assert abs(split_scored["e12"][S.REWARD] - want[0]) < 1e-5  # call 2's messages + reply 2: the whole one


def test_conversation_rule():
    """The messages a chat reward model scores, by the module docstring's rule: request messages + the
    completion; a whole conversation as it is; a tool call's null content kept; anything else: the prompt."""
    call = [{"role": "user", "content": "Zoë?"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                                                                    "function": {"name": "calc", "arguments": "{}"}}]},
            {"role": "tool", "content": "42 €", "tool_call_id": "c1"}]
    answer = {"role": "assistant", "content": "答案 42"}
    meta = {S.META_MESSAGES: call}
    assert rm.conversation("p", "答案 42", json.dumps(meta)) == [*call, answer]
    whole = {S.META_MESSAGES: [*call, answer], S.META_MESSAGES_INCLUDE_COMPLETION: True}
    assert rm.conversation("p", "tail with <|im_end|> tokens", json.dumps(whole)) == [*call, answer]
    fallback = [{"role": "user", "content": "p"}, {"role": "assistant", "content": "c"}]
    not_messages = ([{"role": "assistant", "content": None}], [{"content": "x"}], [], "text",
                    [{"role": "user", "content": 3}])
    for bad in not_messages:
        assert rm.conversation("p", "c", json.dumps({S.META_MESSAGES: bad})) == fallback, bad
    assert rm.conversation("p", "c", "not json") == fallback


@pytest.mark.faults
def test_kill_9_mid_run_then_rerun_equals_an_uninterrupted_run(tmp_path, capsys):
    """A real kill -9 of `offline-rec reward --reward-model` once two shards' scores are committed; the rerun
    scores only the rest, and its output equals an uninterrupted run's."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from support.paths import REPO

    tokenizer = build_chat_tokenizer()
    model_dir = save_tiny(build_tiny_reward_model(tokenizer, arch="qwen2", hidden_size=256, num_layers=4,
                                                  num_heads=8, num_kv_heads=2, max_position_embeddings=2048),
                          tokenizer, tmp_path / "rm")
    conversations = chat_messages(60, seed=9)  # 100-500 tokens each: ~40 ms a shard on a busy CPU
    groups = [[make_row(group_id=f"c{i}", sample_index=k, prompt=messages[1]["content"], prompt_ids=[4],
                        completion=f"答案: {i + k} € ✓", completion_ids=[5], behavior_logprobs=[-1.0])
               for k in range(3)] for i, messages in enumerate(conversations)]
    logged = write_dataset(tmp_path / "logged", groups, groups_per_shard=1)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    for trial in range(3):
        out = tmp_path / f"scored-{trial}"
        folder = rm.scores_dir(out)
        process = subprocess.Popen([sys.executable, "-m", "offline_rec", "reward", str(logged), "--reward-model",
                                    model_dir, "--out", str(out), "-q"], env=env, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL)
        while process.poll() is None and len(list(folder.glob("scores-*.parquet"))) < 2:
            time.sleep(0.005)
        process.send_signal(signal.SIGKILL)
        process.wait()
        if not out.exists():
            break
    assert not out.exists(), "the run always finished before it could be killed"
    done = len(list(folder.glob("scores-*.parquet")))
    assert 2 <= done < 60
    code, stdout, _ = run_cli(capsys, "reward", logged, "--reward-model", model_dir, "--out", out, "-q")
    assert code == 0
    assert f"scored now {3 * (60 - done)}, resumed {3 * done}" in stdout
    assert run_cli(capsys, "reward", logged, "--reward-model", model_dir, "--out", tmp_path / "whole", "-q")[0] == 0
    assert rewards_of(out) == rewards_of(tmp_path / "whole")


@pytest.mark.vllm
@pytest.mark.parametrize("kind, extra", [("chat", []), ("labels", ["--reward-label", "good"])])
def test_vllm_pooling_backend_equals_transformers(models, logged, tmp_path, capsys, kind, extra):
    from support.vllm_server import require_vllm

    from offline_rec.rollout.backends import vllm_import_error

    reason = vllm_import_error()
    if reason is not None:
        require_vllm(reason)
    # vLLM's pooling engine in a process of its own: the session keeps one vLLM engine in this one
    arguments = ("reward", logged, "--reward-model", models[kind], *extra, "--out")
    code, _, err = run_cli(capsys, *arguments, tmp_path / "hf", "--backend", "hf", "-q")
    assert code == 0, err
    code, _, err = run_cli_process(*arguments, tmp_path / "vllm", "--backend", "vllm", "-q", env=VLLM_IN_A_CHILD)
    assert code == 0, err[-3000:]
    hf, vllm = rewards_of(tmp_path / "hf"), rewards_of(tmp_path / "vllm")
    assert hf.keys() == vllm.keys() and all(abs(hf[k] - vllm[k]) < 1e-5 for k in hf), (hf, vllm)
    assert open_dataset(tmp_path / "vllm").manifest[S.M_TASK]["reward_model"]["engine"] == "vllm"


def test_two_data_parallel_workers_equal_one_process(models, logged, tmp_path, capsys):
    code, out, err = run_cli(capsys, "reward", logged, "--reward-model", models["chat"], "--data-parallel-size", 2,
                             "--out", tmp_path / "two", "-q")
    assert code == 0, err
    assert "scored now 7, resumed 0" in out
    assert run_cli(capsys, "reward", logged, "--reward-model", models["chat"], "--out", tmp_path / "one", "-q")[0] == 0
    one, two = rewards_of(tmp_path / "one"), rewards_of(tmp_path / "two")
    assert one.keys() == two.keys() and all(abs(one[k] - two[k]) < 1e-6 for k in one)


def test_a_failing_worker_is_one_line_and_keeps_the_committed_scores(models, logged, tmp_path, capsys):
    """Weights that only a worker reads (the coordinator reads the config alone) are damaged: the run stops with
    one line naming the worker and the scores folder; the shards scored before are kept for the rerun."""
    import shutil

    damaged = tmp_path / "damaged"
    shutil.copytree(models["chat"], damaged)
    (damaged / "model.safetensors").write_bytes(b"not weights")
    folder = rm.scores_dir(tmp_path / "scored")
    code, out, err = run_cli(capsys, "reward", logged, "--reward-model", damaged, "--data-parallel-size", 2,
                             "--out", tmp_path / "scored", "-q")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert "reward worker" in err and f"the scores committed so far are kept in {folder}" in err, err
    assert not (tmp_path / "scored").exists() and (folder / "run.json").exists()


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_ray_actors_equal_one_process_and_resume(models, logged, tmp_path, monkeypatch, capsys):
    """Two Ray actors on a local Ray score what one process scores (`reward --ray-address`); a run that died after
    a shard resumes on Ray; a Ray connection the caller opened stays open."""
    ray = pytest.importorskip("ray")
    from support.paths import REPO

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    one = rm.score_with_reward_model(logged, tmp_path / "one", models["chat"], progress=False)
    real_shard, calls = rm._score_shard, []

    def dies_on_second_shard(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise Killed
        return real_shard(*args, **kwargs)

    monkeypatch.setattr(rm, "_score_shard", dies_on_second_shard)
    with pytest.raises(Killed):  # a local run that dies after committing shard 0; Ray finishes it below
        rm.score_with_reward_model(logged, tmp_path / "resumed", models["chat"], progress=False)
    monkeypatch.setattr(rm, "_score_shard", real_shard)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        code, out, _ = run_cli(capsys, "reward", logged, "--reward-model", models["chat"], "--out", tmp_path / "ray",
                               "--data-parallel-size", 2, "--ray-address", "auto", "--json", "-q")
        assert code == 0
        fresh = json.loads(out)
        resumed = rm.score_with_reward_model(logged, tmp_path / "resumed", models["chat"], progress=False,
                                             data_parallel_size=2, ray_address="auto")
        assert ray.is_initialized()  # a connection the caller opened is left open
    finally:
        ray.shutdown()
    assert (fresh["scored_now"], fresh["resumed"]) == (7, 0) and (resumed["scored_now"], resumed["resumed"]) == (6, 1)
    want = rewards_of(tmp_path / "one")
    assert one["rewarded"] == 7 and len(set(want.values())) >= 5
    for name in ("ray", "resumed"):
        got = rewards_of(tmp_path / name)
        assert got.keys() == want.keys() and all(abs(got[k] - want[k]) < 1e-5 for k in want), (name, got, want)
    assert open_dataset(tmp_path / "ray").manifest[S.M_SOURCE]["ray"] is True
