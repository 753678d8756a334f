"""One run per folder at a time: an advisory lock on `<folder>/.minippo.lock`.

The lock is `flock`, held by the open file: the kernel drops it when the process ends however it
ends (SIGKILL, OOM), so a killed run never leaves a lock behind that blocks the next one. The file
keeps the holder's pid, host and start time, to name it in the refusal.
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from pathlib import Path

LOCK_NAME = ".minippo.lock"


class FolderBusy(RuntimeError):
    """Another live run holds the folder."""


class FolderLock:
    def __init__(self, folder: str | Path, flag: str) -> None:
        self.path = Path(folder) / LOCK_NAME
        self.flag = flag  # the flag that chose the folder, for the message
        self._fd: int | None = None

    def acquire(self) -> FolderLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = self.path.read_text(encoding="utf-8", errors="replace").strip() or "unknown process"
            os.close(fd)
            raise FolderBusy(f"{self.flag} {self.path.parent} is in use by another run ({holder}): wait for it to end, "
                             f"or give this run its own {self.flag}") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}".encode())
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock; the file stays (removing it would race a new holder)
            self._fd = None
