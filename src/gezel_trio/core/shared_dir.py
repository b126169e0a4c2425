"""A directory several processes may write at once: temp files named by
their writer's pid, and an advisory lock that says who may remove files it
did not write (a supervisor's restart overlapping the old process's
shutdown flush shares its persist directory for a while)."""

from __future__ import annotations

import fcntl
import os
import secrets
import time
from pathlib import Path

__all__ = ["TEMP_MAX_AGE", "DirLock", "temp_is_stale", "temp_name"]

# A temp file is named ``.<stem>.<pid>.<random><suffix>``: a process that
# opens the directory while another still writes there (a supervisor's
# restart overlapping the old process's shutdown flush) leaves the other's
# temp files alone while that pid lives. One older than this is swept
# whatever its pid says (the pid may have been reused).
TEMP_MAX_AGE = 3600.0


def temp_name(stem: str, suffix: str) -> str:
    """A temp file's name for ``stem``, carrying this process's pid."""
    return f".{stem}.{os.getpid()}.{secrets.token_hex(4)}{suffix}"


def temp_is_stale(path: Path) -> bool:
    """A temp file no live process is writing: its pid is gone (or it has
    none: an older layout's), or it is older than ``TEMP_MAX_AGE``."""
    try:
        age = time.time() - path.stat().st_mtime
    except OSError:
        return False  # gone already
    parts = path.name.split(".")
    pid = int(parts[2]) if len(parts) > 3 and parts[2].isdigit() else None
    if pid is None or age > TEMP_MAX_AGE:
        return True
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False  # alive, another user's
    return False


class DirLock:
    """An advisory lock (``flock``) on the directory itself (no file of its
    own in it), held from a successful ``acquire`` until the process exits
    (the kernel releases it then, however the process ended). Only its holder removes files it did
    not write: the sweep of temp files and pruning by budget. Per open file
    description: two holders in one process exclude each other too."""

    def __init__(self, directory: Path) -> None:
        self.path = directory
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> bool:
        """Take the lock if it is free, without waiting; whether held."""
        if self._fd is not None:
            return True
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return False
        self._fd = fd
        return True

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor releases the lock
            self._fd = None
