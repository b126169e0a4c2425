"""Prompt-cache files on disk.

Layout: ``<persist_dir>/<model fingerprint>-v<FORMAT_VERSION>/<sha256(file key)>.gzc``.
A file key (the prompt cache's ``name:<cache id>`` or ``anon:<token hash>``)
is never used as a path: it is hashed, so ``../../etc/passwd``, NUL bytes
or 10 kB ids all become the same 64 hex characters. Entries are segmented
by the model fingerprint, so another model can never load foreign KV, and by
format version, so an old layout is simply never read.

A file is the backend's serialized state, then the entry's metadata as JSON
(its file key, tokens, kind, owner, tool roster), then a trailer:
``meta length (4 bytes) | MAGIC | format version (4 bytes) | sha256 of
everything before``, all big endian. Opening the directory reads only the
metadata of each file (from its end) into ``index``, so an anonymous request
can find the longest cached prefix on disk without loading any state.

Writes are atomic: temp file in the same directory, fsync, rename, fsync of
the directory. A truncated, bit-flipped, foreign or mismatched file is a clean
miss (logged, and the bad file removed); a temp file left by a process killed
mid-write is swept when the directory is opened. Another process may still
be writing there (a restart overlapping the old process's final flush):
temp files carry their writer's pid and only the holder of the directory's
lock (``DirLock``) sweeps and prunes; see ``temp_is_stale``.

Runs on the engine's host thread (the state codec is the backend's, which
for MLX must run on that thread). Every I/O failure is logged and reported
as a miss or a failed save, never raised into a request.

Write-behind (``save_behind``): the host thread writes the state to the temp
file (the codec, the part that must run there) and hands the rest - the
metadata, the checksum, fsync, the rename - to one writer thread that
``DiskCache`` starts on first use and ``close`` joins. The writer touches
nothing but its own files: what it did comes back through ``collect`` on
the host thread, which alone updates the index. Writes of one file key land
in the order they were asked for; ``save``, ``load``, ``exists`` and ``delete``
of a key with a write in flight wait for it first. A dirty entry the memory
budget evicts is written this way too, listed in the index at once
(``provisional``), so a lookup still finds it while its write is in flight.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import hashlib
import json
import logging
import os
import queue
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator, MutableMapping
from pathlib import Path
from typing import Any

import attrs

from ..core.backend import StateFiles
from ..core.cache_plan import common_prefix
from ..core.cache_store import BLOCK_TOKENS
from ..core.errors import EngineFailure
from ..core.shared_dir import (
    TEMP_MAX_AGE,
    DirLock,
    NotRegularFile,
    open_regular,
    read_regular,
    temp_is_stale,
    temp_name,
)

__all__ = [
    "FORMAT_VERSION",
    "TEMP_MAX_AGE",
    "DirLock",
    "DiskCache",
    "DiskEntry",
    "DiskIndex",
    "Loaded",
    "safe_fingerprint",
    "temp_is_stale",
    "temp_name",
]

log = logging.getLogger("gezel_trio.persist")

FORMAT_VERSION = 2
MAGIC = b"GZTC"
_SEAL = len(MAGIC) + 4 + 32  # magic, version, sha256 of everything before it
_TAIL = 4 + _SEAL  # the metadata length, then the seal
_MAX_META = 64 * 1024 * 1024
_SUFFIX = ".gzc"
_TMP_SUFFIX = ".tmp.safetensors"
_SAFE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


@attrs.frozen
class DiskEntry:
    """What the index knows of one file without loading its state."""

    file_key: str
    tokens: tuple[int, ...]
    kind: str
    roster: str = ""
    owner: str | None = None
    size: int = 0
    mtime: float = 0.0
    # The entry's salt (``CacheRequest.salt``): only prompts of the same
    # salt may seed from it.
    salt: str = ""


class _Node:
    """One whole block of the disk index's trie (``DiskIndex``)."""

    __slots__ = ("children", "ends", "keys", "lengths", "tail_keys", "tails", "through")

    def __init__(self) -> None:
        self.children: dict[tuple[int, ...], _Node] = {}
        self.keys: list[tuple[int, ...]] = []  # of ``children``, sorted
        # File keys whose tokens pass this block, and those ending with it.
        self.through: dict[str, None] = {}
        self.ends: dict[str, None] = {}
        # File keys ending in a partial block after this one, by that block.
        self.tails: dict[tuple[int, ...], dict[str, None]] = {}
        self.tail_keys: list[tuple[int, ...]] = []  # of ``tails``, sorted
        self.lengths: collections.Counter[int] = collections.Counter()  # of ``tails``' keys


class DiskIndex(MutableMapping[str, DiskEntry]):
    """The disk entries by file key, and by their tokens: a trie of whole
    blocks, so the entry that seeds a prompt deepest is found by walking the
    prompt's blocks (``best``), never by comparing every entry with it (0.94 s
    per admission at 50,000 entries, before). ``total_bytes`` is kept too.

    A root per salt (``DiskEntry.salt``): a prompt is only ever walked
    against the entries of its own salt."""

    def __init__(self, block_tokens: int = BLOCK_TOKENS) -> None:
        self._block = block_tokens
        self._entries: dict[str, DiskEntry] = {}
        self._roots: dict[str, _Node] = {"": _Node()}
        self._bytes = 0
        # How many trie nodes a ``best`` looked at, for the tests that hold
        # its cost flat (a counter, not a timer).
        self.probes = 0

    def __getitem__(self, key: str) -> DiskEntry:
        return self._entries[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __setitem__(self, key: str, entry: DiskEntry) -> None:
        if key in self._entries:
            del self[key]
        self._entries[key] = entry
        self._bytes += entry.size
        node = self._roots.get(entry.salt)
        if node is None:
            node = self._roots[entry.salt] = _Node()
        tokens, b = entry.tokens, self._block
        node.through[key] = None
        whole = len(tokens) - len(tokens) % b
        for start in range(0, whole, b):
            chunk = tokens[start : start + b]
            child = node.children.get(chunk)
            if child is None:
                child = node.children[chunk] = _Node()
                bisect.insort(node.keys, chunk)
            node = child
            node.through[key] = None
        tail = tokens[whole:]
        if not tail:
            node.ends[key] = None
            return
        holders = node.tails.get(tail)
        if holders is None:
            holders = node.tails[tail] = {}
            bisect.insort(node.tail_keys, tail)
            node.lengths[len(tail)] += 1
        holders[key] = None

    def __delitem__(self, key: str) -> None:
        entry = self._entries.pop(key)
        self._bytes -= entry.size
        tokens, b = entry.tokens, self._block
        whole = len(tokens) - len(tokens) % b
        path = [self._roots[entry.salt]]
        for start in range(0, whole, b):
            path.append(path[-1].children[tokens[start : start + b]])
        last = path[-1]
        tail = tokens[whole:]
        if not tail:
            del last.ends[key]
        else:
            holders = last.tails[tail]
            del holders[key]
            if not holders:
                del last.tails[tail]
                del last.tail_keys[bisect.bisect_left(last.tail_keys, tail)]
                last.lengths[len(tail)] -= 1
                if not last.lengths[len(tail)]:
                    del last.lengths[len(tail)]
        for depth in range(len(path) - 1, -1, -1):
            node = path[depth]
            del node.through[key]
            if depth and not node.through:
                chunk = tokens[(depth - 1) * b : depth * b]
                parent = path[depth - 1]
                del parent.children[chunk]
                del parent.keys[bisect.bisect_left(parent.keys, chunk)]
        if entry.salt and not path[0].through:
            del self._roots[entry.salt]  # a salt's last entry: its root goes too

    @property
    def total_bytes(self) -> int:
        return self._bytes

    def best(
        self,
        prompt: tuple[int, ...],
        *,
        beat: int,
        trimmable: bool,
        skip: Callable[[str], bool],
        salt: str = "",
    ) -> DiskEntry | None:
        """The entry of ``salt`` that would seed ``prompt`` deeper than
        ``beat`` tokens (leaving one to compute), none that ``skip`` refuses:
        on a model whose caches rewind, the one sharing the longest prefix;
        otherwise the longest that is a prefix of the prompt."""
        root = self._roots.get(salt)
        if root is None:
            return None  # nothing of that salt on disk
        limit = len(prompt) - 1
        b = self._block
        # Walk the prompt's whole blocks as far as the trie has them.
        path = [root]
        while (len(path) - 1) * b + b <= limit + 1:
            start = (len(path) - 1) * b
            child = path[-1].children.get(prompt[start : start + b])
            if child is None:
                break
            path.append(child)
        self.probes += len(path)
        # Groups of file keys, each with how far its entries seed, deepest first.
        groups: list[tuple[int, dict[str, None]]] = []
        for depth in range(len(path) - 1, -1, -1):
            node, start = path[depth], depth * b
            chunk = prompt[start : start + b]
            if trimmable:
                if depth == len(path) - 1:
                    # Where the prompt leaves the trie: the whole blocks and
                    # the partial ones below sharing most of its next block
                    # are next to it in token order.
                    for block in _neighbours(node.keys, chunk):
                        self.probes += 1
                        reach = min(limit, start + common_prefix(block, chunk))
                        groups.append((reach, node.children[block].through))
                    for tail in _neighbours(node.tail_keys, chunk):
                        self.probes += 1
                        reach = min(limit, start + common_prefix(tail, chunk))
                        groups.append((reach, node.tails[tail]))
                groups.append((min(limit, start), node.through))
                continue
            for n in sorted(node.lengths, reverse=True):
                self.probes += 1
                if start + n <= limit and n <= len(chunk):
                    found = node.tails.get(chunk[:n])
                    if found:
                        groups.append((start + n, found))
            if start <= limit:
                groups.append((start, node.ends))
        groups.sort(key=lambda g: g[0], reverse=True)
        for reach, keys in groups:
            if reach <= beat:
                break
            for key in keys:
                if not skip(key):
                    return self._entries[key]
        return None


def _neighbours(keys: list[tuple[int, ...]], chunk: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The sorted ``keys`` on either side of where ``chunk`` would go: the
    two sharing the longest prefix with it."""
    i = bisect.bisect_left(keys, chunk)
    return keys[max(0, i - 1) : i + 1]


@attrs.frozen
class Loaded:
    state: Any
    tokens: tuple[int, ...]
    kind: str
    roster: str
    owner: str | None = None


@attrs.frozen
class _Staged:
    """A state written to its temp file, its metadata ready: what is left
    of the save needs no backend and runs on any thread."""

    file_key: str
    tokens: tuple[int, ...]
    kind: str
    roster: str
    owner: str | None
    tmp: Path
    final: Path
    meta: bytes
    # What the caller of save_behind gets back from collect.
    tag: Any = None
    salt: str = ""
    # Listed in the index before it landed (``save_behind``).
    provisional: bool = False


class _Writer:
    """The write-behind thread: seals staged files in order. ``outstanding``
    counts what was handed over and is not yet in ``done``."""

    def __init__(self, seal: Any) -> None:
        self._seal = seal
        self._jobs: queue.SimpleQueue[_Staged | None] = queue.SimpleQueue()
        self.done: collections.deque[tuple[_Staged, Exception | os.stat_result]] = (
            collections.deque()
        )
        self._idle = threading.Condition()
        self.outstanding = 0
        # A daemon: a write stuck in the kernel never holds the process past
        # its shutdown bound (the temp file is swept at the next start).
        self._thread = threading.Thread(target=self._run, name="gezel-cache-writer", daemon=True)
        self._thread.start()

    def put(self, job: _Staged) -> None:
        with self._idle:
            self.outstanding += 1
        self._jobs.put(job)

    def wait(self, timeout: float | None) -> bool:
        """Until every job handed over is done; ``False`` at ``timeout``."""
        with self._idle:
            return self._idle.wait_for(lambda: self.outstanding == 0, timeout)

    def stop(self, timeout: float | None) -> None:
        self._jobs.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                result: Exception | os.stat_result = self._seal(job)
            except Exception as exc:  # reported on the host thread, by collect
                result = exc
            with self._idle:
                self.done.append((job, result))
                self.outstanding -= 1
                self._idle.notify_all()


def safe_fingerprint(value: str) -> str:
    """An operator-given fingerprint, made safe as a directory name."""
    if _SAFE.match(value) and value not in (".", ".."):
        return value
    return hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def _file_key(cache_id: str) -> str:
    return hashlib.sha256(cache_id.encode("utf-8", "surrogatepass")).hexdigest()


class DiskCache:
    def __init__(self, root: Path, fingerprint: str, codec: StateFiles) -> None:
        self.fingerprint = safe_fingerprint(fingerprint)
        self.dir = Path(root) / f"{self.fingerprint}-v{FORMAT_VERSION}"
        self._codec = codec
        self.writable = True
        # file key -> what its file holds, read from the files' metadata.
        self.index = DiskIndex()
        # The write-behind thread, started by the first save_behind, and
        # how many of its writes per file key are not collected yet.
        self._writer: _Writer | None = None
        self._pending: collections.Counter[str] = collections.Counter()
        # Writes behind indexed already (a save, load or delete waited for
        # them) whose ``(tag, saved)`` the next ``collect`` reports.
        self._landed: list[tuple[Any, bool]] = []
        # The current write trouble, logged once per cause (/health shows it).
        self.problem: str | None = None
        # Another process may use the directory still (a restart overlapping
        # the old one's final flush): only the lock's holder sweeps and
        # prunes, and one that starts without it takes it (and reads the
        # index again, the other's last writes with it) once it is free.
        self.lock = DirLock(self.dir)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            if self.lock.acquire():
                self._sweep_temp_files()
            else:
                log.info("persist dir %s in use by another process: not pruning", self.dir)
        except OSError as exc:
            self.writable = False
            self.problem = f"persist dir unusable: {exc}"
            log.warning("persist dir %s unusable (%s): disk cache disabled", self.dir, exc)
            return
        self._read_index()

    def path_for(self, file_key: str) -> Path:
        return self.dir / (_file_key(file_key) + _SUFFIX)

    # --- write -------------------------------------------------------------

    def save(
        self,
        file_key: str,
        tokens: Iterable[int],
        state: Any,
        *,
        kind: str,
        roster: str,
        owner: str | None = None,
        salt: str = "",
    ) -> bool:
        """Write atomically; ``False`` (logged) on any failure."""
        self._settle(file_key)  # an older write behind must not land after this one
        staged = self._stage(
            file_key, tokens, state, kind=kind, roster=roster, owner=owner, salt=salt
        )
        if staged is None:
            return False
        try:
            result: Exception | os.stat_result = self._seal(staged)
        except Exception as exc:
            result = exc
        return self._finish(staged, result)

    def save_behind(
        self,
        file_key: str,
        tokens: Iterable[int],
        state: Any,
        *,
        kind: str,
        roster: str,
        owner: str | None = None,
        salt: str = "",
        tag: Any = None,
        provisional: bool = False,
    ) -> bool:
        """Write ``state`` to a temp file here (the codec's part) and leave
        the rest to the writer thread; ``False`` (logged) when even that
        failed. ``collect`` later reports ``(tag, saved)``. ``provisional``:
        the index lists the entry at once (an entry evicted from memory
        stays findable while its write is in flight; ``load`` waits for the
        write, and a failed write takes it out again)."""
        staged = self._stage(
            file_key, tokens, state, kind=kind, roster=roster, owner=owner, salt=salt
        )
        if staged is None:
            return False
        if self._writer is None:
            self._writer = _Writer(self._seal)
        self._pending[file_key] += 1
        if provisional:
            try:
                size = staged.tmp.stat().st_size + len(staged.meta) + _TAIL
            except OSError:
                size = 0
            self.index[file_key] = DiskEntry(
                file_key, staged.tokens, kind, roster, owner, size, time.time(), salt
            )
        self._writer.put(attrs.evolve(staged, tag=tag, provisional=provisional))
        return True

    @property
    def writes_in_flight(self) -> int:
        """Writes behind handed over and not collected yet."""
        return self._pending.total()

    def collect(self, timeout: float | None = 0.0) -> list[tuple[Any, bool]]:
        """The writes behind that finished, as ``(tag, saved)``, their files
        indexed; with a ``timeout``, first waits that long (``None``: for
        ever) for those in flight."""
        self._drain(timeout)
        out, self._landed = self._landed, []
        return out

    def close(self, timeout: float | None = None) -> list[tuple[Any, bool]]:
        """Wait (up to ``timeout`` seconds) for the writes behind, stop the
        writer thread; what finished, as ``collect`` reports it."""
        if self._writer is None:
            return []
        done = self.collect(timeout)
        self._writer.stop(0 if self._pending else timeout)
        self._writer = None
        return done

    def _settle(self, file_key: str) -> None:
        """A write behind of ``file_key`` still in flight lands first."""
        if file_key in self._pending:
            self._drain(None)

    def _drain(self, timeout: float | None) -> None:
        """Index the writes behind that finished (waiting up to ``timeout``
        for those in flight), keeping their outcome for ``collect``."""
        if self._writer is None:
            return
        if timeout != 0.0:
            self._writer.wait(timeout)
        while self._writer.done:
            staged, result = self._writer.done.popleft()
            self._pending[staged.file_key] -= 1
            if self._pending[staged.file_key] <= 0:
                del self._pending[staged.file_key]
            self._landed.append((staged.tag, self._finish(staged, result)))

    def _stage(
        self,
        file_key: str,
        tokens: Iterable[int],
        state: Any,
        *,
        kind: str,
        roster: str,
        owner: str | None,
        salt: str = "",
    ) -> _Staged | None:
        """The state in a temp file beside its final one: the codec's part,
        on the calling (host) thread. ``None`` (logged) on a failure."""
        if not self.writable:
            return None
        final = self.path_for(file_key)
        tmp = self.dir / temp_name(final.stem, _TMP_SUFFIX)
        tokens = tuple(tokens)
        meta = {
            "file_key": file_key,
            "tokens": list(tokens),
            "fingerprint": self.fingerprint,
            "format": FORMAT_VERSION,
            "kind": kind,
            "roster": roster,
            "owner": owner,
        }
        if salt:  # an unsalted file is written as before salts
            meta["salt"] = salt
        try:
            self.dir.mkdir(parents=True, exist_ok=True)  # removed while serving: recreate
            self._codec.dump_state(
                state, {"gezel_file_key": file_key, "gezel_file": final.stem}, tmp
            )
        except Exception as exc:  # OSError, or the codec's own errors
            self._trouble(exc)
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            return None
        blob = json.dumps(meta, separators=(",", ":")).encode()
        return _Staged(file_key, tokens, kind, roster, owner, tmp, final, blob, salt=salt)

    def _seal(self, staged: _Staged) -> os.stat_result:
        """The metadata, the checksum, fsync and the rename: no backend, any
        thread. Raises on a failure, the temp file removed."""
        tmp = staged.tmp
        try:
            with tmp.open("ab") as f:
                f.write(staged.meta + len(staged.meta).to_bytes(4, "big"))
            digest = hashlib.sha256()
            with tmp.open("rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    digest.update(block)
            with tmp.open("ab") as f:
                f.write(MAGIC + FORMAT_VERSION.to_bytes(4, "big") + digest.digest())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, staged.final)
            self._fsync_dir()
            return staged.final.stat()
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            raise

    def _finish(self, staged: _Staged, result: Exception | os.stat_result) -> bool:
        """A sealed write indexed, or a failed one reported (host thread)."""
        if isinstance(result, Exception):
            self._trouble(result)
            listed = self.index.get(staged.file_key)
            if staged.provisional and listed is not None and listed.tokens == staged.tokens:
                del self.index[staged.file_key]  # listed for a write that never landed
            return False
        self.index[staged.file_key] = DiskEntry(
            staged.file_key,
            staged.tokens,
            staged.kind,
            staged.roster,
            staged.owner,
            result.st_size,
            result.st_mtime,
            staged.salt,
        )
        if self.problem is not None:
            log.warning("cache saves work again (after: %s)", self.problem)
            self.problem = None
        return True

    def _forget(self, path: Path) -> None:
        """Tell the codec that ``path`` is gone (its own files of it go too)."""
        try:
            self._codec.forget_state(path)
        except Exception as exc:  # its files stay behind; the cache goes on
            log.warning("cache file %s: the codec's forget failed: %s", path.name, exc)

    def _trouble(self, exc: Exception) -> None:
        """A failed save: logged when its cause is new, not once per entry.
        The codec's own error may not say why (MLX reports a full disk as
        "Unable to write N bytes"): a small probe write names the OS's reason."""
        cause = self._probe() if not isinstance(exc, OSError) else None
        if cause is None:
            detail = str(getattr(exc, "strerror", None) or exc)
            cause = re.sub(r"/\S+|\d+", "_", detail)  # paths and sizes vary per entry
        if cause != self.problem:
            log.warning("cache saves failing in %s: %s", self.dir, cause)
        self.problem = cause

    # --- read --------------------------------------------------------------

    def load(self, file_key: str) -> Loaded | None:
        self._settle(file_key)
        path = self.path_for(file_key)
        try:
            # Only a regular file, read to the size fstat gives (the budget
            # bounds it), never to an end that may not come.
            data = read_regular(path)
        except FileNotFoundError:
            self.index.pop(file_key, None)
            return None
        except NotRegularFile as exc:
            log.warning("cache file %s skipped: %s", path.name, exc.strerror)
            self.index.pop(file_key, None)
            return None
        except OSError as exc:
            log.warning("cache read failed %s: %s", path.name, exc)
            return None
        reason = self._check(data)
        if reason is None:
            try:
                meta, payload = _split(data)
                state, _ = self._codec.load_state(payload, path)
                loaded = self._accept(file_key, state, meta)
            except EngineFailure:
                raise  # the engine is lost (a group's rank): not the file's fault
            except Exception as exc:  # a malformed payload is a miss, whatever raised
                reason = f"unreadable payload: {type(exc).__name__}: {exc}"
            else:
                if isinstance(loaded, str):
                    reason = loaded
                else:
                    return loaded
        log.warning("cache file %s rejected (%s): treated as a miss", path.name, reason)
        path.unlink(missing_ok=True)
        self._forget(path)
        self.index.pop(file_key, None)
        return None

    def delete(self, file_key: str) -> bool:
        self._settle(file_key)  # or the write in flight would bring the file back
        self.index.pop(file_key, None)
        path = self.path_for(file_key)
        try:
            path.unlink()
        except FileNotFoundError:
            return False
        except OSError as exc:
            log.warning("cache delete failed: %s", exc)
            return False
        self._forget(path)
        return True

    def exists(self, file_key: str) -> bool:
        """Whether ``file_key`` has a file (a write of it in flight lands first)."""
        self._settle(file_key)
        return self.path_for(file_key).is_file()

    def files(self) -> list[tuple[str, int, float]]:
        """``(file name, bytes, mtime)`` of every entry, oldest first."""
        out = []
        try:
            for p in self.dir.glob("*" + _SUFFIX):
                try:
                    st = p.stat()
                except OSError:
                    continue
                out.append((p.name, st.st_size, st.st_mtime))
        except OSError:
            return []
        return sorted(out, key=lambda t: (t[2], t[0]))

    def prune(self, budget_bytes: int, protect: Iterable[str] = ()) -> list[str]:
        """Delete the oldest files until under 80% of ``budget_bytes``, never
        the newest file (the last save, maybe the shutdown flush) nor the files
        of ``protect``ed file keys. Returns the deleted file names. Nothing
        is deleted unless this process holds the directory's lock."""
        if not self._lock_held():
            return []
        if budget_bytes <= 0 or self.index.total_bytes <= budget_bytes:
            # The index's bytes first: globbing and stat-ing every file on
            # every save cost the host thread time that grew with the disk.
            return []
        files = self.files()
        total = sum(size for _, size, _ in files)
        if budget_bytes <= 0 or total <= budget_bytes or not files:
            return []
        keep = {_file_key(c) + _SUFFIX for c in protect}
        keep.add(files[-1][0])
        target = int(budget_bytes * 0.8)
        deleted = []
        for name, size, _ in files:
            if total <= target:
                break
            if name in keep:
                continue
            try:
                (self.dir / name).unlink()
            except OSError:
                continue
            self._forget(self.dir / name)
            total -= size
            deleted.append(name)
        if deleted:
            gone = set(deleted)
            for key in [k for k in self.index if _file_key(k) + _SUFFIX in gone]:
                del self.index[key]
        return deleted

    @property
    def total_bytes(self) -> int:
        return self.index.total_bytes

    # --- internals ---------------------------------------------------------

    @staticmethod
    def _check(data: bytes) -> str | None:
        if len(data) < _TAIL + 8:
            return "truncated"
        trailer = data[-_SEAL:]
        if trailer[: len(MAGIC)] != MAGIC:
            return "no trailer (truncated or foreign)"
        version = int.from_bytes(trailer[len(MAGIC) : len(MAGIC) + 4], "big")
        if version != FORMAT_VERSION:
            return f"format version {version}, expected {FORMAT_VERSION}"
        if hashlib.sha256(data[:-_SEAL]).digest() != trailer[-32:]:
            return "checksum mismatch"
        return None

    def _accept(self, file_key: str, state: Any, meta: dict[str, Any]) -> Loaded | str:
        if meta.get("fingerprint") != self.fingerprint:
            return f"fingerprint {meta.get('fingerprint')!r} is another model's"
        if meta.get("file_key") != file_key:
            return "belongs to another cache id"
        tokens = _tokens(meta)
        if tokens is None:
            return "token list malformed"
        owner = meta.get("owner")
        return Loaded(
            state=state,
            tokens=tokens,
            kind=str(meta.get("kind", "session")),
            roster=str(meta.get("roster", "")),
            owner=owner if isinstance(owner, str) else None,
        )

    def _read_index(self) -> None:
        """Every file's metadata, read from its end; checksums are verified
        when a file is loaded, so a damaged one costs a miss then. A file
        whose metadata is malformed (not JSON, not an object, fields of the
        wrong type) is removed with one log line: one bad file never stops
        the server from starting."""
        for path in self.dir.glob("*" + _SUFFIX):
            try:
                entry = self._index_entry(path)
            except NotRegularFile as exc:
                log.warning("cache file %s skipped: %s", path.name, exc.strerror)
                continue
            except OSError as exc:
                log.warning("cache file %s unreadable (%s): skipped", path.name, exc)
                continue
            if isinstance(entry, str):
                log.warning("cache file %s malformed (%s): removed", path.name, entry)
                with contextlib.suppress(OSError):
                    path.unlink()
                    self._forget(path)
            elif entry is not None:
                self.index[entry.file_key] = entry
        if self.index:
            log.info("disk cache %s: %d entries indexed", self.dir, len(self.index))

    def _index_entry(self, path: Path) -> DiskEntry | str | None:
        """``path``'s index entry; ``None`` for a file this index skips (too
        short to be sealed, or another layout's), the reason for one whose
        metadata is malformed. Raises ``OSError``."""
        with open_regular(path) as f:
            size = f.seek(0, os.SEEK_END)
            if size < _TAIL + 8:
                return None
            f.seek(size - _TAIL)
            tail = f.read(_TAIL)
            n = int.from_bytes(tail[:4], "big")
            if tail[4 : 4 + len(MAGIC)] != MAGIC or not 0 < n <= min(_MAX_META, size - _TAIL):
                return None
            f.seek(size - _TAIL - n)
            raw = f.read(n)
        mtime = path.stat().st_mtime
        try:
            meta = json.loads(raw)
        except (ValueError, RecursionError) as exc:  # RecursionError: nesting too deep
            return f"metadata is not JSON: {type(exc).__name__}"
        if not isinstance(meta, dict):
            return f"metadata is a JSON {type(meta).__name__}, not an object"
        key, tokens = meta.get("file_key"), _tokens(meta)
        if not isinstance(key, str):
            return "file key missing or not a string"
        if tokens is None:
            return "token list malformed"
        if meta.get("fingerprint") != self.fingerprint or path.name != _file_key(key) + _SUFFIX:
            return None  # another model's or another key's: load() rejects it if asked
        owner, salt = meta.get("owner"), meta.get("salt", "")
        if not isinstance(salt, str):
            return "salt not a string"
        return DiskEntry(
            key,
            tokens,
            str(meta.get("kind", "session")),
            str(meta.get("roster", "")),
            owner if isinstance(owner, str) else None,
            size,
            mtime,
            salt,
        )

    def _lock_held(self) -> bool:
        if self.lock.held:
            return True
        if not self.lock.acquire():
            return False
        # The other process is gone: what it wrote last is ours to find.
        self._sweep_temp_files()
        self._read_index()
        return True

    def _sweep_temp_files(self) -> None:
        for p in self.dir.glob(".*" + _TMP_SUFFIX):
            if not temp_is_stale(p):
                continue
            p.unlink(missing_ok=True)
            log.info("removed a temp file left by an interrupted write: %s", p.name)

    def _probe(self) -> str | None:
        """The OS's reason a write in the directory fails now, if it does."""
        probe = self.dir / ".gezel-write-probe"
        try:
            with probe.open("wb") as f:
                f.write(bytes(1 << 16))
                f.flush()
                os.fsync(f.fileno())
        except OSError as exc:
            return exc.strerror or type(exc).__name__
        finally:
            with contextlib.suppress(OSError):
                probe.unlink()
        return None

    def _fsync_dir(self) -> None:
        fd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _split(data: bytes) -> tuple[dict[str, Any], bytes]:
    """A checked file's metadata and state payload."""
    body = data[:-_SEAL]
    n = int.from_bytes(body[-4:], "big")
    if not 0 < n <= len(body) - 4:
        raise ValueError("metadata length out of range")
    meta = json.loads(body[-4 - n : -4])
    if not isinstance(meta, dict):
        raise ValueError("metadata is not an object")
    return meta, body[: -4 - n]


def _tokens(meta: dict[str, Any]) -> tuple[int, ...] | None:
    tokens = meta.get("tokens")
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in tokens
    ):
        return None
    return tuple(tokens)


def _short(cache_id: str) -> str:
    return cache_id if len(cache_id) <= 80 else cache_id[:77] + "..."
