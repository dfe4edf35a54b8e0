"""`import --format openai` without a server: exact token ids from lossy token strings (byte-level BPE and
SentencePiece byte-fallback vocabularies), multi-turn tool episodes with loss masks, --split-episodes,
--rewards, and lines as `offline-rec record` writes them.

Lossy logs are made here the way vLLM 0.32 prints token strings (`vllm_strings`: a token that ends
inside a character prints "", the token that completes it prints the whole character, a token that
starts inside one prints U+FFFD for those bytes); tests/importers/test_import_server_logs.py checks the same
against a real server.
"""

from __future__ import annotations

import json

import pytest
import torch
from support.chat_logs import EPISODE_TOOL_RESULT, logged_call, logged_episode, vllm_strings
from support.cli_support import run_cli
from support.tokenizer_support import byte_fallback_sentencepiece
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from offline_rec import schema as S
from offline_rec.dataset.format import open_dataset
from offline_rec.dataset.inspect import describe_dataset
from offline_rec.dataset.validate import validate_dataset
from offline_rec.importers import ImportConfig, import_dataset
from offline_rec.importers.common import BadLinesError
from offline_rec.importers.tokens import (
    NotRecoverable,
    Vocabulary,
    candidate_splits,
    entry_evidence,
    reconstruct_ids,
)
from offline_rec.models.tiny import chat_messages, make_chat_checkpoint
from offline_rec.models.vocab import byte_level_alphabet, token_bytes

REPLACEMENT = "\ufffd"


@pytest.fixture(scope="module")
def chat(tmp_path_factory) -> str:
    return make_chat_checkpoint(tmp_path_factory.mktemp("chat") / "model")


@pytest.fixture(scope="module")
def tokenizer(chat):
    return AutoTokenizer.from_pretrained(chat)


def _evidence(strings):
    return [entry_evidence(s, list(s.encode())) for s in strings]


def test_vllm_style_lossy_strings_recover_the_sampled_ids(chat, tokenizer):
    """Completions the chat model samples (valid UTF-8 made of whole- and part-character tokens) come back
    exactly from vLLM's lossy strings and the text, for every one of them."""
    model = AutoModelForCausalLM.from_pretrained(chat)
    vocabulary = Vocabulary.of(tokenizer)
    prompt = tokenizer.apply_chat_template(chat_messages(1, seed=4)[0], add_generation_prompt=True,
                                           return_tensors="pt")["input_ids"]
    partial = 0
    for seed in range(12):
        torch.manual_seed(seed)
        with torch.no_grad():
            out = model.generate(prompt, do_sample=True, max_new_tokens=60, pad_token_id=0)
        ids = out[0, prompt.shape[1]:].tolist()
        text = tokenizer.decode(ids, skip_special_tokens=True)
        strings = vllm_strings(tokenizer, ids)
        if ids[-1] != tokenizer.eos_token_id and strings[-1] == "":
            continue  # cut inside a character at max_new_tokens: the text does not hold those bytes
        partial += strings.count("")
        assert reconstruct_ids(_evidence(strings), text, vocabulary) == ids, seed
    assert partial >= 10


@pytest.fixture(scope="module")
def overlapping():
    """A byte-level vocabulary where "中" (E4 B8 AD) splits as E4+B8+AD, E4B8+AD, E4+B8AD or whole."""
    byte_char = byte_level_alphabet()
    pieces = ["<|end|>"] + [byte_char[b] for b in range(256)]
    extra = [bytes([0xE4, 0xB8]), bytes([0xB8, 0xAD]), "中".encode(), b" x"]
    pieces += ["".join(byte_char[b] for b in data) for data in extra]
    tok = Tokenizer(models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|end|>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>")


def test_ambiguous_cut_and_contradicting_lines_are_refused_at_their_entry(overlapping):
    vocabulary = Vocabulary.of(overlapping)
    by_bytes = {data: i for i, data in enumerate(token_bytes(overlapping))}
    e4, b8, ad = by_bytes[b"\xe4"], by_bytes[b"\xb8"], by_bytes[b"\xad"]
    # three entries: only E4 + B8 + AD has three tokens
    assert reconstruct_ids(_evidence(["", "", "中"]), "中", vocabulary) == [e4, b8, ad]
    # two entries: E4B8 + AD and E4 + B8AD print alike ("", "中"): truly ambiguous, refused at entry 0
    with pytest.raises(NotRecoverable, match="ambiguous") as info:
        reconstruct_ids(_evidence(["", "中"]), "中", vocabulary)
    assert info.value.position == 0
    # OpenAI's `bytes` of a partial token are its own bytes: that settles it
    openai = [entry_evidence("bytes:\\xe4\\xb8", [0xE4, 0xB8]), entry_evidence("\\xad", [0xAD])]
    assert reconstruct_ids(openai, "中", vocabulary) == [by_bytes[b"\xe4\xb8"], ad]
    # a completion cut inside a character: the text has no bytes for the last token
    with pytest.raises(NotRecoverable, match="text ends before the tokens do") as info:
        reconstruct_ids(_evidence([" x", ""]), " x", vocabulary)
    assert info.value.position == 1
    # an entry that contradicts the text
    with pytest.raises(NotRecoverable, match="no vocabulary token fits") as info:
        reconstruct_ids(_evidence([" x", "y"]), " x中", vocabulary)
    assert info.value.position == 1
    # the special token at the end is left out of the text, as servers write it
    assert reconstruct_ids(_evidence(["", "", "中", "<|end|>"]), "中", vocabulary) == [e4, b8, ad, 0]


def test_sentencepiece_byte_fallback_tokens_recover_or_are_refused_as_ambiguous():
    sp = byte_fallback_sentencepiece()
    vocab = sp.get_vocab()
    vocabulary = Vocabulary.of(sp)
    text = "x 文a"  # 文 = E6 96 87, not in the vocabulary: three byte-fallback pieces
    ids = sp(text)["input_ids"]
    assert sp.convert_ids_to_tokens(ids) == ["x", "\u2581", "<0xE6>", "<0x96>", "<0x87>", "a"]
    strings = vllm_strings(sp, ids)
    assert strings == ["x", " ", "", "", "文", "a"]
    # "x" prints alike from the piece x and the byte piece <0x78> (a model samples either): not a guess
    sampled_byte = [vocab["<0x78>"], *ids[1:]]
    assert vllm_strings(sp, sampled_byte) == strings
    with pytest.raises(NotRecoverable, match="ambiguous") as info:
        reconstruct_ids(_evidence(strings), text, vocabulary)
    assert info.value.position == 0 and info.value.ambiguous
    both = candidate_splits(_evidence(strings), text, vocabulary)
    assert len(both) == 8 and ids in both and sampled_byte in both  # x, " " and a: two ways each
    # bytes with no piece of their own are decided by the entries
    assert reconstruct_ids(_evidence(["", "", "文"]), "文", vocabulary) == ids[2:5]


# --------------------------------------------------------------------------------------------
# episodes, built from the chat tokenizer the way vLLM logs them with return_token_ids (support/chat_logs.py)


def _write(path, lines) -> str:
    path.write_text("".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines), encoding="utf-8")
    return path


def _rows(path) -> list[dict]:
    assert validate_dataset(path).ok
    return open_dataset(path).to_table().to_pylist()


def test_episode_row_masks_exactly_the_sampled_tokens(chat, tokenizer, tmp_path):
    eos = tokenizer.eos_token_id
    reply_1 = tokenizer(" José pays 9,50 €")["input_ids"] + [eos]  # a reply the template renders back alike
    reply_2 = tokenizer(" 小明有五个苹果 🍎")["input_ids"] + [eos]
    lines = [logged_episode(tokenizer, reply_1, reply_2, "e1"),
             logged_episode(tokenizer, reply_1, reply_2, "e2", with_ids=False)]
    src = _write(tmp_path / "episodes.jsonl", lines)
    summary = import_dataset(ImportConfig(src, "openai", tmp_path / "ds", tokenizer=chat))
    assert (summary["rows"], summary["imported_lines"]) == (2, 2)
    with_ids, rendered = _rows(tmp_path / "ds")
    prompt_1 = lines[0]["calls"][0]["response"]["prompt_token_ids"]
    # what the chat template and the tool put between the replies, tokenized on its own
    between = "\n<|im_start|>tool\n" + EPISODE_TOOL_RESULT + "<|im_end|>\n<|im_start|>assistant\n"
    inserted = tokenizer(between)["input_ids"]
    assert with_ids[S.PROMPT_IDS] == prompt_1
    assert with_ids[S.COMPLETION_IDS] == reply_1 + inserted + reply_2
    assert with_ids[S.LOSS_MASK] == [1] * len(reply_1) + [0] * len(inserted) + [1] * len(reply_2)
    logged = [[e["logprob"] for e in c["response"]["choices"][0]["logprobs"]["content"]] for c in lines[0]["calls"]]
    assert with_ids[S.BEHAVIOR_LOGPROBS] == logged[0] + [0.0] * len(inserted) + logged[1]
    assert with_ids[S.COMPLETION] == tokenizer.decode(reply_1 + inserted + reply_2)
    for column in (S.PROMPT_IDS, S.COMPLETION_IDS, S.LOSS_MASK, S.BEHAVIOR_LOGPROBS):
        assert rendered[column] == with_ids[column], column
    assert [r[S.GROUP_ID] for r in (with_ids, rendered)] == ["e1", "e2"]
    assert json.loads(with_ids[S.META]) == {"episode_id": "e1"}
    # inspect reports who wrote which tokens
    tokens = describe_dataset(tmp_path / "ds")["tokens"]
    assert tokens["policy"] == 2 * (len(reply_1) + len(reply_2))
    assert tokens["environment"] == 2 * len(inserted)
    assert tokens["policy"] + tokens["environment"] == tokens["completion"]


def test_bad_episodes_are_refused_naming_the_call_and_position(chat, tokenizer, tmp_path, capsys):
    eos = tokenizer.eos_token_id
    reply_1 = tokenizer(" tacos")["input_ids"] + [eos]
    reply_2 = tokenizer(" 42")["input_ids"] + [eos]
    good = logged_episode(tokenizer, reply_1, reply_2, "good")
    reordered = {**logged_episode(tokenizer, reply_1, reply_2, "reordered"), "calls": good["calls"][::-1]}
    missing = logged_episode(tokenizer, reply_1, reply_2, "missing")
    del missing["calls"][1]["response"]
    # " tacos" sampled byte by byte: rendering the reply again gives the one token " tacos"
    by_bytes = token_bytes(tokenizer)
    bytewise = [by_bytes.index(bytes([b])) for b in b" tacos"] + [eos]
    retokenized = logged_episode(tokenizer, bytewise, reply_2, "retokenized")
    two_choices = logged_episode(tokenizer, reply_1, reply_2, "two")
    choice = two_choices["calls"][0]["response"]["choices"][0]
    two_choices["calls"][0]["response"]["choices"] = [choice, {**choice, "index": 1}]
    src = _write(tmp_path / "bad.jsonl", [good, reordered, missing, retokenized, two_choices])
    with pytest.raises(BadLinesError) as info:
        import_dataset(ImportConfig(src, "openai", tmp_path / "ds", tokenizer=chat))
    reasons = {r.line: (r.code, r.reason) for r in info.value.rejects}
    assert set(reasons) == {2, 3, 4, 5}
    prompt_1 = good["calls"][0]["response"]["prompt_token_ids"]
    prompt_2 = good["calls"][1]["response"]["prompt_token_ids"]
    assert reasons[2][1].startswith(f"call 2: its context does not extend call 1's context and reply token for "
                                    f"token: they first differ at token {len(prompt_1)} (call 2: the end")
    assert reasons[3] == ("bad-episode", "call 2: no response object (a failed or unlogged call)")
    assert reasons[4][1].startswith(f"call 2: its context does not extend call 1's context and reply token for "
                                    f"token: they first differ at token {len(prompt_1)} (call 2: ' tacos")
    assert reasons[5] == ("bad-episode", "call 1: 2 choices; each call of an episode samples one (n=1)")
    assert all(code == "bad-episode" for code, _ in reasons.values())

    code, out, _ = run_cli(capsys, "import", src, "--format", "openai", "--out", tmp_path / "split",
                           "--tokenizer", chat, "--split-episodes", "--skip-bad")
    assert code == 0 and "from 3 of 5 records" in out
    rows = _rows(tmp_path / "split")
    assert [(r[S.GROUP_ID], json.loads(r[S.META])["episode_call"]) for r in rows] == [
        ("good", 1), ("good", 2), ("reordered", 1), ("reordered", 2), ("retokenized", 1), ("retokenized", 2)]
    split = {(r[S.GROUP_ID], json.loads(r[S.META])["episode_call"]): r for r in rows}
    assert split["retokenized", 1][S.COMPLETION_IDS] == bytewise  # as sampled, in its own context
    assert split["retokenized", 2][S.PROMPT_IDS] == prompt_2  # the context the template rebuilt
    assert split["good", 2][S.REWARD] == 1.0 and split["good", 2][S.LOSS_MASK] is None


def test_an_episode_missing_calls_is_refused_unless_split(chat, tokenizer, tmp_path, capsys):
    """`record`'s recovery writes "missing_calls" on an episode that lacks answered calls (issue 50): as one row,
    the missing reply would pass for context; its calls one by one are whole."""
    eos = tokenizer.eos_token_id
    reply_1, reply_2 = tokenizer(" tacos")["input_ids"] + [eos], tokenizer(" 42")["input_ids"] + [eos]
    holed = {**logged_episode(tokenizer, reply_1, reply_2, "holed"), "missing_calls": 1, "closed_by": "recovered"}
    src = _write(tmp_path / "holed.jsonl", [logged_episode(tokenizer, reply_1, reply_2, "whole"), holed])
    with pytest.raises(BadLinesError) as info:
        import_dataset(ImportConfig(src, "openai", tmp_path / "ds", tokenizer=chat))
    [reject] = info.value.rejects
    assert (reject.line, reject.code) == (2, "bad-episode") and "1 answered call(s)" in reject.reason
    code, out, _ = run_cli(capsys, "import", src, "--format", "openai", "--out", tmp_path / "split",
                           "--tokenizer", chat, "--split-episodes")
    assert code == 0, out
    assert [r[S.GROUP_ID] for r in _rows(tmp_path / "split")] == ["whole", "whole", "holed", "holed"]


def test_rewards_file_group_by_prompt_and_record_lines(chat, tokenizer, tmp_path, capsys):
    """Rewards keyed by response id and episode id override the lines'; lines carrying the keys
    `offline-rec record` adds (timing, upstream_model, episode_id) import; --group-by-prompt groups
    episodes and single calls by their first prompt."""
    eos = tokenizer.eos_token_id
    reply = tokenizer(" crêpes")["input_ids"] + [eos]
    episodes = [logged_episode(tokenizer, reply, reply, f"ep{i}", seed=i % 2) for i in range(3)]
    single = logged_call(tokenizer, chat_messages(1, seed=0)[0], reply, "chatcmpl-7")
    single.update({"timing": {"seconds": 0.1}, "upstream_model": "tiny-chat", "episode_id": "solo", "reward": 0.5})
    src = _write(tmp_path / "log.jsonl", [*episodes, single])
    rewards = _write(tmp_path / "rewards.jsonl", [{"id": "ep0", "reward": 0.0}, {"id": "chatcmpl-7", "reward": [2]},
                                                  {"id": "never-logged", "reward": 1}])
    code, out, err = run_cli(capsys, "import", src, "--format", "openai", "--out", tmp_path / "ds", "--tokenizer",
                             chat, "--rewards", rewards, "--group-by-prompt")
    assert code == 0, err
    assert "rewards from" in out and "2 matched a line, 1 matched none" in out
    rows = _rows(tmp_path / "ds")
    by_episode = {json.loads(r[S.META]).get("episode_id"): r for r in rows}
    assert {k: r[S.REWARD] for k, r in by_episode.items()} == {"ep0": 0.0, "ep1": 1.0, "ep2": 1.0, "solo": 2.0}
    # ep0, ep2 and the single call share their first prompt (seed 0); ep1 has its own
    assert by_episode["ep0"][S.GROUP_ID] == by_episode["ep2"][S.GROUP_ID] == by_episode["solo"][S.GROUP_ID]
    assert by_episode["ep1"][S.GROUP_ID] != by_episode["ep0"][S.GROUP_ID]
    stats = open_dataset(tmp_path / "ds").manifest[S.M_STATS]
    assert (stats["rewards_matched"], stats["rewards_unmatched"], stats["imported_lines"]) == (2, 1, 4)
    code, _, err = run_cli(capsys, "import", src, "--format", "rows", "--out", tmp_path / "x", "--rewards", rewards)
    assert code == 2 and "--rewards applies to the openai format only" in err


# --------------------------------------------------------------------------------------------
# answers the text does not fully decide: cut inside a character, byte-fallback look-alikes (issue 29)


def _lossy_line(response_id: str, prompt_ids: list[int], choices: list[tuple]) -> dict:
    """A completions line as a server logs it without token ids: (text, token strings, log-probs, finish) a choice."""
    return {"request": {"model": "m", "prompt": "p", "logprobs": 0},
            "response": {"id": response_id, "model": "m", "prompt_token_ids": prompt_ids, "choices": [
                {"index": i, "text": text, "finish_reason": finish,
                 "logprobs": {"tokens": strings, "token_logprobs": logprobs}}
                for i, (text, strings, logprobs, finish) in enumerate(choices)]}}


def test_13_an_answer_cut_inside_a_character_imports_its_decidable_prefix(chat, tokenizer, tmp_path, capsys):
    text = "Réponse: 東京は晴れ 😀 ok"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    strings = vllm_strings(tokenizer, ids)
    cut = next(k for k in range(1, len(ids)) if strings[k - 1] == "")  # max_tokens reached inside a character
    tail = next(t for t in range(cut) if strings[cut - 1 - t] != "")  # its trailing "" entries
    assert tail >= 1
    logprobs = [-0.25 - t / 16 for t in range(len(ids))]  # exact in float32
    partial = tokenizer.decode(ids[:cut])
    assert partial.endswith(REPLACEMENT)
    whole = (text, strings, logprobs, "stop")
    lines = [  # vLLM holds a partial character back; other servers print U+FFFD for it
        _lossy_line("cut-held-back", [1, 2], [(partial.rstrip(REPLACEMENT), strings[:cut], logprobs[:cut], "length"),
                                              whole]),
        _lossy_line("cut-replaced", [1, 2], [(partial, strings[:cut], logprobs[:cut], "length")]),
    ]
    summary = import_dataset(ImportConfig(_write(tmp_path / "cut.jsonl", lines), "openai", tmp_path / "ds",
                                          tokenizer=chat, logprobs_source="sampled"))
    assert summary["rejected_lines"] == 0 and summary["rows"] == 3
    assert summary["cut_choices"] == 2 and summary["cut_tail_tokens_dropped"] == 2 * tail
    assert open_dataset(tmp_path / "ds").manifest[S.M_STATS]["cut_tail_tokens_dropped"] == 2 * tail
    rows = _rows(tmp_path / "ds")
    cut_rows = [r for r in rows if r[S.FINISH_REASON] == "length"]
    assert len(cut_rows) == 2
    for row in cut_rows:
        assert row[S.COMPLETION_IDS] == ids[:cut - tail]
        assert row[S.BEHAVIOR_LOGPROBS] == logprobs[:cut - tail]
    assert [r[S.COMPLETION_IDS] for r in rows if r[S.FINISH_REASON] == "stop"] == [ids]
    # through the command line: the summary says what was left out
    code, out, _ = run_cli(capsys, "import", tmp_path / "cut.jsonl", "--format", "openai", "--tokenizer", chat,
                           "--out", tmp_path / "cli", "--logprobs-source", "sampled")
    assert code == 0 and f"imported without their last {2 * tail} token(s)" in out


def test_13_undecidable_tokens_before_the_end_are_refused_naming_u_fffd(chat, tokenizer, tmp_path):
    by_bytes = {data: i for i, data in enumerate(token_bytes(tokenizer))}
    ids = tokenizer("ab", add_special_tokens=False)["input_ids"] + [by_bytes[b"\x80"]] + \
        tokenizer("cd", add_special_tokens=False)["input_ids"]
    text = tokenizer.decode(ids)
    assert text == f"ab{REPLACEMENT}cd"  # the server could not decode the lone byte
    strings = [tokenizer.decode([t]) for t in ids]
    line = _lossy_line("mid", [1, 2], [(text, strings, [-0.5] * len(ids), "length")])
    with pytest.raises(BadLinesError, match="U\\+FFFD: the server could not decode"):
        import_dataset(ImportConfig(_write(tmp_path / "mid.jsonl", [line]), "openai", tmp_path / "ds",
                                    tokenizer=chat, logprobs_source="sampled"))


@pytest.fixture(scope="module")
def sentencepiece_model(tmp_path_factory) -> str:
    """A tiny random Llama with a real SentencePiece byte-fallback vocabulary (Mistral 7B v0.1's, 32k, shipped
    by the mistral-common package)."""
    import os
    import shutil

    import mistral_common
    from transformers import LlamaTokenizer

    from offline_rec.models.tiny import build_tiny_model, save_tiny

    folder = tmp_path_factory.mktemp("sentencepiece")
    shutil.copy(os.path.join(os.path.dirname(mistral_common.__file__), "data", "tokenizer.model.v1"),
                folder / "tokenizer.model")
    tok = LlamaTokenizer.from_pretrained(folder)
    return save_tiny(build_tiny_model(tok, num_layers=1), tok, folder / "model")


def test_14_byte_fallback_look_alikes_are_refused_or_resolved_by_score_with(sentencepiece_model, tmp_path, capsys):
    """"1" prints alike from the piece 1 and the byte piece <0x31>: without token ids the importer refuses
    to guess; --score-with takes the split whose teacher-forced log-probs are the logged ones; of two
    answers, an undecidable one does not take the decidable one with it."""
    from offline_rec.models.loading import load_model, load_tokenizer
    from offline_rec.models.teacher_forced import teacher_forced_logprobs

    tok = load_tokenizer(sentencepiece_model)
    piece = tok.convert_tokens_to_ids
    one, ing, byte_one = piece("1"), piece("ing"), piece("<0x31>")
    prompt_ids = [tok.bos_token_id, piece("\u2581x")]
    answers = [[ing, byte_one, ing], [ing, one, ing], [ing, ing]]  # sampled: the byte piece, the piece, no "1"
    model = load_model(sentencepiece_model, dtype="float32")
    logged = teacher_forced_logprobs(model, tok, [prompt_ids] * 3, answers)  # what a float32 server logs
    choices = []
    for ids, logprobs in zip(answers, logged):
        strings = vllm_strings(tok, ids)
        assert strings == [tok.decode([t]) for t in ids] and "" not in strings
        choices.append((tok.decode(ids), strings, logprobs, "stop"))
    assert choices[0][:2] == choices[1][:2] == ("ing1ing", ["ing", "1", "ing"])  # byte_one prints as "1"
    path = _write(tmp_path / "sp.jsonl", [_lossy_line("two-of-three", prompt_ids, choices),
                                          _lossy_line("only-ambiguous", prompt_ids, choices[:1])])

    # without a scorer: the ambiguous answers are left out, the decidable one is imported, its group smaller
    summary = import_dataset(ImportConfig(path, "openai", tmp_path / "plain", tokenizer=sentencepiece_model,
                                          logprobs_source="sampled", skip_bad=True))
    assert summary["undecidable_choices_dropped"] == 2 and summary["rejected_lines"] == 1
    [row] = _rows(tmp_path / "plain")
    assert row[S.COMPLETION_IDS] == answers[2]
    rejects = (tmp_path / "plain" / "rejects.jsonl").read_text()
    assert "ambiguous" in rejects and "byte-fallback" in rejects

    # with the model that sampled: every answer gets the ids it was sampled with, none is a guess
    code, out, err = run_cli(capsys, "import", path, "--format", "openai", "--score-with", sentencepiece_model,
                             "--out", tmp_path / "scored")
    assert code == 0, err
    assert "3 ambiguous answer(s) resolved" in out
    rows = _rows(tmp_path / "scored")
    assert sorted(r[S.COMPLETION_IDS] for r in rows) == sorted([answers[0], answers[1], answers[2], answers[0]])


VLLM_DIGITS_SCRIPT = r"""
import json, sys
from vllm import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype="float32", max_model_len=256, seed=0, logprobs_mode="raw_logprobs")
vocab = llm.get_tokenizer().get_vocab()
digits = [vocab[str(d)] for d in range(10)] + [vocab[f"<0x{0x30 + d:02X}>"] for d in range(10)]
# allowed_token_ids: applied by the sampler, after the raw log-probs (a grammar's mask would come before)
params = SamplingParams(n=8, temperature=1.0, max_tokens=3, logprobs=0, seed=0, allowed_token_ids=digits)
[output] = llm.generate(["x"], params)
choices = [{"ids": list(c.token_ids), "text": c.text, "finish": c.finish_reason,
            "tokens": [next(iter(lp.values())).decoded_token for lp in c.logprobs],
            "logprobs": [next(iter(lp.values())).logprob for lp in c.logprobs]} for c in output.outputs]
print(json.dumps({"prompt_ids": list(output.prompt_token_ids), "choices": choices}))
"""


@pytest.mark.vllm
@pytest.mark.slow  # ~15 s on an idle machine, a minute on a busy one
def test_14_what_vllm_samples_with_byte_fallback_imports_as_its_token_id_twin(sentencepiece_model, tmp_path):
    """vLLM (vllm-cpu, in a child process) samples three digits, where the piece "1" and the byte piece
    <0x31> both fit and print alike: the lossy log is refused without --score-with, and with it every
    imported row equals the token ids vLLM sampled; none is a guess."""
    import importlib.util
    import os
    import subprocess
    import sys

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not installed")
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    result = subprocess.run([sys.executable, "-c", VLLM_DIGITS_SCRIPT, sentencepiece_model], env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    sampled = json.loads(result.stdout.strip().splitlines()[-1])
    fallback = set(Vocabulary.of(AutoTokenizer.from_pretrained(sentencepiece_model)).fallback)
    twins = [c["ids"] for c in sampled["choices"]]
    assert any(set(ids) & fallback for ids in twins) and any(set(ids) - fallback for ids in twins)
    line = _lossy_line("digits", sampled["prompt_ids"],
                       [(c["text"], c["tokens"], c["logprobs"], c["finish"]) for c in sampled["choices"]])
    path = _write(tmp_path / "digits.jsonl", [line])
    with pytest.raises(BadLinesError, match="ambiguous"):
        import_dataset(ImportConfig(path, "openai", tmp_path / "plain", tokenizer=sentencepiece_model,
                                    logprobs_source="raw"))
    summary = import_dataset(ImportConfig(path, "openai", tmp_path / "scored", score_with=sentencepiece_model))
    assert summary["ambiguous_splits_resolved"] == len(twins) == summary["rows"]
    assert sorted(r[S.COMPLETION_IDS] for r in _rows(tmp_path / "scored")) == sorted(twins)
