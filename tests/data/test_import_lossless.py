"""`import --format openai` without a server: exact token ids from lossy token strings (byte-level BPE and
SentencePiece byte-fallback vocabularies), multi-turn tool episodes with loss masks, --split-episodes,
--rewards, and lines as `offline-rec record` writes them.

Lossy logs are made here the way vLLM 0.32 prints token strings (`vllm_strings`: a token that ends
inside a character prints "", the token that completes it prints the whole character, a token that
starts inside one prints U+FFFD for those bytes); tests/data/test_import_server_logs.py checks the same
against a real server.
"""

from __future__ import annotations

import json

import pytest
import torch
from cli_support import run_cli
from tokenizer_support import byte_fallback_sentencepiece
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from offline_rec import schema as S
from offline_rec.data.dataset import open_dataset
from offline_rec.data.importers import ImportConfig, import_dataset
from offline_rec.data.importers.common import BadLinesError
from offline_rec.data.importers.tokens import NotRecoverable, Vocabulary, entry_evidence, reconstruct_ids
from offline_rec.data.inspect import describe_dataset
from offline_rec.data.validate import validate_dataset
from offline_rec.models.tiny import chat_messages, make_chat_checkpoint
from offline_rec.models.vocab import byte_level_alphabet, token_bytes

REPLACEMENT = "\ufffd"


@pytest.fixture(scope="module")
def chat(tmp_path_factory) -> str:
    return make_chat_checkpoint(tmp_path_factory.mktemp("chat") / "model")


@pytest.fixture(scope="module")
def tokenizer(chat):
    return AutoTokenizer.from_pretrained(chat)


def vllm_strings(tokenizer, ids: list[int]) -> list[str]:
    """Token strings as vLLM 0.32 logs them (LogprobsProcessor: a token whose own text ends in U+FFFD is
    decoded again after 1..4 previous tokens, and credited the text after the clean ones, or printed "")."""
    strings = []
    for i, token in enumerate(ids):
        text = tokenizer.decode([token])
        if text.endswith(REPLACEMENT):
            text = ""
            for k in range(1, min(i, 4) + 1):
                context = ids[i - k:i]
                full = tokenizer.decode(context + [token])
                if full.endswith(REPLACEMENT):
                    continue
                clean = len(context)
                while clean and tokenizer.decode([context[clean - 1]]).endswith(REPLACEMENT):
                    clean -= 1
                text = full[len(tokenizer.decode(context[:clean])):]
                break
        strings.append(text)
    return strings


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


def test_sentencepiece_byte_fallback_tokens_recover():
    sp = byte_fallback_sentencepiece()
    text = "x 文a"  # 文 = E6 96 87, not in the vocabulary: three byte-fallback pieces
    ids = sp(text)["input_ids"]
    assert sp.convert_ids_to_tokens(ids) == ["x", "\u2581", "<0xE6>", "<0x96>", "<0x87>", "a"]
    strings = vllm_strings(sp, ids)
    assert strings == ["x", " ", "", "", "文", "a"]
    assert reconstruct_ids(_evidence(strings), text, Vocabulary.of(sp)) == ids


# --------------------------------------------------------------------------------------------
# episodes, built from the chat tokenizer the way vLLM logs them with return_token_ids


TOOL = "résultat: 42 € ✅"


def _call(tokenizer, messages: list[dict], reply_ids: list[int], response_id: str, logprob: float = -0.5,
          with_ids: bool = True) -> dict:
    prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    content = tokenizer.decode(reply_ids, skip_special_tokens=True)
    entries = [{"token": s, "logprob": logprob - t / 16, "bytes": list(s.encode())}  # exact in float32
               for t, s in enumerate(vllm_strings(tokenizer, reply_ids))]
    response = {"id": response_id, "model": "tiny-chat",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                             "logprobs": {"content": entries}, "finish_reason": "stop",
                             "token_ids": reply_ids if with_ids else None}],
                "prompt_token_ids": prompt_ids if with_ids else None}
    return {"request": {"model": "tiny-chat", "messages": messages, "temperature": 1.0, "logprobs": True},
            "response": response}


def _episode(tokenizer, reply_1: list[int], reply_2: list[int], episode_id: str, with_ids: bool = True,
             seed: int = 0) -> dict:
    messages = chat_messages(1, seed=seed)[0]
    first = _call(tokenizer, messages, reply_1, f"{episode_id}-a", with_ids=with_ids)
    follow = messages + [{"role": "assistant", "content": tokenizer.decode(reply_1, skip_special_tokens=True)},
                         {"role": "tool", "content": TOOL}]
    second = _call(tokenizer, follow, reply_2, f"{episode_id}-b", logprob=-1.5, with_ids=with_ids)
    return {"calls": [first, second], "reward": 1.0, "episode_id": episode_id, "timing": {"seconds": [0.2, 0.3]},
            "upstream_model": "tiny-chat"}


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
    lines = [_episode(tokenizer, reply_1, reply_2, "e1"), _episode(tokenizer, reply_1, reply_2, "e2", with_ids=False)]
    src = _write(tmp_path / "episodes.jsonl", lines)
    summary = import_dataset(ImportConfig(src, "openai", tmp_path / "ds", tokenizer=chat))
    assert (summary["rows"], summary["imported_lines"]) == (2, 2)
    with_ids, rendered = _rows(tmp_path / "ds")
    prompt_1 = lines[0]["calls"][0]["response"]["prompt_token_ids"]
    # what the chat template and the tool put between the replies, tokenized on its own
    inserted = tokenizer("\n<|im_start|>tool\n" + TOOL + "<|im_end|>\n<|im_start|>assistant\n")["input_ids"]
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
    good = _episode(tokenizer, reply_1, reply_2, "good")
    reordered = {**_episode(tokenizer, reply_1, reply_2, "reordered"), "calls": good["calls"][::-1]}
    missing = _episode(tokenizer, reply_1, reply_2, "missing")
    del missing["calls"][1]["response"]
    # " tacos" sampled byte by byte: rendering the reply again gives the one token " tacos"
    by_bytes = token_bytes(tokenizer)
    bytewise = [by_bytes.index(bytes([b])) for b in b" tacos"] + [eos]
    retokenized = _episode(tokenizer, bytewise, reply_2, "retokenized")
    two_choices = _episode(tokenizer, reply_1, reply_2, "two")
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


def test_rewards_file_group_by_prompt_and_record_lines(chat, tokenizer, tmp_path, capsys):
    """Rewards keyed by response id and episode id override the lines'; lines carrying the keys
    `offline-rec record` adds (timing, upstream_model, episode_id) import; --group-by-prompt groups
    episodes and single calls by their first prompt."""
    eos = tokenizer.eos_token_id
    reply = tokenizer(" crêpes")["input_ids"] + [eos]
    episodes = [_episode(tokenizer, reply, reply, f"ep{i}", seed=i % 2) for i in range(3)]
    single = _call(tokenizer, chat_messages(1, seed=0)[0], reply, "chatcmpl-7")
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
