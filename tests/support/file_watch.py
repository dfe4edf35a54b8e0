"""Which files of a folder any process opens, seen by the kernel (Linux inotify through ctypes).

    with FileWatch(dataset / "data") as watch:
        ...  # anything, in this process or others
    assert watch.opened() == []

Opens by C++ code (pyarrow) and by other processes count too, which a patched Python function
would miss. `FileWatch.available()` is False where inotify is missing (the tests skip there).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import struct
import sys

IN_ACCESS, IN_OPEN = 0x1, 0x20
_HEADER = struct.Struct("iIII")  # wd, mask, cookie, length of the name that follows


def _libc():
    return ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)


class FileWatch:
    def __init__(self, folder):
        self.folder = folder
        self._fd = -1
        self._names: list[str] = []

    @staticmethod
    def available() -> bool:
        return sys.platform.startswith("linux") and hasattr(_libc(), "inotify_init1")

    def __enter__(self) -> FileWatch:
        libc = _libc()
        self._fd = libc.inotify_init1(os.O_NONBLOCK)
        if self._fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        if libc.inotify_add_watch(self._fd, os.fsencode(self.folder), IN_OPEN | IN_ACCESS) < 0:
            raise OSError(ctypes.get_errno(), f"inotify_add_watch {self.folder}")
        return self

    def _drain(self) -> None:
        while True:
            try:
                data = os.read(self._fd, 1 << 16)
            except BlockingIOError:
                return
            offset = 0
            while offset < len(data):
                _, _, _, length = _HEADER.unpack_from(data, offset)
                offset += _HEADER.size
                self._names.append(data[offset:offset + length].rstrip(b"\0").decode())
                offset += length

    def opened(self) -> list[str]:
        """Names of the folder's files opened or read since the watch began (repeats kept, in order)."""
        self._drain()
        return list(self._names)

    def __exit__(self, *exc) -> None:
        self._drain()
        os.close(self._fd)
