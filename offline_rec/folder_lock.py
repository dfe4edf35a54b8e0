"""One writer per output folder: `hold(folder, command)` locks FOLDER/.offline-rec.lock while a command writes there.

rounds --out, train --out, collect --out and eval --out take it, so two commands started on one folder (a rerun
while the first still runs, a second job on the same --out) cannot interleave their writes: the second is refused in
one line naming the holder's pid. The lock is the kernel's (`fcntl.flock`), released when its holder ends however
it ends, kill -9 included, so a leftover lock file never blocks a rerun; the pid in the file is for the message
only. The file is removed when the holder ends normally, and the folders that the holder created and left empty (a
refused command) go with it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from offline_rec.errors import UserError

LOCK_FILE = ".offline-rec.lock"


def has_content(folder: Path) -> bool:
    """Whether the folder `folder` holds anything but the lock file (the writers' "does it exist yet" checks)."""
    return any(entry.name != LOCK_FILE for entry in Path(folder).iterdir())


@contextlib.contextmanager
def hold(folder: str | os.PathLike, command: str, option: str = "--out") -> Iterator[None]:
    """Hold the write lock of `folder` (made if missing) for the body; UserError when another process holds it.

    `command` names the holder in the file; `option` the flag the refusal suggests changing.
    """
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise UserError(f"{option} {folder} is a file; give a folder")
    created = [path for path in (folder, *folder.parents) if not path.exists()]  # the folder first
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_FILE
    handle = _acquire(path, option)
    try:
        handle.truncate(0)
        handle.write(f"pid {os.getpid()}, {command}\n")
        handle.flush()
        yield
    finally:
        path.unlink(missing_ok=True)  # while still held: a process that opened it meanwhile sees it gone and retries
        handle.close()
        for path in created:
            try:
                path.rmdir()
            except OSError:  # not empty: the command wrote there, it stays
                break


def _acquire(path: Path, option: str):
    """The lock file `path`, open and locked by this process. A file unlinked by its last holder between our open
    and our lock is not the lock any more (the next writer makes a new one): open again."""
    import fcntl

    while True:
        handle = open(path, "a+", encoding="utf-8")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "pid not written yet"
            handle.close()
            raise UserError(f"{path.parent} is being written by another offline-rec ({holder}): wait for it to "
                            f"end (or stop it), or choose another {option}") from None
        try:
            current = os.stat(path).st_ino
        except FileNotFoundError:
            current = None
        if current == os.fstat(handle.fileno()).st_ino:
            return handle
        handle.close()
