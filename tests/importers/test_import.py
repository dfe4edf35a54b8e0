"""`offline-rec import`: every source format on a good fixture (rows, groups, token ids and log-probs
checked exactly) and on a bad one (file:line errors, exit 2, nothing written; --skip-bad writes the
good rows and rejects.jsonl); --score-with against a direct teacher-forced computation.

Fixtures: tests/fixtures/import/ (see make_fixtures.py there for what each line is). Token ids are
those of the tiny character tokenizer (offline_rec.models.tiny): <pad>=0 <s>=1 </s>=2 <unk>=3, then
"0".."9" = 4..13, "a".."z" = 14..39, "W"=40, " "=41, "\\n"=42, "+"=43, "-"=44, ... "="=47, ":"=51.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from support.cli_support import run_cli as run_main
from support.datagen import tree_digest
from support.paths import FIXTURES as _FIXTURES

from offline_rec import schema as S
from offline_rec.dataset.format import open_dataset, sha256_file
from offline_rec.dataset.validate import validate_dataset
from offline_rec.errors import UserError
from offline_rec.importers import IMPORT_FORMATS, ImportConfig, import_dataset
from offline_rec.importers.common import BadLinesError
from offline_rec.importers.openai import token_string_mapper
from offline_rec.models.loading import load_model, load_tokenizer
from offline_rec.models.teacher_forced import teacher_forced_logprobs
from offline_rec.models.tiny import build_bpe_tokenizer, make_tiny_checkpoint

FIXTURES = _FIXTURES / "import"
EOS = 2
CHAT_PREFIX = [34, 32, 18, 31, 51, 41]  # "user: "
CHAT_SUFFIX = [42, 14, 32, 32, 22, 32, 33, 14, 27, 33, 51, 41]  # "\nassistant: "


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "model")



def rows_of(path) -> list[dict]:
    return open_dataset(path).to_table().to_pylist()


def clean(path) -> dict:
    """The dataset passes validate without errors; returns its manifest."""
    report = validate_dataset(path)
    assert report.ok, report.to_json()["problems"]
    return open_dataset(path).manifest


def nothing_written(out: Path) -> None:
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}")], "a partial directory was left"


def assert_bad_lines_refused(capsys, src: Path, fmt: str, out: Path, expected: dict[int, str], *extra) -> None:
    """Default behavior on bad input: every bad line named as file:line, exit 2, nothing written."""
    code, _, err = run_main(capsys, "import", src, "--format", fmt, "--out", out, *extra)
    assert code == 2
    for line in expected:
        assert f"{src}:{line}: " in err
    assert f"{len(expected)} bad line(s)" in err
    nothing_written(out)


def assert_rejects_file(out: Path, src: Path, expected: dict[int, str]) -> None:
    rejects = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    assert [(r["file"], r["line"], r["code"]) for r in rejects] == [
        (str(src), line, code) for line, code in expected.items()
    ]
    assert all(r["reason"] for r in rejects)
    stats = open_dataset(out).manifest[S.M_STATS]
    assert stats["rejected_lines"] == len(expected)
    assert sum(stats["rejects_by_reason"].values()) == len(expected)


def direct_logprobs(model, prompt_ids: list[int], completion_ids: list[int]) -> list[float]:
    """Teacher-forced log p(completion token j | prompt, completion[:j]), one sequence, no padding."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + completion_ids])).logits[0].float()  # [L, V]
    logprobs = logits.log_softmax(-1)
    start = len(prompt_ids) - 1  # position P-1 predicts the first completion token
    return [logprobs[start + j, token].item() for j, token in enumerate(completion_ids)]


def test_registry_names_the_four_formats():
    assert set(IMPORT_FORMATS) == {"rows", "text", "openai", "trl"}
    assert [name for name, f in IMPORT_FORMATS.items() if not f.gives_logprobs] == ["text", "trl"]


def test_each_format_records_its_own_options_in_the_source_block(tmp_path, tiny):
    """A format's module says which of its options shaped the rows (`source_options`); the source block adds the
    options every format reads, and names no option of another format."""
    config = ImportConfig(Path("src.jsonl"), "rows", tmp_path / "out", append_eos=False, reward_columns="a, b",
                          group_by_prompt=True, prompt_column="question")
    assert {name: spec.source_options(config) for name, spec in IMPORT_FORMATS.items()} == {
        "rows": {},
        "text": {"append_eos": False, "columns": {"prompt": "question", "completion": "completion",
                                                  "reward": "reward", "group": "group_id"}},
        "openai": {"group_by_prompt": True, "split_episodes": False, "rewards": None},
        "trl": {"append_eos": False, "reward_columns": ["a", "b"]},
    }
    import_dataset(ImportConfig(FIXTURES / "rows_good.jsonl", "rows", tmp_path / "rows"))
    assert clean(tmp_path / "rows")[S.M_SOURCE]["options"] == {"tokenizer": None, "score_with": None}


@pytest.mark.parametrize("fmt", ["rows", "text", "trl"])
@pytest.mark.parametrize(("option", "value", "flag"), [("rewards", Path("thumbs.jsonl"), "--rewards"),
                                                       ("split_episodes", True, "--split-episodes")])
def test_an_option_only_openai_takes_is_refused_with_another_format(tmp_path, fmt, option, value, flag):
    config = ImportConfig(FIXTURES / "rows_good.jsonl", fmt, tmp_path / "ds", score_with="never-loaded",
                          **{option: value})
    with pytest.raises(UserError, match=f"^{flag} applies to the openai format only$"):
        import_dataset(config)
    nothing_written(tmp_path / "ds")


# (option, a value that is not its default, its flag, the formats that read it): every format-specific option
FORMAT_OPTIONS = [
    ("prompt_column", "question", "--prompt-column", ("text", "trl")),
    ("completion_column", "answer", "--completion-column", ("text", "trl")),
    ("append_eos", False, "--no-append-eos", ("text", "trl")),
    ("reward_column", "score", "--reward-column", ("text",)),
    ("group_column", "gid", "--group-column", ("text",)),
    ("reward_columns", ("a",), "--reward-columns", ("trl",)),
    ("group_by_prompt", True, "--group-by-prompt", ("openai",)),
    ("keep_messages", True, "--keep-messages", ("openai",)),
]


@pytest.mark.parametrize(("option", "value", "flag", "readers"), FORMAT_OPTIONS)
def test_a_format_specific_option_is_refused_with_a_format_that_does_not_read_it(tmp_path, option, value, flag,
                                                                                readers):
    assert {name for name, spec in IMPORT_FORMATS.items() if option in spec.options} == set(readers)
    names = " and ".join(readers) + (" formats" if len(readers) > 1 else " format")
    for fmt in sorted(set(IMPORT_FORMATS) - set(readers)):
        config = ImportConfig(FIXTURES / "rows_good.jsonl", fmt, tmp_path / fmt, score_with="never-loaded",
                              **{option: value})
        with pytest.raises(UserError, match=f"^{flag} applies to the {names} only$"):
            import_dataset(config)
        nothing_written(tmp_path / fmt)


def test_every_format_specific_option_is_tested():
    listed = {option for spec in IMPORT_FORMATS.values() for option in spec.options}
    assert listed == {row[0] for row in FORMAT_OPTIONS} | {"rewards", "split_episodes"}


# --------------------------------------------------------------------------------------------
# rows


def test_rows_jsonl_groups_defaults_and_values(tmp_path):
    src = FIXTURES / "rows_good.jsonl"
    summary = import_dataset(ImportConfig(src, "rows", tmp_path / "ds", behavior="logger", policy_version=7))
    assert (summary["rows"], summary["groups"], summary["rejected_lines"]) == (3, 2, 0)
    rows = rows_of(tmp_path / "ds")
    # g1 first (first seen on line 1), its rows ordered by the given sample_index (line 3, then line 1).
    assert [(r[S.GROUP_ID], r[S.SAMPLE_INDEX], r[S.COMPLETION]) for r in rows] == [
        ("g1", 0, "2"),
        ("g1", 1, "3"),
        ("g2", 0, "4"),
    ]
    assert rows[0][S.PROMPT_IDS] == [5, 43, 5, 47]
    assert rows[0][S.COMPLETION_IDS] == [6, EOS]
    assert rows[0][S.BEHAVIOR_LOGPROBS] == [-0.5, -0.0625]
    assert rows[1][S.BEHAVIOR_LOGPROBS] == [-1.5, -0.25]
    assert rows[0][S.REWARD] == 1.0 and rows[1][S.REWARD] == 0.0
    assert json.loads(rows[0][S.META]) == {"answer": 2}  # given as a JSON string
    assert json.loads(rows[1][S.META]) == {"answer": 2}  # given as an object
    # Line 1 carries its own behavior / version / task; lines 2 and 3 take the defaults.
    assert (rows[1][S.BEHAVIOR], rows[1][S.POLICY_VERSION], rows[1][S.TASK]) == ("m-old", 3, "arith")
    assert (rows[0][S.BEHAVIOR], rows[0][S.POLICY_VERSION], rows[0][S.TASK]) == ("logger", 7, "")
    g2 = rows[2]
    assert g2[S.REWARD] is None and g2[S.META] == "{}" and g2[S.LOSS_MASK] == [1]
    assert rows[0][S.LOSS_MASK] is None and rows[0][S.FINISH_REASON] == "stop" and g2[S.FINISH_REASON] == "length"

    manifest = clean(tmp_path / "ds")
    assert manifest[S.M_SOURCE]["command"] == "import" and manifest[S.M_SOURCE]["format"] == "rows"
    assert manifest[S.M_SOURCE]["file"] == str(src) and manifest[S.M_SOURCE]["sha256"] == sha256_file(src)
    assert manifest[S.M_BEHAVIOR]["logprobs_source"] == "unknown"
    assert manifest[S.M_BEHAVIOR]["tokenizer_hash"] is None
    assert manifest[S.M_COMPLETE] is True


def test_rows_parquet_equals_jsonl(tmp_path):
    options = dict(behavior="logger", policy_version=7)
    import_dataset(ImportConfig(FIXTURES / "rows_good.jsonl", "rows", tmp_path / "a", **options))
    import_dataset(ImportConfig(FIXTURES / "rows_good.parquet", "rows", tmp_path / "b", **options))
    clean(tmp_path / "b")
    assert rows_of(tmp_path / "b") == rows_of(tmp_path / "a")


ROWS_BAD = {2: "bad-json", 3: "length-mismatch", 4: "nonfinite-logprob", 5: "positive-logprob",
            6: "empty-completion", 7: "bad-utf8", 8: "missing-column"}


def test_rows_bad_lines_refused_by_default(tmp_path, capsys):
    src = FIXTURES / "rows_bad.jsonl"
    assert_bad_lines_refused(capsys, src, "rows", tmp_path / "ds", ROWS_BAD)
    with pytest.raises(BadLinesError) as info:
        import_dataset(ImportConfig(src, "rows", tmp_path / "ds"))
    assert [(r.line, r.code) for r in info.value.rejects] == list(ROWS_BAD.items())
    nothing_written(tmp_path / "ds")


def test_rows_skip_bad_writes_good_rows_and_rejects(tmp_path, capsys):
    src = FIXTURES / "rows_bad.jsonl"
    code, out, _ = run_main(capsys, "import", src, "-f", "rows", "-o", tmp_path / "ds", "--skip-bad")
    assert code == 0 and "set aside 7 bad line(s)" in out
    rows = rows_of(tmp_path / "ds")
    assert [(r[S.GROUP_ID], r[S.SAMPLE_INDEX], r[S.COMPLETION_IDS]) for r in rows] == [
        ("g1", 0, [6, EOS]),
        ("g2", 0, [8, EOS]),
    ]
    assert_rejects_file(tmp_path / "ds", src, ROWS_BAD)
    assert open_dataset(tmp_path / "ds").manifest[S.M_STATS]["source_records"] == 9
    clean(tmp_path / "ds")


def test_skip_bad_with_every_line_refused_fails_with_one_line(tmp_path, capsys):
    # --skip-bad with no good line: nothing to import, so no empty dataset; one line with the reasons, most common
    # first (not the list of bad lines a refusal without --skip-bad prints).
    src = tmp_path / "all_bad.jsonl"
    src.write_text('{"group_id": \n' + "not json\n" + json.dumps({"group_id": "g1"}) + "\n")
    code, out, err = run_main(capsys, "import", src, "-f", "rows", "-o", tmp_path / "ds", "--skip-bad")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"error: every line of {src} was refused (3 bad line(s): bad-json 2, missing-column 1), "
                          f"nothing written; first: {src}:1: ")
    nothing_written(tmp_path / "ds")


def test_rows_without_logprobs_need_score_with(tmp_path):
    src = tmp_path / "nolp.jsonl"
    row = json.loads((FIXTURES / "rows_good.jsonl").read_text().splitlines()[0])
    del row[S.BEHAVIOR_LOGPROBS]
    src.write_text(json.dumps(row) + "\n")
    with pytest.raises(UserError, match="--score-with"):
        import_dataset(ImportConfig(src, "rows", tmp_path / "ds"))
    nothing_written(tmp_path / "ds")


def test_repeated_sample_index_is_a_bad_line(tmp_path):
    lines = (FIXTURES / "rows_good.jsonl").read_text().splitlines()[:1]
    src = tmp_path / "dup.jsonl"
    src.write_text("\n".join([lines[0], lines[0]]) + "\n")
    with pytest.raises(BadLinesError) as info:
        import_dataset(ImportConfig(src, "rows", tmp_path / "ds"))
    assert [(r.line, r.code) for r in info.value.rejects] == [(2, "duplicate")]


def test_logprobs_source_flag_is_recorded(tmp_path, tiny):
    import_dataset(ImportConfig(FIXTURES / "rows_good.jsonl", "rows", tmp_path / "a", logprobs_source="sampled",
                                tokenizer=tiny))
    behavior = open_dataset(tmp_path / "a").behavior
    assert behavior["logprobs_source"] == "sampled" and len(behavior["tokenizer_hash"]) == 64
    with pytest.raises(UserError, match="--score-with recomputes"):
        import_dataset(ImportConfig(FIXTURES / "rows_good.jsonl", "rows", tmp_path / "b", logprobs_source="sampled",
                                    score_with=tiny))
    with pytest.raises(UserError, match="unknown --logprobs-source"):
        import_dataset(ImportConfig(FIXTURES / "rows_good.jsonl", "rows", tmp_path / "c", logprobs_source="guessed"))


def test_existing_output_is_refused(tmp_path, capsys):
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "keep.txt").write_text("mine")
    code, _, err = run_main(capsys, "import", FIXTURES / "rows_good.jsonl", "-f", "rows", "-o", tmp_path / "ds")
    assert code == 2 and "already exists" in err
    assert (tmp_path / "ds" / "keep.txt").read_text() == "mine"


def test_unknown_format_and_missing_source(tmp_path, capsys):
    code, _, err = run_main(capsys, "import", FIXTURES / "rows_good.jsonl", "-f", "csv", "-o", tmp_path / "ds")
    assert code == 2 and "unknown import format 'csv'" in err
    code, _, err = run_main(capsys, "import", tmp_path / "nope.jsonl", "-f", "rows", "-o", tmp_path / "ds")
    assert code == 2 and "does not exist" in err


def test_unreadable_parquet_is_a_user_error(tmp_path):
    src = tmp_path / "broken.parquet"
    src.write_bytes(b"PAR1 not really")
    with pytest.raises(UserError, match="not a readable Parquet file"):
        import_dataset(ImportConfig(src, "rows", tmp_path / "ds"))


# --------------------------------------------------------------------------------------------
# text and --score-with


def test_text_refused_without_score_with(tmp_path, capsys, tiny):
    code, _, err = run_main(
        capsys, "import", FIXTURES / "text_good.jsonl", "-f", "text", "-o", tmp_path / "ds", "--tokenizer", tiny
    )
    assert code == 2 and "--score-with" in err and "log-probs" in err
    nothing_written(tmp_path / "ds")


def test_text_with_score_with(tmp_path, tiny):
    src = FIXTURES / "text_good.jsonl"
    summary = import_dataset(ImportConfig(src, "text", tmp_path / "ds", score_with=tiny, batch_size=4))
    assert (summary["rows"], summary["groups"], summary["logprobs_source"]) == (6, 3, "recomputed")
    rows = rows_of(tmp_path / "ds")
    # Lines 1-2 share the prompt "1+1=" (no group id), lines 3, 4, 6 have group id q7, line 5 is alone.
    groups = [(r[S.GROUP_ID], r[S.SAMPLE_INDEX], r[S.COMPLETION]) for r in rows]
    assert groups[2:5] == [("q7", 0, "4"), ("q7", 1, "5"), ("q7", 2, "")]
    assert groups[0][0] == groups[1][0] and groups[0][0].startswith("prompt-") and groups[5][0] != groups[0][0]
    assert [r[S.PROMPT_IDS] for r in rows[:2]] == [[5, 43, 5, 47]] * 2  # "1+1="
    # EOS appended to each completion; the empty completion is a lone EOS; line 5 (length) gets none.
    assert [r[S.COMPLETION_IDS] for r in rows] == [[6, EOS], [7, EOS], [8, EOS], [9, EOS], [EOS], [10]]
    assert rows[5][S.PROMPT] == "user: 3+3=\nassistant: "  # chat messages through the chat template
    assert rows[5][S.PROMPT_IDS] == CHAT_PREFIX + [7, 43, 7, 47] + CHAT_SUFFIX
    assert rows[5][S.FINISH_REASON] == "length"
    assert [r[S.REWARD] for r in rows] == [1.0, 0.0, 1.0, None, 0.0, 1.0]  # true -> 1.0, missing -> null
    assert json.loads(rows[0][S.META]) == {"answer": 2} and rows[5][S.META] == "{}"

    model = load_model(tiny, dtype="float32")
    for row in rows:
        expected = direct_logprobs(model, row[S.PROMPT_IDS], row[S.COMPLETION_IDS])
        assert row[S.BEHAVIOR_LOGPROBS] == pytest.approx(expected, abs=1e-5)

    manifest = clean(tmp_path / "ds")
    behavior = manifest[S.M_BEHAVIOR]
    assert behavior["logprobs_source"] == "recomputed" and behavior["logprobs_model"] == tiny
    assert behavior["tokenizer_hash"] and manifest[S.M_SOURCE]["options"]["score_with"] == tiny


def test_score_logprobs_is_batch_invariant(tiny):
    model, tokenizer = load_model(tiny, dtype="float32"), load_tokenizer(tiny)
    prompts = [[5, 43, 5, 47], [40, 21, 14, 33, 41, 22, 32, 41, 6, 43, 6, 48], [7]]
    completions = [[6, EOS], [8, 9, 10, 11, EOS], [EOS]]
    one = teacher_forced_logprobs(model, tokenizer, prompts, completions, batch_size=1)
    three = teacher_forced_logprobs(model, tokenizer, prompts, completions, batch_size=3)
    assert [len(x) for x in three] == [2, 5, 1]
    for a, b, p, c in zip(one, three, prompts, completions):
        assert a == pytest.approx(b, abs=1e-5)
        assert b == pytest.approx(direct_logprobs(model, p, c), abs=1e-5)
    # At temperature T the log-probs are those of softmax(logits / T).
    hot = teacher_forced_logprobs(model, tokenizer, prompts[:1], completions[:1], temperature=2.0)[0]
    with torch.no_grad():
        logits = model(torch.tensor([prompts[0] + completions[0]])).logits[0] / 2.0
    expected = [logits.log_softmax(-1)[3 + j, t].item() for j, t in enumerate(completions[0])]
    assert hot == pytest.approx(expected, abs=1e-5)


def test_rows_score_with_replaces_logprobs(tmp_path, tiny):
    import_dataset(ImportConfig(FIXTURES / "rows_good.jsonl", "rows", tmp_path / "ds", score_with=tiny))
    model = load_model(tiny, dtype="float32")
    for row in rows_of(tmp_path / "ds"):
        assert row[S.BEHAVIOR_LOGPROBS] == pytest.approx(
            direct_logprobs(model, row[S.PROMPT_IDS], row[S.COMPLETION_IDS]), abs=1e-5
        )
    assert clean(tmp_path / "ds")[S.M_BEHAVIOR]["logprobs_source"] == "recomputed"


def test_score_with_tokenizer_must_match(tmp_path, tiny):
    other = make_tiny_checkpoint(tmp_path / "other", alphabet="0123456789+=")
    with pytest.raises(UserError, match="differs from --tokenizer"):
        import_dataset(ImportConfig(FIXTURES / "text_good.jsonl", "text", tmp_path / "ds", tokenizer=tiny,
                                    score_with=other))
    nothing_written(tmp_path / "ds")


def test_text_column_flags(tmp_path, capsys, tiny):
    code, _, _ = run_main(capsys, "import", FIXTURES / "text_mapped.jsonl", "-f", "text", "-o", tmp_path / "ds",
                          "--score-with", tiny, "--prompt-column", "question", "--completion-column", "response",
                          "--reward-column", "score", "--group-column", "qid", "--no-append-eos")
    assert code == 0
    rows = rows_of(tmp_path / "ds")
    assert [(r[S.GROUP_ID], r[S.SAMPLE_INDEX], r[S.COMPLETION_IDS], r[S.REWARD]) for r in rows] == [
        ("7", 0, [6], 1.0),
        ("7", 1, [5, 5], 0.0),
    ]
    assert rows[0][S.META] == "{}"
    clean(tmp_path / "ds")


TEXT_BAD = {2: "missing-column", 3: "bad-value", 4: "bad-json", 5: "bad-value"}


def test_text_bad_lines(tmp_path, capsys, tiny):
    src = FIXTURES / "text_bad.jsonl"
    assert_bad_lines_refused(capsys, src, "text", tmp_path / "ds", TEXT_BAD, "--score-with", tiny)
    import_dataset(ImportConfig(src, "text", tmp_path / "ds", score_with=tiny, skip_bad=True))
    rows = rows_of(tmp_path / "ds")
    assert [(r[S.SAMPLE_INDEX], r[S.COMPLETION_IDS], r[S.REWARD]) for r in rows] == [
        (0, [6, EOS], 1.0),
        (1, [7, EOS], 0.0),
    ]
    assert_rejects_file(tmp_path / "ds", src, TEXT_BAD)
    clean(tmp_path / "ds")


def test_text_empty_completion_without_eos_is_bad(tmp_path, tiny):
    src = tmp_path / "empty.jsonl"
    src.write_text(json.dumps({"prompt": "1+1=", "completion": ""}) + "\n")
    with pytest.raises(BadLinesError) as info:
        import_dataset(ImportConfig(src, "text", tmp_path / "ds", score_with=tiny, append_eos=False))
    assert [(r.line, r.code) for r in info.value.rejects] == [(1, "empty-completion")]


# --------------------------------------------------------------------------------------------
# openai


def test_openai_good(tmp_path, tiny):
    src = FIXTURES / "openai_good.jsonl"
    summary = import_dataset(ImportConfig(src, "openai", tmp_path / "ds", tokenizer=tiny))
    assert (summary["rows"], summary["groups"]) == (5, 4)
    rows = rows_of(tmp_path / "ds")
    key = [(r[S.GROUP_ID], r[S.SAMPLE_INDEX], r[S.COMPLETION]) for r in rows]
    # The two choices of chatcmpl-1 form a group, ordered by their "index" (given as 1, 0).
    assert key == [
        ("chatcmpl-1", 0, "2"),
        ("chatcmpl-1", 1, "3"),
        ("chatcmpl-2", 0, "4"),
        ("cmpl-3", 0, "10"),
        ("cmpl-4", 0, "10"),
    ]
    assert rows[0][S.PROMPT] == "user: 1+1=\nassistant: "
    assert rows[0][S.PROMPT_IDS] == CHAT_PREFIX + [5, 43, 5, 47] + CHAT_SUFFIX
    # Token strings mapped through the vocabulary: "2" -> 6, "3" -> 7, "</s>" -> 2; "token_id:8" -> 8.
    assert [r[S.COMPLETION_IDS] for r in rows] == [[6, EOS], [7, EOS], [8], [5, 4, EOS], [5, 4, EOS]]
    assert [r[S.BEHAVIOR_LOGPROBS] for r in rows] == [
        [-0.5, -0.125],
        [-1.5, -0.25],
        [-0.75],
        [-0.5, -1.0, -0.0625],
        [-0.25, -0.5, -1.0],
    ]
    # Rewards: a per-choice list in index order, a scalar for one choice, none.
    assert [r[S.REWARD] for r in rows] == [1.0, 0.0, 1.0, None, None]
    assert [r[S.FINISH_REASON] for r in rows] == ["stop", "stop", "length", "stop", "stop"]
    assert rows[2][S.PROMPT_IDS] == CHAT_PREFIX + [6, 43, 6, 47] + CHAT_SUFFIX  # flat form, "messages" on the line
    assert json.loads(rows[2][S.META]) == {"answer": 4}
    assert rows[3][S.PROMPT] == "5+5=" and rows[3][S.PROMPT_IDS] == [9, 43, 9, 47]  # completions API prompt
    assert rows[4][S.PROMPT_IDS] == [1, 13, 43, 5, 47]  # the server's prompt_token_ids win
    assert [r[S.BEHAVIOR] for r in rows] == ["tiny"] * 4 + ["tiny-v2"]
    manifest = clean(tmp_path / "ds")
    behavior = manifest[S.M_BEHAVIOR]
    assert behavior["model"] is None  # two models in the log
    assert behavior["sampling"]["temperature"] == 1.0 and behavior["logprobs_source"] == "unknown"


def test_openai_keep_messages(tmp_path, tiny):
    """--keep-messages adds each chat call's request messages to its meta; completions-API lines have none."""
    src = FIXTURES / "openai_good.jsonl"
    import_dataset(ImportConfig(src, "openai", tmp_path / "ds", tokenizer=tiny, keep_messages=True))
    metas = [json.loads(r[S.META]) for r in rows_of(tmp_path / "ds")]
    requests = [json.loads(line) for line in src.read_text().splitlines()]
    assert metas[0][S.META_MESSAGES] == requests[0]["request"]["messages"] == [{"role": "user", "content": "1+1="}]
    assert metas[1] == metas[0]  # both choices of the call
    assert metas[2] == {"answer": 4, S.META_MESSAGES: requests[1]["messages"]}  # the flat form, meta kept
    assert S.META_MESSAGES not in metas[3] and S.META_MESSAGES not in metas[4]  # completions API: a prompt only
    import_dataset(ImportConfig(src, "openai", tmp_path / "plain", tokenizer=tiny))
    assert all(S.META_MESSAGES not in json.loads(r[S.META]) for r in rows_of(tmp_path / "plain"))


def test_openai_group_by_prompt(tmp_path, tiny):
    line = json.loads((FIXTURES / "openai_good.jsonl").read_text().splitlines()[1])  # chatcmpl-2, one choice
    second = {**line, "id": "chatcmpl-9", "reward": 0}
    src = tmp_path / "two.jsonl"
    src.write_text(json.dumps(line) + "\n" + json.dumps(second) + "\n")
    import_dataset(ImportConfig(src, "openai", tmp_path / "lines", tokenizer=tiny))
    assert [r[S.GROUP_ID] for r in rows_of(tmp_path / "lines")] == ["chatcmpl-2", "chatcmpl-9"]
    import_dataset(ImportConfig(src, "openai", tmp_path / "prompt", tokenizer=tiny, group_by_prompt=True))
    rows = rows_of(tmp_path / "prompt")
    assert len({r[S.GROUP_ID] for r in rows}) == 1 and [r[S.SAMPLE_INDEX] for r in rows] == [0, 1]
    assert [r[S.REWARD] for r in rows] == [1.0, 0.0]
    clean(tmp_path / "prompt")


OPENAI_BAD = {2: "unknown-token", 3: "nonfinite-logprob", 4: "positive-logprob", 5: "length-mismatch",
              6: "empty-completion", 7: "no-logprobs", 8: "duplicate", 9: "bad-json", 10: "unknown-token"}


def test_openai_bad_lines(tmp_path, capsys, tiny):
    src = FIXTURES / "openai_bad.jsonl"
    assert_bad_lines_refused(capsys, src, "openai", tmp_path / "ds", OPENAI_BAD, "--tokenizer", tiny)
    import_dataset(ImportConfig(src, "openai", tmp_path / "ds", tokenizer=tiny, skip_bad=True))
    rows = rows_of(tmp_path / "ds")
    assert [(r[S.GROUP_ID], r[S.COMPLETION_IDS], r[S.BEHAVIOR_LOGPROBS]) for r in rows] == [
        ("r1", [6, EOS], [-0.5, -0.125])
    ]
    assert_rejects_file(tmp_path / "ds", src, OPENAI_BAD)
    clean(tmp_path / "ds")


def test_openai_needs_a_tokenizer(tmp_path):
    with pytest.raises(UserError, match="--tokenizer"):
        import_dataset(ImportConfig(FIXTURES / "openai_good.jsonl", "openai", tmp_path / "ds"))


def test_token_strings_map_through_the_tokenizer_spelling():
    # Byte-level BPE stores " the" as "Ġthe"; servers return the decoded text " the".
    bpe = build_bpe_tokenizer(["the cat sat on the mat"] * 20, vocab_size=300)
    to_id = token_string_mapper(bpe)
    the = bpe.convert_tokens_to_ids("Ġthe")
    assert the != bpe.unk_token_id
    assert to_id(" the") == the
    assert to_id("Ġthe") == the  # a server that returns vocabulary entries
    assert to_id("token_id:17") == 17
    assert to_id(" zebra-not-a-token") is None
    # SentencePiece-style vocabularies spell a leading space "▁".
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({"<unk>": 0, "\u2581the": 1, "the": 2}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Metaspace()
    core.decoder = decoders.Metaspace()
    sp_to_id = token_string_mapper(PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>"))
    assert (sp_to_id(" the"), sp_to_id("the"), sp_to_id("\u2581the")) == (1, 2, 1)


# --------------------------------------------------------------------------------------------
# trl


def test_trl_good_jsonl_and_parquet(tmp_path, tiny):
    import_dataset(ImportConfig(FIXTURES / "trl_good.jsonl", "trl", tmp_path / "j", score_with=tiny))
    import_dataset(ImportConfig(FIXTURES / "trl_good.parquet", "trl", tmp_path / "p", score_with=tiny))
    rows = rows_of(tmp_path / "j")
    # Groups: consecutive rows with the same (step, prompt): lines 1-2, line 3, lines 4-5.
    assert [(r[S.GROUP_ID], r[S.SAMPLE_INDEX]) for r in rows] == [
        ("step0-trl_good.jsonl:1", 0), ("step0-trl_good.jsonl:1", 1), ("step0-trl_good.jsonl:3", 0),
        ("step1-trl_good.jsonl:4", 0), ("step1-trl_good.jsonl:4", 1)]
    # reward = accuracy + format, nulls skipped: 1+0.5, 0+0.5, 1+null, 0+0.25, null+null.
    assert [r[S.REWARD] for r in rows] == [1.5, 0.5, 1.0, 0.25, None]
    assert [r[S.POLICY_VERSION] for r in rows] == [0, 0, 0, 1, 1]
    assert [r[S.COMPLETION_IDS] for r in rows] == [[6, EOS], [7, EOS], [8, EOS], [9, EOS], [8, EOS]]
    assert json.loads(rows[0][S.META]) == {"mode": "train", "reward_components": {"accuracy": 1.0, "format": 0.5}}
    parquet_rows = rows_of(tmp_path / "p")
    assert [{k: v for k, v in r.items() if k != S.GROUP_ID} for r in parquet_rows] == [
        {k: v for k, v in r.items() if k != S.GROUP_ID} for r in rows
    ]
    clean(tmp_path / "j")
    clean(tmp_path / "p")


def test_trl_reward_columns_flag(tmp_path, capsys, tiny):
    code, _, _ = run_main(capsys, "import", FIXTURES / "trl_good.jsonl", "-f", "trl", "-o", tmp_path / "ds",
                          "--score-with", tiny, "--reward-columns", "accuracy")
    assert code == 0
    assert [r[S.REWARD] for r in rows_of(tmp_path / "ds")] == [1.0, 0.0, 1.0, 0.0, None]
    code, _, err = run_main(capsys, "import", FIXTURES / "trl_good.jsonl", "-f", "trl", "-o", tmp_path / "x",
                            "--score-with", tiny, "--reward-columns", "nope")
    assert code == 2 and "nope" in err


TRL_BAD = {2: "missing-column", 3: "bad-value", 4: "bad-value", 5: "bad-json"}


def test_trl_bad_lines(tmp_path, capsys, tiny):
    src = FIXTURES / "trl_bad.jsonl"
    assert_bad_lines_refused(capsys, src, "trl", tmp_path / "ds", TRL_BAD, "--score-with", tiny)
    import_dataset(ImportConfig(src, "trl", tmp_path / "ds", score_with=tiny, skip_bad=True))
    rows = rows_of(tmp_path / "ds")
    # Lines 1 and 6 have the same (step, prompt) and, the bad lines set aside, are consecutive.
    assert [(r[S.SAMPLE_INDEX], r[S.REWARD]) for r in rows] == [(0, 1.5), (1, 0.5)]
    assert_rejects_file(tmp_path / "ds", src, TRL_BAD)
    clean(tmp_path / "ds")


def test_import_leaves_the_source_untouched(tmp_path, tiny):
    before = tree_digest(FIXTURES)
    import_dataset(ImportConfig(FIXTURES / "openai_bad.jsonl", "openai", tmp_path / "ds", tokenizer=tiny,
                                skip_bad=True))
    assert tree_digest(FIXTURES) == before
