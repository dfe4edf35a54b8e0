"""Small file helpers shared by every layer: atomic writes, sha256, timestamps, one-shot writer folders, the cache root,
the one JSON Lines reader.

An atomic write goes to a hidden temporary file in the same folder, is fsynced and renamed over
the target: a reader sees the old content or the new one, never a torn file, whatever kills the
process in between.
"""

from __future__ import annotations

import datetime as _dt
import glob
import hashlib
import json
import os
import platform
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from offline_rec.errors import write_fault

CACHE_ENV = "OFFLINE_REC_CACHE"


def cache_root() -> Path:
    """The folder of offline-rec's caches (the demo policy, the trainer's row stores).

    $OFFLINE_REC_CACHE when set, else offline-rec/ in the user's cache home ($XDG_CACHE_HOME or
    ~/.cache), as the datasets library does: a disk folder that outlives the process, never $TMPDIR.
    """
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "offline-rec"


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: str | os.PathLike, text: str, kept: str | None = None) -> None:
    """Write `text` to `path` so that readers see the old or the new content, never a mix. A refused write is a
    one-line UserError (`write_fault`) saying the file is unchanged, and what else is `kept`."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        full = write_fault(e, path, f"{path.name} is unchanged" + (f"; {kept}" if kept else ""))
        if full is not None:
            raise full from None
        raise
    fsync_dir(path.parent)


def atomic_write_json(path: str | os.PathLike, obj: Any, kept: str | None = None) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n", kept)


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def partial_prefix(final_path: Path, pid: int | None = None) -> str:
    """Name prefix of a one-shot writer's hidden folder: `.OUT.partial-HOST-PID-` (tempfile adds a random end).

    HOST is 8 hex digits of the sha256 of the host name and the PID namespace: fixed length, so
    that no host's prefix is another's (a raw "worker" would be a prefix of "worker-3"), and
    distinct for containers that share a host name (host networking) but not their process ids.
    """
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = ""
    host = hashlib.sha256(f"{platform.node()}\0{namespace}".encode()).hexdigest()[:8]
    return f".{final_path.name}.partial-{host}-{os.getpid() if pid is None else pid}-"


def remove_dead_partials(final_path: Path) -> list[Path]:
    """Delete the hidden folders that killed one-shot writers of `final_path` left behind.

    Only folders of this host (and PID namespace) whose process no longer exists: a writer still
    running, here or on another machine or container sharing the folder, keeps its own. A leftover
    whose process id has been reused stays. Returns what was removed.
    """
    removed = []
    if os.name == "nt":  # os.kill(pid, 0) would terminate the process there, not probe it
        return removed
    mine = partial_prefix(final_path, pid=0)[:-len("0-")]  # `.OUT.partial-HOST-`
    for candidate in final_path.parent.glob(f"{glob.escape(mine)}*"):
        pid_text = candidate.name[len(mine):].split("-", 1)[0]
        if candidate.is_dir() and pid_text.isdigit() and not _process_exists(int(pid_text)):
            shutil.rmtree(candidate, ignore_errors=True)
            removed.append(candidate)
    return removed


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


# --------------------------------------------------------------------------------------------
# JSON Lines


@dataclass(frozen=True)
class JsonlLine:
    """One non-blank line of a JSON Lines file: its JSON value, or why it cannot be read (`problem`)."""

    path: Path
    number: int
    """1 for the file's first line (blank lines count)."""
    value: Any = None
    problem: str | None = None
    """One phrase: "not valid UTF-8 (byte N of the line)", "malformed JSON: MSG (column C)", "expected a JSON
    object per line, got list"; None for a good line."""
    bad_utf8: bool = False
    """The problem is the line's bytes (not UTF-8), not its JSON."""

    @property
    def where(self) -> str:
        """"file:line", how every message names the line."""
        return f"{self.path}:{self.number}"


def read_jsonl(path: str | os.PathLike) -> Iterator[JsonlLine]:
    """Every non-blank line of the JSON Lines file `path`, in order, each a JSON object or with its `problem`.

    A byte-order mark before the first line (some editors write one) is skipped. A bad line is
    yielded, not raised: a caller refuses it (naming `where`) or sets it aside and reads on.
    """
    path = Path(path)
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                problem = f"not valid UTF-8 (byte {error.start} of the line)"
                yield JsonlLine(path, number, problem=problem, bad_utf8=True)
                continue
            if number == 1:
                text = text.removeprefix("\ufeff")
            if not text.strip():
                continue
            try:
                value = json.loads(text)
            except json.JSONDecodeError as error:
                yield JsonlLine(path, number, problem=f"malformed JSON: {error.msg} (column {error.colno})")
                continue
            except RecursionError:
                yield JsonlLine(path, number, problem="malformed JSON: nested too deeply")
                continue
            if not isinstance(value, dict):
                shown = "null" if value is None else type(value).__name__
                yield JsonlLine(path, number, problem=f"expected a JSON object per line, got {shown}")
                continue
            yield JsonlLine(path, number, value)
