"""Score a dataset with an LLM judge behind an OpenAI-compatible endpoint (`offline-rec reward --judge`).

The rubric is a text template: {prompt}, {completion} and any field of the row's meta (a field no row
may lack; `{{` and `}}` are literal braces). Every row's fields are checked before the first call; the
filled rubric is sent as one user message to URL/chat/completions (URL: the API base, e.g.
http://host:8000/v1), at temperature 0.

Reading the score. `constrain` says how the answer is constrained:
- "choice" (default): vLLM structured outputs, `structured_outputs: {"choice": SCORES}`: the answer is
  one of the allowed scores, as text;
- "json": `structured_outputs: {"json": schema}` with the schema of {"score": number in [min, max]}: the
  answer is that object;
- "none": a free answer (servers without structured outputs).
The rule, whatever the mode: a JSON object's "score", else the first number in the answer (`-?d+(.d+)?`);
it must lie in [min(SCORES), max(SCORES)] (and be one of SCORES under "choice"); anything else scores
null and is counted "unparsed".

Calls: at most `concurrency` in flight (asyncio + aiohttp); a call that times out (`timeout_s`),
loses its connection or gets 429 / 5xx is retried up to `retries` times, waiting `backoff_s *
2**attempt` (or the server's Retry-After, capped at 30 s); another 4xx, and a 200 whose body is not
a chat completion, are not retried. A call that still fails scores null and is counted "failed":
never a silent 0. The first call is made alone: an endpoint that refuses it (connection refused, 4xx
other than 429) is a UserError before anything is written.

Output: a new dataset (atomic) with each row's reward set, the judge's settings and counts in the
manifest (task.judge, stats.reward), and judge-audit.jsonl in it: one line per row with the request
body, every attempt's status or error, the raw answer and the score. The API key (from the
environment variable `api_key_env`) goes only into the Authorization header: never into a file.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import string
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from offline_rec import schema as S
from offline_rec.dataset.derive import open_input, source_block
from offline_rec.errors import UserError, require_extra
from offline_rec.rewards.config import JudgeOptions
from offline_rec.rewards.scorer import meta_fields, rescored_task, write_scored

BUILTIN_FIELDS = ("prompt", "completion")
AUDIT_FILE = "judge-audit.jsonl"
RETRY_AFTER_CAP_S = 30.0
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
ERROR_TEXT_CHARS = 300  # of an error body kept in the audit / a message


@dataclass
class JudgeSettings(JudgeOptions):
    """How to reach the judge (url, model, the rubric's text) and read its answers (see the module docstring)."""

    url: str = field(kw_only=True)
    model: str = field(kw_only=True)
    rubric: str = field(kw_only=True)
    fields: tuple[str, ...] = field(init=False, default=())

    def __post_init__(self):
        super().__post_init__()
        self.url = self.url.rstrip("/")
        if not self.url.startswith(("http://", "https://")):
            raise UserError(f"--judge {self.url!r} must be an http(s) URL of an OpenAI-compatible API base")
        self.fields = rubric_fields(self.rubric)

    def body(self, text: str) -> dict:
        """The chat-completions request for one filled rubric."""
        body = {"model": self.model, "messages": [{"role": "user", "content": text}], "temperature": 0.0,
                "max_tokens": self.max_tokens}
        if self.constrain == "choice":
            body["structured_outputs"] = {"choice": [_score_text(s) for s in self.scores]}
        elif self.constrain == "json":
            schema = {"type": "object", "properties": {"score": {"type": "number", "minimum": min(self.scores),
                                                                  "maximum": max(self.scores)}},
                      "required": ["score"], "additionalProperties": False}
            body["structured_outputs"] = {"json": schema}
        return body


def _score_text(score: float) -> str:
    return str(int(score)) if float(score).is_integer() else str(score)


def rubric_fields(rubric: str) -> tuple[str, ...]:
    """The fields a rubric template names; UserError for one that is not a plain name."""
    names = []
    try:
        parsed = list(string.Formatter().parse(rubric))
    except ValueError as e:
        raise UserError(f"rubric: not a valid template ({e}); write literal braces as {{{{ and }}}}") from None
    for _, name, spec, conversion in parsed:
        if name is None:
            continue
        if not name.isidentifier() or spec or conversion:
            raise UserError(f"rubric: field {{{name}}} must be a plain name (prompt, completion or a meta field)")
        names.append(name)
    return tuple(dict.fromkeys(names))


def fill_rubric(rubric: str, row: dict, meta: dict) -> str:
    values = {k: v if isinstance(v, str) else json.dumps(v, ensure_ascii=False) for k, v in meta.items()}
    values.update(prompt=row[S.PROMPT], completion=row[S.COMPLETION])
    return rubric.format(**values)


def parse_score(answer: str | None, settings: JudgeSettings) -> float | None:
    """The score an answer gives under the module docstring's rule, or None."""
    if not isinstance(answer, str):
        return None
    value = None
    try:
        obj = json.loads(answer)
    except (json.JSONDecodeError, ValueError):
        obj = None
    if isinstance(obj, dict) and isinstance(obj.get("score"), (int, float)) and not isinstance(obj["score"], bool):
        value = float(obj["score"])
    else:
        match = NUMBER.search(answer)
        value = float(match.group()) if match else None
    if value is None or not min(settings.scores) <= value <= max(settings.scores):
        return None
    if settings.constrain == "choice" and value not in settings.scores:
        return None
    return value


def check_rubric_fields(dataset, settings: JudgeSettings) -> None:
    """Every row must have every field the rubric names (read from the meta column alone)."""
    needed = [f for f in settings.fields if f not in BUILTIN_FIELDS]
    if not needed:
        return
    for table in dataset.iter_group_tables([S.SAMPLE_INDEX, S.META]):
        for row in table.to_pylist():
            meta = meta_fields(row, f"{dataset.path} group {row[S.GROUP_ID]!r}")
            missing = [f for f in needed if f not in meta]
            if missing:
                raise UserError(f"rubric field {{{missing[0]}}} is neither prompt, completion nor a meta field of "
                                f"group {row[S.GROUP_ID]!r} sample {row[S.SAMPLE_INDEX]} (its meta fields: "
                                f"{', '.join(sorted(meta)) or 'none'})")


class _Refused(Exception):
    pass


@dataclass
class _Counts:
    calls: int = 0
    scored: int = 0
    failed: int = 0
    unparsed: int = 0
    retries: int = 0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class JudgeClient:
    """The judge's HTTP side: one aiohttp session, at most `concurrency` calls in flight."""

    def __init__(self, settings: JudgeSettings):
        import aiohttp

        self.settings = settings
        headers = {"Content-Type": "application/json"}
        key = os.environ.get(settings.api_key_env) if settings.api_key_env else None
        if key:
            headers["Authorization"] = f"Bearer {key}"
        self.session = aiohttp.ClientSession(headers=headers,
                                             connector=aiohttp.TCPConnector(limit=settings.concurrency))
        self.semaphore = asyncio.Semaphore(settings.concurrency)
        self.counts = _Counts()
        self.unscored = Counter()
        """The answers that gave no score, and the last error of each failed call: what `no_score_error` names."""

    async def close(self) -> None:
        await self.session.close()

    async def judge(self, text: str, first: bool = False) -> tuple[float | None, dict]:
        """(score or None, audit entry) of one filled rubric; `first`: a refusing endpoint raises _Refused."""
        import aiohttp

        settings = self.settings
        body = settings.body(text)
        attempts: list[dict] = []
        answer = None
        self.counts.calls += 1
        for attempt in range(settings.retries + 1):
            wait = settings.backoff_s * 2 ** attempt
            status, error, payload, retry_after = None, None, "", None
            started = time.monotonic()
            async with self.semaphore:
                try:
                    async with self.session.post(f"{settings.url}/chat/completions", json=body,
                                                 timeout=aiohttp.ClientTimeout(total=settings.timeout_s)) as reply:
                        status = reply.status
                        payload = await reply.text(errors="replace")
                        retry_after = reply.headers.get("Retry-After")
                except asyncio.TimeoutError:
                    error = f"timeout after {settings.timeout_s:g} s"
                except aiohttp.ClientConnectorError as e:
                    if first:
                        raise _Refused(f"cannot connect to {settings.url} ({e.os_error or e})") from None
                    error = f"{type(e).__name__}: {e}"
                except aiohttp.ClientError as e:  # a dropped connection, a malformed reply
                    error = f"{type(e).__name__}: {e}"
            entry = {"status": status, "seconds": round(time.monotonic() - started, 3)}
            if error:
                entry["error"] = error
            if status == 200:
                answer = _answer(payload)
                if answer is None:  # the reply itself, to see what came back
                    entry["body"] = payload[:ERROR_TEXT_CHARS]
                attempts.append(entry)
                break
            if status is not None:
                entry["body"] = payload[:ERROR_TEXT_CHARS]
            attempts.append(entry)
            retryable = status is None or status == 429 or status >= 500
            if not retryable:
                if first:
                    raise _Refused(f"{settings.url} answered HTTP {status}: {payload[:ERROR_TEXT_CHARS]!r}")
                break
            if attempt == settings.retries:
                break
            if status == 429 and retry_after:
                try:
                    wait = min(float(retry_after), RETRY_AFTER_CAP_S)
                except ValueError:
                    pass
            self.counts.retries += 1
            await asyncio.sleep(wait)
        score = parse_score(answer, settings)
        if answer is None:
            self.counts.failed += 1
            last = attempts[-1] if attempts else {}
            self.unscored[("failed", last.get("error") or f"HTTP {last.get('status')}")] += 1
        elif score is None:
            self.counts.unparsed += 1
            self.unscored[("answer", answer.strip()[:ERROR_TEXT_CHARS])] += 1
        else:
            self.counts.scored += 1
        return score, {"request": body, "attempts": attempts, "answer": answer, "score": score}


def _answer(payload: str) -> str | None:
    """The first choice's message content of a chat-completions reply, or None for anything else."""
    try:
        reply = json.loads(payload)
        content = reply["choices"][0]["message"]["content"]
    except (json.JSONDecodeError, KeyError, IndexError, TypeError):
        return None
    return content if isinstance(content, str) else None


class JudgeScorer:
    """The judge as a `Scorer`: its own event loop and `JudgeClient` (use as a context manager), each batch's
    calls made concurrently, the very first call alone (a refusing endpoint is a UserError before any other
    call), one audit line per row."""

    def __init__(self, settings: JudgeSettings, where: str, bar):
        self.settings, self.where, self.bar = settings, where, bar
        self.runner = asyncio.Runner()
        try:
            self.client = self.runner.run(_open_client(settings))
        except BaseException:
            self.runner.close()
            raise
        self.first = True
        self.audit = None
        self.rows = self.rewarded = 0

    def open_audit(self, folder: Path) -> None:
        """Write the audit lines to folder/AUDIT_FILE (the hidden folder of the output being written)."""
        self.audit = open(folder / AUDIT_FILE, "w", encoding="utf-8")

    def score(self, rows: list[dict]) -> list[float | None]:
        texts = [fill_rubric(self.settings.rubric, row, meta_fields(row, self.where)) for row in rows]
        results = self.runner.run(self._judge(texts))
        for row, (_, entry) in zip(rows, results):
            self.audit.write(json.dumps({"group_id": row[S.GROUP_ID], "sample_index": row[S.SAMPLE_INDEX], **entry},
                                        ensure_ascii=False) + "\n")
        self.audit.flush()  # each batch's lines on disk with its rows: the file is whole when the output appears
        self.rows += len(rows)
        self.rewarded += sum(score is not None for score, _ in results)
        self.bar.advance(len(rows), f"null {self.rows - self.rewarded}")
        return [score for score, _ in results]

    async def _judge(self, texts: list[str]) -> list[tuple[float | None, dict]]:
        results = []
        if self.first and texts:  # alone, so that a refusing endpoint stops the run before anything is written
            try:
                results.append(await self.client.judge(texts[0], first=True))
            except _Refused as refused:
                raise UserError(f"judge endpoint refused the first call: {refused}") from None
            self.first = False
        return results + list(await asyncio.gather(*(self.client.judge(t) for t in texts[len(results):])))

    def counts(self) -> dict:
        return {"judge": self.client.counts.as_dict()}

    def refusal(self, rows: int, rewarded: int) -> UserError | None:
        if rows and not rewarded:  # a dataset of null rewards trains nothing: nothing is written
            return no_score_error(rows, self.client.unscored, self.settings)
        return None

    def __enter__(self) -> JudgeScorer:
        return self

    def __exit__(self, *exc) -> None:
        if self.audit is not None:
            self.audit.close()
        try:
            self.runner.run(self.client.close())
        finally:
            self.runner.close()


async def _open_client(settings: JudgeSettings) -> JudgeClient:
    return JudgeClient(settings)  # made inside the loop that will run its calls


def judge_dataset(src: str | Path, out: str | Path, settings: JudgeSettings, groups_per_chunk: int | None = None,
                  groups_per_shard: int = 256, progress: bool = True) -> dict:
    """Write SRC with each row's reward set by the judge to a new dataset OUT (see the module docstring), judging
    `groups_per_chunk` groups at once (default: max(64, 4 x concurrency)). Returns {"out", "rows", "groups",
    "rewarded", "null", "counts"}."""
    from offline_rec.progress import ProgressBar

    require_extra("reward --judge", "judge", "aiohttp")
    dataset = open_input(src, out)
    check_rubric_fields(dataset, settings)
    judge_block = {"url": settings.url, "model": settings.model,
                   "rubric_sha256": hashlib.sha256(settings.rubric.encode()).hexdigest(), "rubric": settings.rubric,
                   "scores": list(settings.scores), "constrain": settings.constrain, "max_tokens": settings.max_tokens,
                   "concurrency": settings.concurrency, "retries": settings.retries, "timeout_s": settings.timeout_s}
    task_block = rescored_task(dataset, reward_function=None, judge=judge_block)
    with ProgressBar("judge", total=dataset.num_rows, unit="rows", enabled=progress) as bar, \
            JudgeScorer(settings, str(src), bar) as scorer:
        summary = write_scored(dataset, out, scorer, task=task_block,
                               source=source_block("reward", src, dataset, judge=judge_block),
                               batch_rows=None, batch_groups=groups_per_chunk or max(64, 4 * settings.concurrency),
                               counts=scorer.counts, refusal=scorer.refusal, groups_per_shard=groups_per_shard,
                               begin=scorer.open_audit)
        return {"out": str(out), **summary, "counts": scorer.client.counts.as_dict()}


def no_score_error(rows: int, unscored: Counter, settings: JudgeSettings) -> UserError:
    """The one line when the judge scored no row: its most common answer (or failure), the allowed scores and
    the flag that sets them."""
    (kind, text), times = unscored.most_common(1)[0]
    allowed = ",".join(_score_text(s) for s in settings.scores)
    if kind == "failed":
        why = f"the most common outcome was a failed call ({text}: {times} of {rows} rows)"
    else:
        why = f"the judge's most common answer was {text!r} ({times} of {rows} rows)"
    return UserError(f"judge: no row got a score: {why}; allowed scores {allowed} (--judge-scores, "
                     f"--judge-constrain {settings.constrain}); nothing was written")


def read_rubric(path: str | Path) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read rubric {path}: {e}") from None
