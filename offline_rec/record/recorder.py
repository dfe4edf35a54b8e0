"""Turns finished calls into import-ready lines and writes them: single calls, episodes, redaction, fsync.

A single call is one line, the shape `offline-rec import --format openai` reads::

    {"request": {...}, "response": {...}, "record_id": "...", "endpoint": "chat.completions",
     "stream": false, "timing": {"start": <unix s>, "first_byte_s": ..., "total_s": ...},
     "upstream_model": "...", "logprobs_mode": "processed_logprobs", "logprobs_source": "sampled",
     "proxy_added": {"logprobs": null, "return_token_ids": null}}

"request" is what went upstream (the client's request plus the fields in "proxy_added", each
with the client's own value, null = absent), after `--redact-field`; "response" is the whole
response (streamed ones reassembled) with token ids and log-probs. A completions request with a
list of prompts gives one line per prompt: its choices, re-indexed from 0, the response id
suffixed `-<k>` (when there are several), its own "usage" (counted from its token ids), and
"batch": {"index", "size", "response_id", "usage": the whole batch's}.

An episode is one line: {"episode_id", "calls": [<single-call objects>, ...], "closed_by",
"timing": {"start", "end"}}. No header of any request is ever written. Episodes are keyed by
(client, id): the client is the index of the API key it authenticated with ("" without keys),
so one client can neither add to nor close another's episode of the same id.

Every line is strict JSON: a call whose record cannot be one (a NaN or Infinity in the response,
nesting too deep to write) is not recorded, is counted in "unrecordable" and warned about, and
never holds its episode open.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from offline_rec.errors import UserError
from offline_rec.record import open_episodes as E
from offline_rec.record import sink
from offline_rec.record.exchange import CHAT, COMPLETIONS, Added, logprobs_source, read_field, without_echo
from offline_rec.record.settings import RecordOptions

REDACTED = "[redacted]"
JOURNAL_COMPACT_BYTES = 64 << 20  # rewrite the journal past this size when most of it is closed episodes


# --------------------------------------------------------------------------------------------
# redaction


def redact(value: Any, path: tuple[str, ...]) -> Any:
    """`value` with what `path` points at replaced by "[redacted]": copied along the path where
    something was replaced, never mutated; `value` itself when the path matches nothing."""
    if not path:
        return REDACTED
    head, rest = path[0], path[1:]
    if isinstance(value, dict):
        keys = list(value) if head == "*" else [head] if head in value else []
    elif isinstance(value, list):
        if head == "*":
            keys = list(range(len(value)))
        elif head.lstrip("-").isdigit() and -len(value) <= int(head) < len(value):
            keys = [int(head) % len(value)]
        else:
            keys = []
    else:
        keys = []
    out = value
    for key in keys:
        new = redact(value[key], rest)
        if new is not value[key]:
            if out is value:
                out = dict(value) if isinstance(value, dict) else list(value)
            out[key] = new
    return out


# --------------------------------------------------------------------------------------------
# lines


UNWRITABLE = (ValueError, TypeError, RecursionError)
"""What `line_bytes` raises for an object that is no strict JSON line (NaN, Infinity, too deep, not JSON)."""


def line_bytes(obj: dict) -> bytes:
    """One strict (RFC 8259) JSON line: NaN and Infinity raise ValueError; non-ASCII kept unless the text
    holds lone surrogates (then escaped)."""
    try:
        return (json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False) + "\n").encode("utf-8")
    except UnicodeEncodeError:
        return (json.dumps(obj, separators=(",", ":"), allow_nan=False) + "\n").encode("ascii")


def _batch_prompts(endpoint: str, request: dict) -> list | None:
    prompt = request.get("prompt")
    if endpoint != COMPLETIONS or not isinstance(prompt, list) or len(prompt) < 1:
        return None
    if all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt):
        return prompt
    return None


def call_records(
    *,
    endpoint: str,
    request: dict,
    response: dict,
    added: Added,
    timing: dict,
    upstream_model: str | None,
    logprobs_mode: str,
) -> list[dict]:
    """The line object(s) of one successful call (several for a completions batch), unredacted. A chat `echo`'s
    text is left out of the response (`without_echo`: ValueError when it cannot be)."""
    if endpoint == CHAT:
        response = without_echo(request, response)
    base = {
        "endpoint": endpoint,
        "stream": added.stream,
        "timing": timing,
        "upstream_model": upstream_model or response.get("model"),
        "logprobs_mode": logprobs_mode,
        "logprobs_source": logprobs_source(logprobs_mode, request),
        "proxy_added": added.fields,
    }
    prompts = _batch_prompts(endpoint, request)
    if prompts is None:
        return [{"record_id": uuid.uuid4().hex, "request": request, "response": response, **base}]
    n = read_field(request, "n", int) or 1  # "2" and 2.0 are 2, as vLLM reads them
    records = []
    for k, prompt in enumerate(prompts):
        choices = [
            {**c, "index": c["index"] - k * n}
            for c in response.get("choices", [])
            if isinstance(c, dict) and isinstance(c.get("index"), int) and k * n <= c["index"] < (k + 1) * n
        ]
        part = {**response, "choices": choices}
        if "usage" in response:
            part["usage"] = _prompt_usage(choices) if response["usage"] is not None else None
        if isinstance(response.get("id"), str) and len(prompts) > 1:
            part["id"] = f"{response['id']}-{k}"
        records.append({
            "record_id": uuid.uuid4().hex,
            "request": {**request, "prompt": prompt},
            "response": part,
            **base,
            "batch": {"index": k, "size": len(prompts), "response_id": response.get("id"),
                      "usage": response.get("usage")},
        })
    return records


def _prompt_usage(choices: list[dict]) -> dict | None:
    """The usage of one prompt of a batch, counted from its choices' token ids as vLLM counts a whole call's (its
    prompt's tokens once, every choice's tokens); None without them."""
    prompt_ids = choices[0].get("prompt_token_ids") if choices else None
    if not isinstance(prompt_ids, list) or not all(isinstance(c.get("token_ids"), list) for c in choices):
        return None
    completion = sum(len(c["token_ids"]) for c in choices)
    return {"prompt_tokens": len(prompt_ids), "completion_tokens": completion,
            "total_tokens": len(prompt_ids) + completion}


# --------------------------------------------------------------------------------------------
# the recorder


def _closed_by(episode: E.Episode) -> str:
    """Why an episode closed when its last call in flight finished: an end header, else its size."""
    return E.CLOSED_BY_END if episode.ending else E.CLOSED_BY_SIZE


class Recorder:
    """Writes the lines of one proxy run into a directory. Used from one event loop (no locks)."""

    def __init__(self, out: str | os.PathLike, options: RecordOptions | None = None,
                 warn: Callable[[str], None] | None = None, wall_clock=time.time, clock=time.monotonic):
        options = options or RecordOptions()
        if options.rotate_bytes < 1:
            raise UserError(f"--rotate-mb must be > 0, got {options.rotate_bytes / (1 << 20)}")
        if options.fsync_interval < 0:
            raise UserError(f"--fsync-interval must be >= 0, got {options.fsync_interval}")
        if options.max_episode_bytes < 1:
            raise UserError(f"--max-episode-mb must be > 0, got {options.max_episode_bytes / (1 << 20)}")
        if options.episode_idle_timeout <= 0:
            raise UserError(f"--episode-idle-timeout must be > 0, got {options.episode_idle_timeout}")
        self.out = Path(out)
        if self.out.exists() and not self.out.is_dir():
            raise UserError(f"--out {self.out} is a file; give a directory")
        self.options = options
        self.warn = warn or (lambda message: None)
        self.wall_clock = wall_clock
        self.clock = clock
        self.book = E.EpisodeBook(owner=lambda key: key[0])  # key: (client, X-Episode-Id)
        self.files: sink.RecordFiles | None = None
        self.journal: sink.LineFile | None = None
        self.stats = {"lines": 0, "calls": 0, "episodes": 0, "failed_calls": 0, "write_errors": 0,
                      "unrecordable": 0, "recovered_episodes": 0, "recovered_incomplete": 0}
        self._last_sync = 0.0
        self._last_warning = -1e9
        # an episode's line failed to be written: its calls stay in the journal (never truncated nor
        # compacted from then on) for the next proxy's recovery
        self.journal_holds_unwritten = False

    # ---- life cycle

    def start(self) -> sink.Recovered:
        """Recover what dead proxies left in the directory, then open this run's files."""
        sink.make_private_dir(self.out)
        recovered = sink.recover(self.out)
        stem = sink.new_stem()
        self.files = sink.RecordFiles(self.out, stem, self.options.rotate_bytes, self.options.rotate_seconds,
                                      self.clock, warn=self.warn)
        self.journal = sink.LineFile(self.out / f"{stem}{sink.JOURNAL_SUFFIX}")
        self._last_sync = self.clock()
        all_kept = True  # every recovered episode written, or journaled again for the next recovery
        for episode in recovered.episodes:
            missing = episode["missing_calls"]
            if not episode["calls"]:
                self.warn(f"record: episode {episode['episode_id']!r} of a stopped proxy: none of its {missing} "
                          "answered call(s) reached the journal; nothing of it can be written")
                continue
            if self._write(self._episode_line(episode["episode_id"], episode["calls"], E.CLOSED_BY_RECOVERY,
                                              missing)):
                self.stats["recovered_episodes"] += 1  # counted in "episodes" and "calls" too
                self.stats["recovered_incomplete"] += 1 if missing else 0
                self.stats["episodes"] += 1
                self.stats["calls"] += len(episode["calls"])
                continue
            key = (episode["client"], episode["episode_id"])
            self.journal_holds_unwritten = True
            self.book.seq_floor[key] = 1
            all_kept &= self._journal({"client": key[0], "episode_id": key[1], "seq": 0, "calls": episode["calls"],
                                       **({"missing_calls": missing} if missing else {})})
        self.files.current.sync()
        self.journal.sync()
        if all_kept:
            for journal in recovered.journals:
                journal.unlink(missing_ok=True)
        else:  # read again by the next start (an episode written here may then be written twice, none lost)
            self.warn("record: the journals of the stopped proxy are kept: an episode could not be written")
        sink.fsync_dir(self.out)
        return recovered

    def close(self) -> None:
        """Write the episodes still open (closed_by "shutdown"), close the files (they become `.jsonl`)."""
        if self.files is None:
            return
        failed_before = self.stats["write_errors"]
        for episode in self.book.drain():
            self._write_episode(episode, E.CLOSED_BY_SHUTDOWN)
        try:
            self.files.close()
        except OSError as e:
            self._write_failed(e)
        self.files = None
        journal_path = self.journal.path
        try:
            self.journal.close()
            if self.stats["write_errors"] == failed_before and not self.journal_holds_unwritten:
                journal_path.unlink(missing_ok=True)
            else:  # an episode's line may be missing: the next proxy's recovery writes it from the journal
                self.warn(f"record: {journal_path.name} kept for the next proxy's recovery (episode lines not written)")
            sink.fsync_dir(self.out)
        except OSError as e:
            self._write_failed(e)

    # ---- calls

    def begin(self, episode: tuple[str, str] | None) -> int | None:
        """A call arrives; `episode`: (client, episode id) or None. Its sequence number in the episode."""
        return None if episode is None else self.book.begin(episode, self.clock())

    async def commit(self, records: list[dict], episode: tuple[str, str] | None = None, seq: int | None = None,
                     end: bool = False) -> bool:
        """Write a successful call: its line now, or into its episode (journaled; the episode's line
        when it closes). With fsync_interval 0, returns once it is on disk. False (and the call
        abandoned) when its records cannot be written as strict JSON."""
        records = [self._redacted(r) for r in records]
        try:
            if episode is None:
                lines = [line_bytes(record) for record in records]
            else:  # as deep as the episode's line will be
                lines = [line_bytes({"client": episode[0], "episode_id": episode[1], "seq": seq, "calls": records})]
        except UNWRITABLE as e:
            self.stats["unrecordable"] += 1
            self.warn(f"record: a call not recorded: its line would not be strict JSON ({type(e).__name__}: {e})")
            self.abandon(episode, seq, end)
            return False
        self.stats["calls"] += 1
        if episode is None:
            for line in lines:
                self._write_bytes(line)
        else:
            held = self.book.holding(episode, seq)  # open until this call (in flight) finishes
            if held.unjournaled:  # earlier entries failed: this one names them, so that recovery can tell
                lines = [line_bytes({"client": episode[0], "episode_id": episode[1], "seq": seq, "calls": records,
                                     "missing": sorted(held.unjournaled)})]
            if not self._journal_bytes(lines[0]):
                held.unjournaled.add(seq)
            held.size += len(lines[0])
            held.too_large = held.too_large or held.size > self.options.max_episode_bytes
            closed = self.book.finish(episode, seq, records, end, self.clock())
            if closed is not None:
                self._write_episode(closed, _closed_by(closed))
        if self.options.fsync_interval == 0:
            await self.sync()
        return True

    def abandon(self, episode: tuple[str, str] | None, seq: int | None, end: bool = False) -> None:
        """A call that is not recorded (upstream error, client gone, incomplete stream, unwritable)."""
        self.stats["failed_calls"] += 1
        if episode is None or self.book.holding(episode, seq) is None:
            return
        closed = self.book.finish(episode, seq, None, end, self.clock())
        if closed is not None:
            self._write_episode(closed, _closed_by(closed))

    async def tick(self) -> None:
        """Periodic work: close idle episodes, rotate an old file, fsync per the policy."""
        if self.files is None:
            return
        now = self.clock()
        for episode in self.book.expired(now, self.options.episode_idle_timeout):
            self._write_episode(episode, E.CLOSED_BY_IDLE)
        try:
            self.files.rotate_if_due()
        except OSError as e:
            self._write_failed(e)
        if self.options.fsync_interval > 0 and now - self._last_sync >= self.options.fsync_interval:
            await self.sync()

    async def sync(self) -> None:
        """fsync the open data file and journal, in a worker thread (the event loop keeps serving)."""
        self._last_sync = self.clock()
        targets = [f for f in (self.files.current, self.journal) if f is not None and f.dirty]
        if not targets:
            return
        fds = []
        for target in targets:
            target.dirty = False
            fds.append(target.duplicate_fd())  # survives a rotation that closes the original meanwhile

        def fsync_all():
            for fd in fds:
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)

        try:
            await asyncio.to_thread(fsync_all)
        except OSError as e:
            self._write_failed(e)

    # ---- internals

    def _redacted(self, record: dict) -> dict:
        request = record["request"]
        for path in self.options.redact_fields:
            request = redact(request, path)
        return {**record, "request": request} if request is not record["request"] else record

    def _episode_line(self, episode_id: str, calls: list[dict], closed_by: str, missing: int = 0) -> dict:
        starts = [c.get("timing", {}).get("start") for c in calls]
        first = next((s for s in starts if isinstance(s, (int, float))), None)
        line = {"episode_id": episode_id, "calls": calls, "closed_by": closed_by}
        if missing:  # answered calls recovery could not find (their journal entries failed)
            line["missing_calls"] = missing
        return {**line, "timing": {"start": first, "end": self.wall_clock()}}

    def _write_episode(self, episode: E.Episode, closed_by: str) -> None:
        client, episode_id = episode.episode_id  # the book's key
        calls = episode.ordered_calls()
        if calls and not self._write(self._episode_line(episode_id, calls, closed_by)):
            # journaled closed only once its line is written: left open there, recovery writes it; a new
            # episode of this id numbers its calls after these, so the journal never mixes the two
            self.journal_holds_unwritten = True
            self.book.seq_floor[episode.episode_id] = episode.next_seq
            if episode.unjournaled:  # recovery will lack these calls: the journal says so, if it can
                missing = sorted(episode.unjournaled)
                if not self._journal({"client": client, "episode_id": episode_id, "missing": missing}):
                    self.warn(f"record: episode {episode_id!r}: {len(missing)} answered call(s) reached neither the "
                              "journal nor a line; the next proxy's recovery will write it without them, unflagged")
        elif calls:
            self.stats["episodes"] += 1
            # the seqs it held: a newer episode of the same id (past the size limit) may be open already
            self._journal({"client": client, "episode_id": episode_id, "closed": True,
                           "seqs": [episode.first_seq, episode.next_seq]})
        self._trim_journal()

    def _write(self, obj: dict) -> bool:
        try:
            line = line_bytes(obj)
        except UNWRITABLE as e:  # checked at commit; kept for lines built later (an episode's)
            self._write_failed(OSError(f"not strict JSON: {type(e).__name__}: {e}"))
            return False
        return self._write_bytes(line)

    def _write_bytes(self, line: bytes) -> bool:
        try:
            self.files.append(line)
        except OSError as e:
            self._write_failed(e)
            return False
        self.stats["lines"] += 1
        return True

    def _journal(self, entry: dict) -> bool:
        return self._journal_bytes(line_bytes(entry))

    def _journal_bytes(self, line: bytes) -> bool:
        try:
            self.journal.append(line)
        except OSError as e:
            self._write_failed(e)
            return False
        return True

    def _trim_journal(self) -> None:
        """Empty the journal when no episode is open; rewrite it when it is mostly closed episodes."""
        if self.journal_holds_unwritten:
            return
        try:
            if not self.book.open and not self.book.retiring:
                if self.journal.size:
                    self.journal.truncate()
            elif self.journal.size > JOURNAL_COMPACT_BYTES:
                self._compact_journal()
        except OSError as e:
            self._write_failed(e)

    def _compact_journal(self) -> None:
        entries = [
            line_bytes({"client": e.episode_id[0], "episode_id": e.episode_id[1], "seq": seq, "calls": records})
            for e in self.book.held()
            for seq, records in sorted(e.calls.items())
        ]
        if sum(map(len, entries)) * 2 > self.journal.size:
            return
        path = self.journal.path
        temporary = sink.LineFile(path.with_name(path.name + ".tmp"))  # locked before it takes the name
        temporary.append(b"".join(entries))
        temporary.sync()
        os.replace(temporary.path, path)
        temporary.path = path
        self.journal.close()
        self.journal = temporary
        sink.fsync_dir(self.out)
        for episode in self.book.held():
            episode.unjournaled.clear()  # every call it holds is in the rewritten journal

    def _write_failed(self, error: OSError) -> None:
        """The traffic goes on when a line cannot be written; the operator is told (at most once a minute)."""
        self.stats["write_errors"] += 1
        now = self.clock()
        if now - self._last_warning >= 60:
            self._last_warning = now
            self.warn(f"could not write to {self.out} ({error}); {self.stats['write_errors']} line(s) lost so far, "
                      "responses still go to the clients")
