"""`offline-rec reward --judge`: an LLM judge over an OpenAI-compatible endpoint. Against a fake local endpoint
that misbehaves on purpose (500s, 429s, timeouts, garbage, dropped connections): every row kept, each failure a
counted null, the audit file complete, the API key in no file, no traceback; the bad-input matrix (unknown rubric
field before any call, a refusing endpoint: one line, exit 2); and the real vLLM server under constrained choice."""

from __future__ import annotations

import asyncio
import json
import threading
from collections import Counter

import pytest
from support.cli_support import run_cli
from support.datagen import write_dataset
from support.ports import free_port

from offline_rec import schema as S
from offline_rec.dataset.format import make_row, open_dataset
from offline_rec.rewards.judge import JudgeSettings, parse_score

RUBRIC = "Rate the answer from 1 to 5 for the user {user}.\nQuestion: {prompt}\nANSWER: {completion}\nScore:"
SECRET = "sk-test-not-for-files-123"

# completion -> what the fake judge does; and the score it ends with (None: a counted null).
BEHAVIOURS = {
    "ok-3": 3.0, "flaky500": 4.0, "rate429": 2.0,                # group a
    "always500": None, "slow": None, "garbage-body": None,       # group b: failed calls
    "garbage-answer": None, "out-of-range": None,                # group c: answers without a valid score ...
    "drop-once": 4.0, "drop-always": None, "ok-5": 5.0,          # ... dropped connections, a plain one
}


class FakeJudge:
    """An aiohttp chat-completions endpoint in a thread; the ANSWER line of the prompt picks its behaviour."""

    def __init__(self, status_for_all: int | None = None):
        from aiohttp import web

        self.status_for_all = status_for_all
        self.seen: Counter = Counter()
        self.requests: list[tuple[dict, dict]] = []
        self.loop = asyncio.new_event_loop()
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.handle)
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.port = self.runner.addresses[0][1]
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    async def handle(self, request):
        from aiohttp import web

        body = await request.json()
        self.requests.append((dict(request.headers), body))
        if self.status_for_all:
            return web.json_response({"error": "no"}, status=self.status_for_all)
        kind = body["messages"][0]["content"].split("ANSWER: ")[1].split("\n")[0]
        n = self.seen[kind]
        self.seen[kind] += 1

        def answer(text):
            return web.json_response({"choices": [{"message": {"role": "assistant", "content": text}}]})

        if kind.startswith("ok-"):
            return answer(kind[3:])
        if kind == "flaky500":
            return web.json_response({"error": "busy"}, status=500) if n == 0 else answer("4")
        if kind == "rate429":
            return web.Response(status=429, headers={"Retry-After": "0"}) if n == 0 else answer("2")
        if kind == "always500":
            return web.json_response({"error": "down"}, status=503)
        if kind == "slow":
            await asyncio.sleep(1.0)
            return answer("5")
        if kind == "garbage-body":
            return web.Response(text="<html>proxy error</html>", status=200)
        if kind == "garbage-answer":
            return answer("I cannot decide.")
        if kind == "out-of-range":
            return answer("9")
        if kind.startswith("drop"):
            if kind == "drop-always" or n == 0:
                request.transport.close()
                return web.Response(text="")
            return answer("4")
        raise AssertionError(kind)

    def close(self):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def fake():
    server = FakeJudge()
    yield server
    server.close()


def judged_groups(kinds_per_group) -> list[list[dict]]:
    return [[make_row(group_id=f"g{g}", sample_index=i, prompt=f"Combien font {g}+{i} ? 😀", prompt_ids=[4, 5],
                      completion=kind, completion_ids=[6], behavior_logprobs=[-1.0], behavior="prod",
                      meta={"user": f"zoë-{g}"}) for i, kind in enumerate(kinds)]
            for g, kinds in enumerate(kinds_per_group)]


@pytest.fixture
def logged(tmp_path):
    kinds = list(BEHAVIOURS)
    groups = judged_groups([kinds[:3], kinds[3:6], kinds[6:]])
    return write_dataset(tmp_path / "logged", groups, groups_per_shard=2)


@pytest.fixture
def rubric(tmp_path):
    path = tmp_path / "rubric.txt"
    path.write_text(RUBRIC, encoding="utf-8")
    return path


def judge_args(url, rubric, out, *extra):
    return ["--judge", url, "--judge-model", "judge-m", "--rubric", rubric, "--out", out, "--judge-retries", 2,
            "--judge-timeout", 0.3, "--judge-concurrency", 4, "--judge-api-key-env", "JUDGE_KEY", "-q", *extra]


def test_faults_are_counted_nulls_and_nothing_is_lost(fake, logged, rubric, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("JUDGE_KEY", SECRET)
    code, out, err = run_cli(capsys, "reward", logged, *judge_args(fake.url, rubric, tmp_path / "judged"))
    assert code == 0, err
    assert "rewarded 5/11 rows in 3 groups" in out and "Traceback" not in out + err
    assert "failed calls 4, answers without a score 2; retries 9" in out
    rows = open_dataset(tmp_path / "judged").to_table().to_pylist()
    assert {r[S.COMPLETION]: r[S.REWARD] for r in rows} == BEHAVIOURS  # every row there, nulls never a silent 0
    manifest = open_dataset(tmp_path / "judged").manifest
    assert manifest[S.M_STATS]["reward"]["judge"] == {"calls": 11, "scored": 5, "failed": 4, "unparsed": 2,
                                                      "retries": 9}
    assert manifest[S.M_TASK]["judge"]["model"] == "judge-m" and manifest[S.M_TASK]["judge"]["rubric"] == RUBRIC
    audit = [json.loads(line) for line in (tmp_path / "judged" / "judge-audit.jsonl").read_text().splitlines()]
    assert sorted((a["group_id"], a["sample_index"]) for a in audit) == sorted(
        (r[S.GROUP_ID], r[S.SAMPLE_INDEX]) for r in rows)
    by_kind = {a["request"]["messages"][0]["content"].split("ANSWER: ")[1].split("\n")[0]: a for a in audit}
    assert [t["status"] for t in by_kind["flaky500"]["attempts"]] == [500, 200]
    assert [t["status"] for t in by_kind["always500"]["attempts"]] == [503, 503, 503]
    assert all("timeout" in t["error"] for t in by_kind["slow"]["attempts"]) and len(by_kind["slow"]["attempts"]) == 3
    assert by_kind["garbage-answer"]["answer"] == "I cannot decide." and by_kind["garbage-answer"]["score"] is None
    assert "zoë-0" in by_kind["ok-3"]["request"]["messages"][0]["content"]  # the meta field filled in
    assert by_kind["ok-3"]["request"]["structured_outputs"] == {"choice": ["1", "2", "3", "4", "5"]}
    # the key reaches the server, and no file
    assert all(headers.get("Authorization") == f"Bearer {SECRET}" for headers, _ in fake.requests)
    for path in (tmp_path / "judged").rglob("*"):
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), path


def test_no_row_scored_is_one_line_naming_the_answer_and_the_scores(fake, logged, tmp_path, capsys):
    """The issue's case: a rubric asking for 0-10 under the default scores 1..5, a judge that answers 7 (a server
    without structured outputs): exit 2, one line with the answer, the allowed scores and the flag; no dataset."""
    sevens = write_dataset(tmp_path / "sevens", judged_groups([["ok-7"] * 8, ["ok-7"] * 8]))
    rubric = tmp_path / "ten.txt"
    rubric.write_text("Rate from 0 to 10.\nQuestion: {prompt}\nANSWER: {completion}\nScore:", encoding="utf-8")
    code, out, err = run_cli(capsys, "reward", sevens, *judge_args(fake.url, rubric, tmp_path / "judged"))
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.strip() == ("error: judge: no row got a score: the judge's most common answer was '7' (16 of 16 rows); "
                           "allowed scores 1,2,3,4,5 (--judge-scores, --judge-constrain choice); nothing was written")
    assert not (tmp_path / "judged").exists() and out == ""
    # the fix the line names works: the same run with the rubric's scale
    code, out, err = run_cli(capsys, "reward", sevens, *judge_args(fake.url, rubric, tmp_path / "judged",
                                                                   "--judge-scores", ",".join(map(str, range(11)))))
    assert code == 0 and "rewarded 16/16 rows" in out, err


def test_no_row_scored_because_every_call_failed(logged, rubric, tmp_path, capsys):
    server = FakeJudge(status_for_all=503)  # retryable: the first call is not a refusal, every call ends failed
    try:
        code, _, err = run_cli(capsys, "reward", logged, *judge_args(server.url, rubric, tmp_path / "judged",
                                                                     "--judge-retries", 0))
    finally:
        server.close()
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "no row got a score: the most common outcome was a failed call (HTTP 503: 11 of 11 rows)" in err
    assert not (tmp_path / "judged").exists()


def test_unknown_rubric_field_refused_before_any_call(fake, logged, tmp_path, capsys):
    bad = tmp_path / "bad.txt"
    bad.write_text("{prompt} {completion} {reference}", encoding="utf-8")
    code, _, err = run_cli(capsys, "reward", logged, *judge_args(fake.url, bad, tmp_path / "judged"))
    assert code == 2 and "rubric field {reference} is neither prompt, completion nor a meta field" in err
    assert len(err.strip().splitlines()) == 1 and fake.requests == [] and not (tmp_path / "judged").exists()


@pytest.mark.parametrize("case", ["closed-port", "401", "404"])
def test_refusing_endpoint_is_one_line_exit_2(logged, rubric, tmp_path, capsys, case):
    server = None if case == "closed-port" else FakeJudge(status_for_all=int(case))
    url = f"http://127.0.0.1:{free_port()}/v1" if server is None else server.url
    try:
        code, _, err = run_cli(capsys, "reward", logged, *judge_args(url, rubric, tmp_path / "judged"))
    finally:
        if server is not None:
            server.close()
    assert code == 2 and "judge endpoint refused the first call" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "judged").exists()
    if server is not None:
        assert len(server.requests) == 1  # one call, not retried, nothing else sent


@pytest.mark.parametrize("args, message", [
    (["--judge-constrain", "regex"], "unknown judge constraint 'regex'"),
    (["--judge-scores", "1,two"], "--judge-scores '1,two' must be numbers"),
    (["--judge-concurrency", "0"], "--judge-concurrency must be >= 1"),
])
def test_bad_judge_options(fake, logged, rubric, tmp_path, capsys, args, message):
    code, _, err = run_cli(capsys, "reward", logged, *judge_args(fake.url, rubric, tmp_path / "judged", *args))
    assert code == 2 and message in err and fake.requests == []


def test_parse_rule():
    choice = JudgeSettings(url="http://x/v1", model="m", rubric="{completion}", scores=(1, 2, 3))
    free = JudgeSettings(url="http://x/v1", model="m", rubric="{completion}", scores=(0, 10), constrain="none")
    assert [parse_score(a, choice) for a in ["2", " 3\n", "Score: 1.", "2.5", "4", '{"score": 3}', "none"]] == \
        [2.0, 3.0, 1.0, None, None, 3.0, None]
    assert [parse_score(a, free) for a in ["7.5/10", "-1", "10", "I give it 3 and 4"]] == [7.5, None, 10.0, 3.0]


@pytest.mark.vllm
def test_real_vllm_judge_under_constrained_choice(vllm_server, tmp_path, rubric, capsys):
    groups = judged_groups([["Zoë a payé 12 €.", "答案是 42。"], ["It is 7.", "Sept 🙂", "7"]])
    logged = write_dataset(tmp_path / "logged", groups)
    code, out, err = run_cli(capsys, "reward", logged, "--judge", vllm_server.base_url, "--judge-model",
                             vllm_server.served_name, "--rubric", rubric, "--judge-scores", "1,2,3,4,5",
                             "--out", tmp_path / "judged", "-q")
    assert code == 0, err
    rewards = [r[S.REWARD] for r in open_dataset(tmp_path / "judged").to_table().to_pylist()]
    assert len(rewards) == 5 and all(r in (1.0, 2.0, 3.0, 4.0, 5.0) for r in rewards), (rewards, out)


@pytest.mark.vllm
def test_judge_through_record_in_front_of_vllm(vllm_server, tmp_path, rubric, capsys):
    """`record` is an OpenAI-compatible endpoint too: the judge's calls go through it, structured outputs
    included, every score is parsed and in range, and each call is recorded."""
    import time

    from support.record_support import ServerThread, read_lines

    from offline_rec.record.proxy import create_app
    from offline_rec.record.proxy_state import ProxyState, upstream_base
    from offline_rec.record.recorder import Recorder, RecordOptions

    recorder = Recorder(tmp_path / "recorded", RecordOptions())
    state = ProxyState(upstream=upstream_base(vllm_server.base_url), recorder=recorder, warn=lambda m: None)
    proxy = ServerThread(create_app(state, tick_seconds=0.1))
    try:
        deadline = time.monotonic() + 60
        while state.logprobs_mode == "unknown" and time.monotonic() < deadline:
            time.sleep(0.1)
        logged = write_dataset(tmp_path / "logged", judged_groups([["Zoë a payé 12 €.", "7 🙂", "sept"]]))
        code, _, err = run_cli(capsys, "reward", logged, "--judge", proxy.url + "/v1", "--judge-model",
                               vllm_server.served_name, "--rubric", rubric, "--out", tmp_path / "judged", "-q")
    finally:
        proxy.stop()
    assert code == 0, err
    rewards = [r[S.REWARD] for r in open_dataset(tmp_path / "judged").to_table().to_pylist()]
    assert len(rewards) == 3 and all(r in (1.0, 2.0, 3.0, 4.0, 5.0) for r in rewards), rewards
    assert len(read_lines(tmp_path / "recorded")) == 3
