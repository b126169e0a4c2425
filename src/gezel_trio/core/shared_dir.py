"""A directory several processes may write at once: temp files named by
their writer's pid, and an advisory lock that says who may remove files it
did not write (a supervisor's restart overlapping the old process's
shutdown flush shares its persist directory for a while)."""

from __future__ import annotations

import errno
import fcntl
import os
import secrets
import stat
import time
from pathlib import Path
from typing import BinaryIO

__all__ = [
    "TEMP_MAX_AGE",
    "DirLock",
    "FileTooLarge",
    "NotRegularFile",
    "open_regular",
    "read_regular",
    "temp_is_stale",
    "temp_name",
    "write_whole",
]

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


class NotRegularFile(OSError):
    """A name in a persist directory that is not a regular file: a FIFO, a
    socket, a device (a symlink to ``/dev/zero``), a directory. Its loader
    skips it with one log line; nothing waits on it or reads it."""


class FileTooLarge(OSError):
    """A regular file larger than its reader takes (``read_regular``)."""


def open_regular(path: Path) -> BinaryIO:
    """``path`` open for reading if it is a regular file (a symlink to one
    counts); ``NotRegularFile`` for anything else, at once. ``O_NONBLOCK``
    keeps a FIFO's open from waiting for a writer (a FIFO named like a
    cache file hung startup), and ``fstat`` checks what was opened, not a
    name that could be swapped in between."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ENXIO:  # what opening a socket says
            raise NotRegularFile(errno.EINVAL, "a socket, not a regular file", str(path)) from exc
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = {
                stat.S_IFIFO: "a FIFO",
                stat.S_IFSOCK: "a socket",
                stat.S_IFCHR: "a character device",
                stat.S_IFBLK: "a block device",
                stat.S_IFDIR: "a directory",
            }.get(stat.S_IFMT(mode), "not a regular file")
            raise NotRegularFile(errno.EINVAL, f"{kind}, not a regular file", str(path))
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: Path, most: int | None = None) -> bytes:
    """All of the regular file ``path`` (``NotRegularFile`` for a FIFO,
    socket or device), which must be at most ``most`` bytes
    (``FileTooLarge`` otherwise): no more than the size ``fstat`` gave is read, so a file
    that grows meanwhile is not followed."""
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        if most is not None and size > most:
            raise FileTooLarge(errno.EFBIG, f"{size} bytes, more than {most}", str(path))
        return f.read(size)


def write_whole(path: Path, data: bytes, *, replace: bool) -> None:
    """``data`` into ``path`` whole or not at all: a temp file beside it
    (mode 0600), written, checked and fsynced, then renamed over ``path``
    (``replace``) or linked to it (``FileExistsError`` if another process
    made it first), and the directory fsynced. On a full disk ``path`` is
    left as it was and the ``OSError`` raised."""
    tmp = path.with_name(temp_name(path.stem, ".tmp"))
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        try:
            written = os.write(fd, data)
            if written != len(data):
                raise OSError(errno.ENOSPC, f"wrote {written} of {len(data)} bytes", str(tmp))
            os.fsync(fd)
        finally:
            os.close(fd)
        if replace:
            os.replace(tmp, path)
        else:
            os.link(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    dir_fd = os.open(path.parent, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
