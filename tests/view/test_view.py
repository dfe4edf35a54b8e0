"""`offline-rec view`: the page builder (escaping, token bytes, the group index, paging, advantages and the clip
mask with --model), its page files and its local server. The page in a real browser: test_view_browser.py."""

from __future__ import annotations

import json
import math
import threading
import urllib.error
import urllib.request
from html.parser import HTMLParser

import pyarrow.parquet as pq
import pytest
from support.cli_support import run_cli
from support.datagen import make_rows, write_dataset
from support.processes import interruptible
from support.view_support import SCRIPT_COMPLETION, SHIFT_DOWN, SHIFT_UP, write_view_dataset

from offline_rec import schema as S
from offline_rec.errors import UserError
from offline_rec.view.config import ViewConfig
from offline_rec.view.page import open_view, page_file_text, script_json, write_view
from offline_rec.view.page_data import (
    HEX,
    NO_SIGNAL,
    SIGNAL,
    SPECIAL,
    TEXT,
    UNKNOWN,
    UNREWARDED,
    TokenText,
    byte_segments,
)


@pytest.fixture(scope="module")
def view_data(vllm_tiny_model, tmp_path_factory):
    """(dataset path, plan, model folder): the viewer's test dataset over the session's chat checkpoint."""
    path, plan = write_view_dataset(tmp_path_factory.mktemp("view") / "ds", vllm_tiny_model)
    return path, plan, vllm_tiny_model


def _config(path, tmp_path, **options) -> ViewConfig:
    return ViewConfig(dataset=path, out=tmp_path / "page.html", groups_per_page=2, **options)


def _rows(view) -> dict[tuple[str, int], dict]:
    """Every row of every page, by (group id, sample index)."""
    found = {}
    for number in range(view.num_pages):
        for group in view.page(number)["groups"]:
            for row in group["rows"]:
                found[(group["id"], row["sample"])] = row
    return found


def _bytes_of(shown) -> bytes:
    """The bytes a token's shown text stands for (text as UTF-8, hex segments as their bytes)."""
    if isinstance(shown, str):
        return shown.encode("utf-8")
    return b"".join(bytes.fromhex(value) if kind == HEX else value.encode("utf-8") for kind, value in shown)


# --------------------------------------------------------------------------------------------
# token text


def test_byte_segments_show_partial_characters_as_their_bytes():
    assert byte_segments("你".encode()) == "你"  # e4 bd a0: whole
    assert byte_segments(b"\xe4\xbd") == [[HEX, "e4 bd"]]  # a character's first two bytes
    assert byte_segments(b"\xa0") == [[HEX, "a0"]]  # its last byte alone
    assert byte_segments(b" \xf0\x9f") == [[TEXT, " "], [HEX, "f0 9f"]]  # a space and half an emoji
    assert byte_segments(b"\x98\x80ok") == [[HEX, "98 80"], [TEXT, "ok"]]  # the emoji's end, then text
    assert byte_segments(b"a\xffb") == [[TEXT, "a"], [HEX, "ff"], [TEXT, "b"]]  # never valid anywhere
    assert byte_segments(b"") == ""


def test_token_text_gives_back_every_byte_of_non_ascii_text(view_data):
    from offline_rec.models.loading import load_tokenizer

    tokenizer = load_tokenizer(view_data[2])
    text = TokenText(tokenizer)
    for sample in ("你好，世界！🎉🚀", "مرحبا", "Grüße €"):
        ids = tokenizer(sample, add_special_tokens=False)["input_ids"]
        shown = [text(token) for token in ids]
        assert b"".join(_bytes_of(s) for s in shown) == sample.encode("utf-8")
    partial = [text(t) for t in tokenizer("🎉", add_special_tokens=False)["input_ids"]]
    assert any(not isinstance(s, str) for s in partial)  # the emoji is cut inside its bytes: shown as hex
    assert "\ufffd" not in json.dumps(partial, ensure_ascii=False)  # never a replacement character
    assert text(tokenizer.eos_token_id) == [[SPECIAL, "<|im_end|>"]]
    assert text(len(tokenizer) + 5) == [[UNKNOWN, f"#{len(tokenizer) + 5}"]]
    assert TokenText(None)(7) == [[UNKNOWN, "#7"]]


def test_token_text_of_sentencepiece_byte_fallback_pieces():
    from support.tokenizer_support import byte_fallback_sentencepiece

    sp = byte_fallback_sentencepiece()
    text = TokenText(sp)
    ids = sp("x 文a")["input_ids"]  # x ▁ <0xE6> <0x96> <0x87> a
    assert [text(token) for token in ids] == ["x", " ", [[HEX, "e6"]], [[HEX, "96"]], [[HEX, "87"]], "a"]
    assert text(sp.convert_tokens_to_ids("\u2581x")) == " x"  # ▁ is a space
    assert text(sp.eos_token_id) == [[SPECIAL, "</s>"]]


# --------------------------------------------------------------------------------------------
# escaping


def test_script_json_cannot_end_its_script_element():
    value = {"text": "</script><script>alert(1)</script> & <!-- \u2028\u2029 'quotes' \"double\""}
    encoded = script_json(value)
    for raw in ("<", ">", "&", "\u2028", "\u2029"):
        assert raw not in encoded
    assert json.loads(encoded) == value  # the same data back


class _Scripts(HTMLParser):
    """The <script> elements of a page: (attributes, text)."""

    def __init__(self):
        super().__init__()
        self.scripts, self._open = [], None

    def handle_starttag(self, tag, attrs):
        if tag == "script":
            self._open = (dict(attrs), [])

    def handle_data(self, data):
        if self._open is not None:
            self._open[1].append(data)

    def handle_endtag(self, tag):
        if tag == "script" and self._open is not None:
            self.scripts.append((self._open[0], "".join(self._open[1])))
            self._open = None


def test_data_enters_the_page_as_inert_json(view_data, tmp_path):
    path, _, _ = view_data
    config = ViewConfig(dataset=path, out=tmp_path / "page.html", groups_per_page=2, inline_pages=4)
    write_view(config, progress=False)
    page = (tmp_path / "page.html").read_text(encoding="utf-8")
    parser = _Scripts()
    parser.feed(page)
    kinds = [attrs.get("type") for attrs, _ in parser.scripts]
    # meta, index, 4 inline pages, then the two scripts of the page itself: nothing else became a script
    assert kinds == ["application/json"] * 6 + [None, None]
    assert page.count("<script") == 8
    data = [json.loads(text) for attrs, text in parser.scripts if attrs.get("type") == "application/json"]
    completions = [row["completion"] for payload in data[2:] for group in payload["groups"] for row in group["rows"]]
    assert SCRIPT_COMPLETION in completions  # the data is all there, unchanged
    outside = page
    for attrs, text in parser.scripts:
        if attrs.get("type") == "application/json":
            outside = outside.replace(text, "")
    assert "pwned" not in outside and "pwned" in page  # only inside the JSON blocks


def test_the_title_escapes_the_dataset_name(tmp_path):
    write_dataset(tmp_path / "<b>x&y", make_rows([2]))
    write_view(ViewConfig(dataset=tmp_path / "<b>x&y", out=tmp_path / "p.html"), progress=False)
    assert "<title>offline-rec view: &lt;b&gt;x&amp;y</title>" in (tmp_path / "p.html").read_text(encoding="utf-8")


# --------------------------------------------------------------------------------------------
# the index and pages


def test_group_index_worked_out_by_hand(tmp_path):
    groups = make_rows([3, 2, 1, 2], rewards=[[1.0, 0.0, 0.5], [1.0, 1.0], [0.0], [None, 1.0]],
                       completion_lengths=[[2, 5, 3], [4, 4], [7], [1, 9]],
                       finish_reasons=[["stop", "length", "stop"], ["stop", "stop"], ["length"], ["stop", "stop"]])
    path = write_dataset(tmp_path / "ds", groups, groups_per_shard=3)  # shards: groups 0-2, group 3
    view = open_view(ViewConfig(dataset=path, out=tmp_path / "p.html", groups_per_page=2))
    index = view.index.to_json()
    assert index["size"] == [3, 2, 1, 2]
    assert index["rewardMean"] == [0.5, 1.0, 0.0, None]
    assert index["rewardMin"] == [0.0, 1.0, 0.0, None] and index["rewardMax"] == [1.0, 1.0, 0.0, None]
    assert index["lengthMin"] == [2, 4, 7, 1] and index["lengthMax"] == [5, 4, 7, 9]
    assert index["reasons"] == ["stop", "length"]  # bits 1 and 2, in order of appearance
    assert index["finish"] == [3, 1, 2, 1]
    assert index["signal"] == [SIGNAL, NO_SIGNAL, NO_SIGNAL, UNREWARDED]  # equal rewards / one row: no signal
    assert index["pageStarts"] == [0, 2, 3]  # a page never spans shards
    assert [location for _, location in view.index.pages] == [(0, 0, 5), (0, 5, 6), (1, 0, 2)]
    rows = _rows(view)
    assert [rows[("g0000", i)]["advantage"] for i in range(3)] == [0.5, -0.5, 0.0]  # r - mean
    assert rows[("g0002", 0)]["advantage"] == 0.0  # a group of one: no baseline
    assert rows[("g0003", 1)]["advantage"] is None  # a reward missing in the group


def test_pages_read_only_their_row_groups_and_match_a_full_read(tmp_path):
    groups = make_rows([3, 1, 4, 2, 2], seed=4)
    path = write_dataset(tmp_path / "ds", groups, groups_per_shard=5)
    shard = next((path / S.DATA_DIR).glob("*.parquet"))
    table = pq.read_table(shard)
    pq.write_table(table, shard, row_group_size=2)  # row groups cut across the groups
    view = open_view(ViewConfig(dataset=path, out=tmp_path / "p.html", groups_per_page=2))
    assert pq.ParquetFile(shard).num_row_groups == 6
    read = [row for number in range(view.num_pages) for row in view.reader.rows(number)]
    assert read == table.to_pylist()
    assert [len(view.reader.rows(n)) for n in range(view.num_pages)] == [4, 6, 2]


def test_out_writes_inline_pages_and_page_files(view_data, tmp_path):
    path, plan, _ = view_data
    summary = write_view(_config(path, tmp_path), progress=False)
    assert summary["pages"] == 4 and summary["groups"] == len(plan)
    folder = tmp_path / "page_files"
    assert sorted(p.name for p in folder.iterdir()) == ["page-00001.js", "page-00002.js", "page-00003.js"]
    view = open_view(_config(path, tmp_path))
    for number in (1, 2, 3):
        text = (folder / f"page-{number:05d}.js").read_text(encoding="utf-8")
        assert text == page_file_text(number, view.page(number))
        prefix = f"offlineRecViewPage({number},"
        assert text.startswith(prefix) and text.endswith(");\n") and "<" not in text
        assert json.loads(text[len(prefix):-3]) == view.page(number)
    page = (tmp_path / "page.html").read_text(encoding="utf-8")
    assert 'id="view-page-0"' in page and 'id="view-page-1"' not in page
    # a second page of the same name replaces the first one's page files
    write_view(ViewConfig(dataset=path, out=tmp_path / "page.html", groups_per_page=2, inline_pages=4),
               progress=False)
    assert not folder.exists()


def test_a_group_carries_its_prompt_once(tmp_path):
    groups = make_rows([3])
    groups[0][2]["prompt"] = "another prompt \u202e"
    path = write_dataset(tmp_path / "ds", groups)
    (group,) = open_view(ViewConfig(dataset=path, out=tmp_path / "p.html")).page(0)["groups"]
    assert group["prompt"] == groups[0][0]["prompt"]
    assert [row["prompt"] for row in group["rows"]] == [None, None, "another prompt \u202e"]


def test_tokens_ids_masks_and_advantages_without_a_model(view_data, tmp_path):
    path, plan, _ = view_data
    rows = _rows(open_view(_config(path, tmp_path)))
    for group in plan:
        for planned in group:
            row = rows[(planned.group, planned.sample)]
            assert row["ids"] == planned.completion_ids
            assert row["lossMask"] == planned.loss_mask
            assert "policyLogp" not in row and "dropped" not in row
    assert rows[("g-cjk", 0)]["advantage"] == 0.5 and rows[("g-cjk", 1)]["advantage"] == -0.5
    assert rows[("g-tool", 0)]["advantage"] == 0.125 and rows[("g-tool", 1)]["advantage"] == -0.125
    assert rows[("g-cut", 0)]["advantage"] is None and rows[("g-cut", 0)]["finish"] == S.FINISH_LENGTH


def test_with_a_model_ratios_and_the_clip_mask(view_data, tmp_path):
    """Behavior log-probs are the model's own, lowered by log 2 on SHIFT_UP (rho = 2) and raised on SHIFT_DOWN
    (rho = 1/2). rec-oneside (eps 0.2) keeps A >= 0 where rho <= 1.2 and A <= 0 where rho >= 0.8: it drops
    SHIFT_UP tokens of rows with A > 0, SHIFT_DOWN tokens of rows with A < 0, nothing at A = 0 and no environment
    token (loss_mask 0), although the episode's first one has rho = 2 too."""
    path, plan, model = view_data
    view = open_view(_config(path, tmp_path, model=model))
    rows = _rows(view)
    for group in plan:
        for planned in group:
            row = rows[(planned.group, planned.sample)]
            log_ratio = [p - b for p, b in zip(row["policyLogp"], row["logp"])]
            for position, value in enumerate(log_ratio):
                shifted = position in SHIFT_UP or position in planned.env_positions[:1]
                expected = math.log(2) if shifted else -math.log(2) if position in SHIFT_DOWN else 0.0
                assert value == pytest.approx(expected, abs=2e-3)  # page values have 3 decimals
            advantage = row["advantage"]
            if advantage is None:
                assert "dropped" not in row  # no advantage, no clip mask
                continue
            expected = list(SHIFT_UP) if advantage > 0 else list(SHIFT_DOWN) if advantage < 0 else []
            assert row["dropped"] == expected, (planned.group, planned.sample)
    assert rows[("g-tool", 0)]["lossMask"][14] == 0 and 14 not in rows[("g-tool", 0)]["dropped"]
    # a two-sided clip also drops rho = 2 where A < 0
    two_side = _rows(open_view(_config(path, tmp_path, model=model, algorithm="rec-twoside-nois")))
    assert two_side[("g-cjk", 1)]["dropped"] == sorted([*SHIFT_UP, *SHIFT_DOWN])


def test_an_unloadable_behavior_model_shows_token_ids_with_a_warning(tmp_path):
    path = write_dataset(tmp_path / "ds", make_rows([2]),
                         behavior=S.behavior_provenance(model=str(tmp_path / "gone")))
    warnings = []
    view = open_view(ViewConfig(dataset=path, out=tmp_path / "p.html"), warn=warnings.append)
    assert len(warnings) == 1 and "tokens are shown by id" in warnings[0]
    payload = view.page(0)
    first = payload["groups"][0]["rows"][0]["ids"][0]
    assert payload["text"][str(first)] == [[UNKNOWN, f"#{first}"]]


def test_data_the_policy_cannot_score_is_refused_in_one_line(vllm_tiny_model, tmp_path):
    groups = make_rows([2, 2], vocab_size=50)
    groups[1][0]["completion_ids"][0] = 5000  # beyond the chat model's 1200 embeddings
    path = write_dataset(tmp_path / "ds", groups, groups_per_shard=1)
    view = open_view(ViewConfig(dataset=path, out=tmp_path / "p.html", model=vllm_tiny_model))
    assert "policyLogp" in view.page(0)["groups"][0]["rows"][0]
    with pytest.raises(UserError, match="token id 5000 but .* has 1200 embeddings"):
        view.page(1)
    groups = make_rows([1], vocab_size=50, prompt_lengths=[[0]])
    path = write_dataset(tmp_path / "empty", groups)
    view = open_view(ViewConfig(dataset=path, out=tmp_path / "p.html", model=vllm_tiny_model))
    with pytest.raises(UserError, match="sample 0: empty prompt"):
        view.page(0)


# --------------------------------------------------------------------------------------------
# options and errors


@pytest.mark.parametrize("options, message", [
    (dict(), "exactly one of --out"),
    (dict(out="p.html", serve=True), "exactly one of --out"),
    (dict(out="page.txt"), "ending in .html"),
    (dict(out="p.html", algorithm="ppo"), "unknown algorithm 'ppo'"),
    (dict(out="p.html", groups_per_page=0), "--groups-per-page must be >= 1"),
    (dict(serve=True, port=70000), "--port must be in 0..65535"),
    (dict(out="p.html", temperature=0.0), "--temperature must be > 0"),
])
def test_bad_options_are_one_line_errors(options, message):
    with pytest.raises(UserError, match=message):
        ViewConfig(dataset="ds", **options)


def test_cli_errors_exit_2(capsys, tmp_path):
    code, _, err = run_cli(capsys, "view", tmp_path / "missing", "--out", tmp_path / "p.html")
    assert code == 2 and "does not exist" in err
    write_dataset(tmp_path / "ds", make_rows([2]))
    code, _, err = run_cli(capsys, "view", tmp_path / "ds", "--model", tmp_path / "nope", "--out", tmp_path / "p.html")
    assert code == 2 and f"model {tmp_path / 'nope'} does not exist" in err
    code, out, _ = run_cli(capsys, "view", tmp_path / "ds", "--out", tmp_path / "p.html", "-q")
    assert code == 0 and "1 groups, 1 pages" in out and (tmp_path / "p.html").exists()


# --------------------------------------------------------------------------------------------
# --serve


def test_the_serve_command_announces_its_address_and_stops_on_ctrl_c(tmp_path):
    import os
    import signal
    import subprocess
    import sys

    from support.paths import REPO

    write_dataset(tmp_path / "ds", make_rows([2, 2]))
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO))
    server = subprocess.Popen([sys.executable, "-m", "offline_rec", "view", str(tmp_path / "ds"), "--serve", "--port",
                               "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                              preexec_fn=interruptible)
    try:
        line = server.stdout.readline()
        url = line.split(" on ", 1)[1].split()[0]
        assert url.startswith("http://127.0.0.1:") and "2 groups" in line
        with urllib.request.urlopen(url + "pages/0", timeout=30) as response:
            assert [g["id"] for g in json.loads(response.read())["groups"]] == ["g0000", "g0001"]
    finally:
        server.send_signal(signal.SIGINT)
        assert server.wait(timeout=30) == 0, server.stderr.read()


def test_serve_answers_the_page_and_pages_as_json_on_loopback(view_data, tmp_path):
    from offline_rec.view.serve import make_server

    path, _, _ = view_data
    view = open_view(ViewConfig(dataset=path, serve=True, port=0, groups_per_page=2))
    server = make_server(view, "127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with urllib.request.urlopen(base + "/", timeout=10) as response:
            page = response.read().decode("utf-8")
            assert response.headers["Content-Type"] == "text/html; charset=utf-8"
        parser = _Scripts()
        parser.feed(page)
        assert json.loads(parser.scripts[0][1])["serve"] is True
        assert 'id="view-page-0"' in page and 'id="view-page-1"' not in page  # page 0 inline, the rest asked for
        with urllib.request.urlopen(base + "/pages/2", timeout=10) as response:
            assert json.loads(response.read()) == view.page(2)
        for bad, status in (("/pages/4", 404), ("/../manifest.json", 404)):
            with pytest.raises(urllib.error.HTTPError) as error:
                urllib.request.urlopen(base + bad, timeout=10)
            assert error.value.code == status
        rebound = urllib.request.Request(base + "/pages/0", headers={"Host": "attacker.example:80"})
        with pytest.raises(urllib.error.HTTPError) as error:
            urllib.request.urlopen(rebound, timeout=10)
        assert error.value.code == 403
    finally:
        server.shutdown()
        server.server_close()


def test_a_server_bound_elsewhere_on_purpose_answers_any_host(tmp_path):
    from offline_rec.view.serve import make_server

    write_dataset(tmp_path / "ds", make_rows([2]))
    view = open_view(ViewConfig(dataset=tmp_path / "ds", serve=True))
    server = make_server(view, "127.0.0.2", 0)  # as --host 0.0.0.0 or a LAN address would be, on the loopback
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        request = urllib.request.Request(f"http://127.0.0.2:{server.server_address[1]}/pages/0",
                                         headers={"Host": "viewer.lab.example"})
        with urllib.request.urlopen(request, timeout=10) as response:
            assert json.loads(response.read())["groups"][0]["id"] == "g0000"
    finally:
        server.shutdown()
        server.server_close()


def test_every_page_can_be_a_page_file(view_data, tmp_path):
    path, _, _ = view_data
    summary = write_view(_config(path, tmp_path, inline_pages=0), progress=False)
    assert sorted(p.name for p in (tmp_path / "page_files").iterdir()) == [f"page-{n:05d}.js" for n in range(4)]
    assert 'id="view-page-' not in (tmp_path / "page.html").read_text(encoding="utf-8")
    assert summary["page_files"] == str(tmp_path / "page_files")


def test_the_scoring_temperature_defaults_to_the_data_and_can_be_given(view_data, tmp_path):
    from offline_rec.models.loading import load_model, load_tokenizer
    from offline_rec.models.teacher_forced import teacher_forced_logprobs

    path, plan, model = view_data
    data = open_view(_config(path, tmp_path, model=model))
    hot = open_view(_config(path, tmp_path, model=model, temperature=2.0))
    assert data.facts["temperature"] == 1.0 and hot.facts["temperature"] == 2.0  # the manifest says 1.0
    row = _rows(hot)[("g-cut", 0)]
    assert data.reader.rows(1)[0][S.GROUP_ID] == "g-cut"
    group = next(rows for rows in data.page(1)["groups"] if rows["id"] == "g-cut")
    expected = teacher_forced_logprobs(load_model(model, dtype="float32"), load_tokenizer(model),
                                       [data.reader.rows(1)[0][S.PROMPT_IDS]], [row["ids"]], temperature=2.0)[0]
    assert row["policyLogp"] == pytest.approx(expected, abs=1e-3)
    assert row["policyLogp"] != pytest.approx(group["rows"][0]["policyLogp"], abs=1e-2)
