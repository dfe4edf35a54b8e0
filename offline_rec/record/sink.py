"""Whole lines on disk: rotating JSONL files, the episode journal, and what a killed proxy left.

Files in the output directory (STEM = `record-<UTC time>-<pid>`, one per proxy run):

- `STEM-00001.jsonl.open`: the file being written. Each line goes in with ONE `write` on a file
  opened with O_APPEND, so once `write` returns the line is whole in the kernel's page cache and
  survives a kill -9 of the proxy; a write that fails or comes back short is cut off again
  (ftruncate to the size before it), so a full disk never leaves half a line followed by more.
  fsync (what survives a machine crash) follows the fsync policy: every `fsync_interval`
  seconds, or before the client gets its response's last byte when the interval is 0.
- `STEM-00001.jsonl`: the same file once closed (rotation, or a clean shutdown): whole lines only.
  `offline-rec import DIR` reads these, never a `.open` file.
- `STEM.episodes`: the journal of the episodes still open (each of their calls as a line, then
  a "closed" line once the episode's line is written), so a killed proxy loses no finished call;
  an answered call whose entry could not be written is named by the episode's later entries, so
  that recovery can say the episode it writes is missing it (`replay_journal`).

Files are created 0600 and the directory 0700 (recorded prompts are user data); no file is
opened through a symlink (O_NOFOLLOW), a new file is never opened over an existing name
(O_EXCL), and recovery leaves alone anything but a regular file of the proxy's own user with one
link, so a symlink or hard link planted in the directory cannot make the proxy write, truncate or
rename a file elsewhere.

The proxy holds an exclusive `flock` on its `.open` file and journal. A new proxy starting on
the directory recovers the files whose lock is free (their writer is gone): it cuts a torn last
line off a `.open` file (a kill -9 in the middle of a large write), closes it, and writes the
open episodes of a dead journal as lines of its own (closed_by "recovered").
"""

from __future__ import annotations

import datetime as _dt
import fcntl
import json
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from offline_rec.files import fsync_dir

OPEN_SUFFIX = ".jsonl.open"
CLOSED_SUFFIX = ".jsonl"
JOURNAL_SUFFIX = ".episodes"
PREFIX = "record-"
FILE_MODE = 0o600
NAME_TRIES = 100  # names tried for the next data file before the rotation waits
ROTATE_RETRY_SECONDS = 10.0  # after a rotation that could not open a file
DIR_MODE = 0o700


def make_private_dir(directory: Path) -> None:
    """Create `directory` (and parents) 0700; one that exists keeps its mode (the operator chose it)."""
    if not directory.is_dir():
        directory.mkdir(parents=True, mode=DIR_MODE, exist_ok=True)
        os.chmod(directory, DIR_MODE)  # mkdir's mode is masked by the umask


class LineFile:
    """An append-only file of whole lines, locked by this process; created new (FileExistsError when the
    name is taken: by a file, or a link planted to one elsewhere)."""

    def __init__(self, path: Path):
        self.path = path
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW
        self.fd = os.open(path, flags, FILE_MODE)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self.fd)
            raise
        self.size = os.fstat(self.fd).st_size
        self.dirty = False
        self.lines = 0

    def append(self, data: bytes) -> None:
        """Write `data` (whole lines) with one write; on failure nothing of it stays in the file."""
        start = self.size
        try:
            written = os.write(self.fd, data)
            while written < len(data):  # a regular file writes all unless interrupted; finish the line
                more = os.write(self.fd, data[written:])
                if more <= 0:
                    raise OSError(f"short write to {self.path}")
                written += more
        except BaseException:
            try:
                os.ftruncate(self.fd, start)
            except OSError:
                pass
            raise
        self.size += len(data)
        self.dirty = True
        self.lines += data.count(b"\n")

    def duplicate_fd(self) -> int:
        """A second descriptor of the file, for an fsync in another thread that must outlive a rotation."""
        return os.dup(self.fd)

    def sync(self) -> None:
        if self.dirty:
            self.dirty = False
            os.fsync(self.fd)

    def truncate(self) -> None:
        os.ftruncate(self.fd, 0)
        self.size = 0
        self.lines = 0
        self.dirty = True

    def close(self) -> None:
        if self.fd < 0:
            return
        try:
            self.sync()
        finally:
            os.close(self.fd)  # closing releases the lock
            self.fd = -1


def new_stem(pid: int | None = None) -> str:
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
    return f"{PREFIX}{stamp}-{os.getpid() if pid is None else pid}"


class RecordFiles:
    """The rotating data files of one proxy run: `STEM-NNNNN.jsonl.open`, closed into `.jsonl`.

    A new file starts when the open one would grow past `rotate_bytes`, or is older than
    `rotate_seconds` (checked at each line and by `rotate_if_due`); an empty file is never rotated.
    The next file is opened before the current one is closed: a name already taken (a file or a
    link planted there) is skipped for the next number, and when no new file can be opened
    (EMFILE, ENOSPC, every name tried taken) the lines go on into the current file, `warn` says
    so, and the rotation is tried again after ROTATE_RETRY_SECONDS.
    """

    def __init__(self, directory: Path, stem: str, rotate_bytes: int, rotate_seconds: float | None, clock,
                 warn=None):
        self.directory = directory
        self.stem = stem
        self.rotate_bytes = rotate_bytes
        self.rotate_seconds = rotate_seconds
        self.clock = clock
        self.warn = warn or (lambda message: None)
        self.number = 0
        self.closed_files: list[Path] = []
        self.opened_at = 0.0
        self.retry_at = -float("inf")  # no rotation before then (the last one could not open a file)
        self.current: LineFile | None = self._open_next()

    def _open_next(self) -> LineFile:
        """The next file, under the first free name after the current one's number (OSError: none opened)."""
        for number in range(self.number + 1, self.number + 1 + NAME_TRIES):
            path = self.directory / f"{self.stem}-{number:05d}{OPEN_SUFFIX}"
            try:
                opened = LineFile(path)
            except FileExistsError:
                self.warn(f"record: {path.name} exists and is not this proxy's: left alone, the next name taken")
                continue
            try:
                fsync_dir(self.directory)
            except OSError:  # not left open (nor its name taken) when the rotation fails
                opened.close()
                path.unlink(missing_ok=True)
                raise
            self.number = number
            self.opened_at = self.clock()
            return opened
        raise FileExistsError(f"names {self.stem}-{self.number + 1:05d} .. -{self.number + NAME_TRIES:05d}"
                              f"{OPEN_SUFFIX} are all taken")

    def _due(self, incoming: int) -> bool:
        current = self.current
        if current.size == 0 or self.clock() < self.retry_at:
            return False
        if current.size + incoming > self.rotate_bytes:
            return True
        return self.rotate_seconds is not None and self.clock() - self.opened_at >= self.rotate_seconds

    def append(self, line: bytes) -> None:
        if self._due(len(line)):
            self.rotate()
        self.current.append(line)

    def rotate_if_due(self) -> None:
        if self._due(0):
            self.rotate()

    def rotate(self) -> None:
        """Open the next file, then close the current one; on failure keep the current one (and say so)."""
        try:
            opened = self._open_next()
        except OSError as e:
            self.retry_at = self.clock() + ROTATE_RETRY_SECONDS
            self.warn(f"record: could not start the file after {self.current.path.name} ({e}); lines go on "
                      f"into it, next try in {ROTATE_RETRY_SECONDS:.0f} s")
            return
        previous, self.current = self.current, opened
        try:
            self._close(previous)
        except OSError as e:  # its lines stay in it: the next proxy's recovery closes it
            self.warn(f"record: could not close {previous.path.name} ({e}); lines go on into {opened.path.name}")

    def _close(self, file: LineFile) -> None:
        file.close()
        if file.size == 0:
            file.path.unlink(missing_ok=True)
        else:
            closed = file.path.with_name(file.path.name[: -len(OPEN_SUFFIX)] + CLOSED_SUFFIX)
            os.replace(file.path, closed)
            self.closed_files.append(closed)
        fsync_dir(self.directory)

    def close(self) -> None:
        if self.current is not None:
            current, self.current = self.current, None
            self._close(current)


# --------------------------------------------------------------------------------------------
# reading back


def whole_lines(source: Path | int) -> Iterator[bytes]:
    """The complete lines of a record file (a torn last line without its newline is left out), by path or
    from an open descriptor (read from its start). OSError for anything but a regular file: a FIFO or a
    link to /dev/zero planted under a record name would hang or flood the reader."""
    if isinstance(source, int):
        fd = os.dup(source)
    else:
        fd = os.open(source, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{source}: not a regular file")
        f.seek(0)
        for raw in f:
            if raw.endswith(b"\n"):
                yield raw


def _try_lock(path: Path, left_alone: list) -> int | None:
    """A locked read-write descriptor of `path`, or None: while another process holds it, or when the file
    may not be ours (noted in `left_alone` as (path, why)): a hard link (more than one name, so
    possibly a file elsewhere), a file of another user, anything but a regular file."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except (FileNotFoundError, OSError):  # gone, or a symlink (ELOOP), or not openable: not ours to touch
        return None
    info = os.fstat(fd)
    why = None
    if not stat.S_ISREG(info.st_mode):  # a FIFO, a device, a directory
        why = "not a regular file"
    elif info.st_nlink > 1:
        why = f"{info.st_nlink} hard links: it may be a file elsewhere"
    elif info.st_uid != os.geteuid():
        why = f"owned by user {info.st_uid}, not this proxy's"
    if why is not None:
        os.close(fd)
        left_alone.append((path, why))
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def _cut_torn_tail(fd: int) -> int:
    """Truncate the file after its last newline; returns the bytes cut."""
    size = os.fstat(fd).st_size
    end = size
    block = 1 << 16
    while end > 0:
        start = max(0, end - block)
        data = os.pread(fd, end - start, start)
        at = data.rfind(b"\n")
        if at >= 0:
            keep = start + at + 1
            break
        end = start
    else:
        keep = 0
    if keep < size:
        os.ftruncate(fd, keep)
        os.fsync(fd)
    return size - keep


@dataclass
class Recovered:
    """What recovery found: files closed, torn bytes cut, and the open episodes of dead journals."""

    closed_files: list[Path] = field(default_factory=list)
    torn_bytes: int = 0
    episodes: list[dict] = field(default_factory=list)  # {"client", "episode_id", "calls", "missing_calls"}
    journals: list[Path] = field(default_factory=list)  # remove once the episodes are written
    left_alone: list[tuple[Path, str]] = field(default_factory=list)  # (file, why recovery did not touch it)


def recover(directory: Path) -> Recovered:
    """Close the `.open` files and read the journals of proxies that are gone (their lock is free)."""
    found = Recovered()
    for path in sorted(directory.glob(f"{PREFIX}*{OPEN_SUFFIX}")):
        fd = _try_lock(path, found.left_alone)
        if fd is None:
            continue
        try:
            found.torn_bytes += _cut_torn_tail(fd)
            if os.fstat(fd).st_size == 0:
                path.unlink()
            else:
                closed = path.with_name(path.name[: -len(OPEN_SUFFIX)] + CLOSED_SUFFIX)
                os.replace(path, closed)
                found.closed_files.append(closed)
        finally:
            os.close(fd)
    for journal in sorted(directory.glob(f"{PREFIX}*{JOURNAL_SUFFIX}")):
        fd = _try_lock(journal, found.left_alone)
        if fd is None:
            continue
        try:
            stem = journal.name[: -len(JOURNAL_SUFFIX)]
            written = _written_episode_calls(directory, stem)
            for episode in replay_journal(fd):  # the descriptor checked and locked, not the name again
                if not episode["calls"] or episode["calls"][0].get("record_id") not in written:
                    found.episodes.append(episode)
            found.journals.append(journal)
        finally:
            os.close(fd)
    fsync_dir(directory)
    return found


def replay_journal(path: Path | int) -> list[dict]:
    """The episodes a journal leaves open, calls in order: {"client", "episode_id", "calls", "missing_calls"}.

    Journal lines: {"episode_id", "seq", "calls": [records of call seq]} as each call
    finishes, then {"episode_id", "closed": true, "seqs": [first, end)} once the episode's line is
    written: it closes the calls first <= seq < end (an episode past the size limit closes while
    the next one of its id is open); without "seqs", every call of the id so far.

    Answered calls whose entry could not be written (a full disk) are named by seq: in the "missing" list of the
    episode's later entries, or in an entry {"episode_id", "missing": [seqs]} once its line failed too; an entry
    of an episode journaled again by a recovery carries "missing_calls", a count. "missing_calls" of an episode:
    the calls so named whose entries are not found.
    """
    open_episodes: dict[tuple, dict] = {}  # (client, episode id) -> {"calls": seq -> records, "missing", "lost"}
    for raw in whole_lines(path):
        try:
            entry = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue
        if not isinstance(entry, dict) or not isinstance(entry.get("episode_id"), str):
            continue
        episode_id = entry["episode_id"]
        key = (str(entry.get("client", "")), episode_id)
        if entry.get("closed"):
            seqs = entry.get("seqs")
            episode = open_episodes.get(key)
            if episode is not None and isinstance(seqs, list) and len(seqs) == 2 and all(type(s) is int for s in seqs):
                for part in ("calls", "lost"):
                    episode[part] = {seq: v for seq, v in episode[part].items() if not seqs[0] <= seq < seqs[1]}
                episode["missing"] = {seq for seq in episode["missing"] if not seqs[0] <= seq < seqs[1]}
            if episode is not None and (seqs is None or not any(episode[p] for p in ("calls", "missing", "lost"))):
                open_episodes.pop(key)
            continue
        episode = open_episodes.setdefault(key, {"client": key[0], "episode_id": episode_id, "calls": {},
                                                 "missing": set(), "lost": {}})
        missing = entry.get("missing")
        episode["missing"].update(seq for seq in (missing if isinstance(missing, list) else []) if type(seq) is int)
        if isinstance(entry.get("calls"), list) and isinstance(entry.get("seq"), int):
            episode["calls"][entry["seq"]] = entry["calls"]
            if type(entry.get("missing_calls")) is int and entry["missing_calls"] > 0:
                episode["lost"][entry["seq"]] = entry["missing_calls"]
    return [
        {"client": episode["client"], "episode_id": episode["episode_id"],
         "calls": [call for seq in sorted(episode["calls"]) for call in episode["calls"][seq]],
         "missing_calls": len(episode["missing"] - episode["calls"].keys()) + sum(episode["lost"].values())}
        for episode in open_episodes.values()
    ]


def _written_episode_calls(directory: Path, stem: str) -> set:
    """Record ids of the calls of the episode lines in a dead run's last data file.

    A kill between writing an episode's line and journaling it closed leaves the episode open in
    the journal although its line exists; that line can only be in the file open at the time. Every call's id is
    kept, not only the first's: the journal may lack the episode's first call (its entry failed, the line did not).
    """
    files = sorted(directory.glob(f"{stem}-*{CLOSED_SUFFIX}"))
    if not files:
        return set()
    ids = set()
    try:
        for raw in whole_lines(files[-1]):
            if b'"episode_id"' not in raw:
                continue
            try:
                line = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError):
                continue
            calls = line.get("calls") if isinstance(line, dict) else None
            if isinstance(calls, list):
                ids.update(call.get("record_id") for call in calls if isinstance(call, dict))
    except OSError:  # not a regular file (planted), or gone: it holds no line of that run
        return set()
    return ids
