"""Stored Responses (``store: true``) and the background responses that run
on their own (``background: true``).

``ResponseStore.run`` is a task in the server's nursery (``server.serve``)::

    ResponseStore.run ── nursery
                          ├─ the disk writer     writes and deletes files, in order
                          └─ one task per background response, in its own
                             cancel scope (POST /v1/responses/{id}/cancel)

The HTTP layer hands it work: ``put`` and ``get`` are synchronous (a stored
response is visible to ``GET`` as soon as ``response.completed`` is sent),
``start_background`` starts a job in the store's nursery and ``cancel``
cancels one. Without ``run`` (an app built in a test without the server)
the store holds responses in memory and refuses background work.

Bounded: records are kept in least-recently-used order and the oldest are
dropped once their JSON exceeds ``budget_bytes`` (never a running
background response, nor the one just stored). With a ``directory``
(``--persist-dir``) each record is also a file, ``<sha256(id)>.json``,
written atomically (a temp file, fsync, rename, fsync of the directory, as
the prompt cache's files); at start the newest files within the budget are
read back, so after a restart ``GET`` and ``previous_response_id`` still
find them. Only the holder of the directory's lock (``persist.DirLock``)
removes temp files of dead writers and records beyond the budget, so a
restart overlapping the old process's final flush loses none of it. A file
that does not parse, or holds fields of the wrong shapes, is removed. A
failed write or delete (a full disk, a read-only or vanished directory, any
error of the writer) costs the record its persistence, never the request:
it is logged once per kind of failure until a write works again, counted
(``failed_writes``), and named in ``/health`` (``problem``: the server is
"degraded" until a write works again).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import attrs
import trio

from ..core.shared_dir import (
    DirLock,
    FileTooLarge,
    NotRegularFile,
    read_regular,
    temp_is_stale,
    temp_name,
)
from .strict import dump_json

__all__ = ["FORMAT_VERSION", "ResponseStore", "StoredResponse"]

log = logging.getLogger("gezel_trio.responses")

FORMAT_VERSION = 1
_SUFFIX = ".json"
_TMP_SUFFIX = ".tmp"
# Bound on the last writes at shutdown.
FLUSH_TIMEOUT = 10.0


@attrs.define
class StoredResponse:
    """One stored response: ``body`` is the Response object as served;
    ``messages`` the conversation through it in chat-template form (without
    its ``instructions``, which a continuation does not inherit); ``root``
    the first response of its chain (it names the chain's prompt-cache
    entry); ``owner`` the tenant that made it (``http.tenancy``: ``""``
    on a server without keys), kept in its file."""

    id: str
    body: dict[str, Any]
    messages: list[dict[str, Any]]
    root: str
    size: int = 0
    owner: str = ""

    def to_json(self) -> bytes:
        data = {
            "format": FORMAT_VERSION,
            "id": self.id,
            "body": self.body,
            "messages": self.messages,
            "root": self.root,
        }
        if self.owner:  # a record of a server without keys is written as before
            data["owner"] = self.owner
        return dump_json(data, compact=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> StoredResponse:
        """Raises ``ValueError`` for anything but a record of this format
        with fields of the right shapes."""
        try:
            data = json.loads(raw)
        except RecursionError:  # nesting too deep to parse
            raise ValueError("nested too deeply") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT_VERSION:
            raise ValueError("not a stored response of this format")
        rid, body, messages, root = (data.get(k) for k in ("id", "body", "messages", "root"))
        if not (isinstance(rid, str) and isinstance(root, str) and isinstance(body, dict)):
            raise ValueError("id, root or body malformed")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise ValueError("messages malformed")
        owner = data.get("owner", "")
        if not isinstance(owner, str):
            raise ValueError("owner malformed")
        rec = cls(rid, body, messages, root, owner=owner)
        rec.size = len(raw)
        return rec


def _file_name(rid: str) -> str:
    return hashlib.sha256(rid.encode("utf-8", "surrogatepass")).hexdigest() + _SUFFIX


class ResponseStore:
    def __init__(self, budget_bytes: int = 256 * 1024 * 1024, directory: Path | None = None):
        self.budget_bytes = budget_bytes
        self.directory = Path(directory) if directory is not None else None
        self._records: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0
        self._jobs: dict[str, trio.CancelScope] = {}
        self._done: dict[str, trio.Event] = {}
        self._cancelled: set[str] = set()
        self._nursery: trio.Nursery | None = None
        # Disk work not yet done: record id -> its bytes, or None to delete.
        self._pending: dict[str, bytes | None] = {}
        self._wake = trio.Event()
        # Why stored responses are not persisted now (``None``: they are),
        # how many writes and deletes failed in all, and the kinds of
        # failure warned of since the last write that worked.
        self.problem: str | None = None
        self.failed_writes = 0
        self._warned: set[str] = set()
        self._lock = DirLock(self.directory) if self.directory is not None else None

    # --- the task -----------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[ResponseStore]) -> None:
        """Read the directory back, then serve until cancelled; the last
        writes are flushed (bounded by ``FLUSH_TIMEOUT``) on the way out."""
        if self.directory is not None:
            loaded = await trio.to_thread.run_sync(self._load_directory)
            for rec in loaded:
                self._records[rec.id] = rec
                self._bytes += rec.size
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._write_loop)
                task_status.started(self)
                await trio.sleep_forever()
        finally:
            self._nursery = None
            with trio.CancelScope(shield=True), trio.move_on_after(FLUSH_TIMEOUT):
                await self._flush()

    # --- records ------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._records)

    @property
    def total_bytes(self) -> int:
        return self._bytes

    def get(self, rid: str, owner: str | None = None) -> StoredResponse | None:
        """The record ``rid``; with ``owner``, only if that tenant made it
        (another's is ``None``, as an unknown id, and is not touched)."""
        rec = self._records.get(rid)
        if rec is None or (owner is not None and rec.owner != owner):
            return None
        self._records.move_to_end(rid)
        return rec

    def put(self, rec: StoredResponse) -> None:
        """Store (or replace) ``rec``, then drop the least recently used
        records beyond the budget."""
        raw = rec.to_json()
        rec.size = len(raw)
        old = self._records.pop(rec.id, None)
        if old is not None:
            self._bytes -= old.size
        self._records[rec.id] = rec
        self._bytes += rec.size
        self._queue(rec.id, raw)
        self._evict(keep=rec.id)

    def delete(self, rid: str) -> bool:
        """Forget a response (a running background one is cancelled)."""
        rec = self._records.pop(rid, None)
        if rec is None:
            return False
        self._bytes -= rec.size
        scope = self._jobs.get(rid)
        if scope is not None:
            self._cancelled.add(rid)
            scope.cancel()
        self._queue(rid, None)
        return True

    def _evict(self, keep: str) -> None:
        for rid in list(self._records):
            if self._bytes <= self.budget_bytes:
                return
            if rid == keep or rid in self._jobs:
                continue
            rec = self._records.pop(rid)
            self._bytes -= rec.size
            self._queue(rid, None)
            log.debug("stored response %s dropped (budget)", rid)

    # --- background responses ----------------------------------------------

    @property
    def running(self) -> bool:
        return self._nursery is not None

    def start_background(self, rid: str, job: Callable[[], Awaitable[None]]) -> None:
        """Run ``job`` in the store's nursery, cancellable by ``cancel(rid)``."""
        if self._nursery is None:
            raise RuntimeError("the response store is not running")
        scope = trio.CancelScope()
        self._jobs[rid] = scope
        self._done[rid] = trio.Event()
        self._nursery.start_soon(self._run_job, rid, scope, job)

    async def _run_job(
        self, rid: str, scope: trio.CancelScope, job: Callable[[], Awaitable[None]]
    ) -> None:
        try:
            with scope:
                await job()
        finally:
            self._jobs.pop(rid, None)
            self._cancelled.discard(rid)
            self._done.pop(rid).set()

    def was_cancelled(self, rid: str) -> bool:
        """Whether ``cancel`` (not a shutdown) stopped this job."""
        return rid in self._cancelled

    async def cancel(self, rid: str) -> None:
        """Cancel a running background response and wait until its job has
        recorded how it ended; nothing if none runs."""
        scope = self._jobs.get(rid)
        if scope is None:
            return
        done = self._done[rid]
        self._cancelled.add(rid)
        scope.cancel()
        await done.wait()

    # --- disk ---------------------------------------------------------------

    def _queue(self, rid: str, raw: bytes | None) -> None:
        if self.directory is None:
            return
        self._pending[rid] = raw
        self._wake.set()

    async def _write_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake = trio.Event()
            await self._flush()

    async def _flush(self) -> None:
        while self._pending:
            batch, self._pending = self._pending, {}
            await trio.to_thread.run_sync(self._apply, batch)

    def _apply(self, batch: dict[str, bytes | None]) -> None:
        """On a worker thread: write or delete each record's file."""
        assert self.directory is not None
        for rid, raw in batch.items():
            path = self.directory / _file_name(rid)
            try:
                if raw is None:
                    path.unlink(missing_ok=True)
                else:
                    self._write(path, raw)
            except Exception as exc:  # any writer error: this thread must not die of it
                self._failed(exc)
                continue
            if raw is not None and self.problem is not None:
                log.warning("stored responses are persisted again (after: %s)", self.problem)
                self.problem = None
                self._warned.clear()

    def _failed(self, exc: Exception) -> None:
        """A failed write or delete: counted, shown in ``/health``, and
        warned of once per kind until a write works again."""
        detail = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        cause = f"{type(exc).__name__}: {detail}"
        self.failed_writes += 1
        self.problem = cause
        if cause not in self._warned:
            self._warned.add(cause)
            log.warning("stored responses are not persisted: %s", cause)

    def _write(self, path: Path, raw: bytes) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(temp_name(path.stem, _TMP_SUFFIX))
        try:
            with tmp.open("wb") as f:
                f.write(raw)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            raise
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _load_directory(self) -> list[StoredResponse]:
        """On a worker thread: the newest records that fit the budget, oldest
        first; older files beyond it, temp files and unreadable ones are removed."""
        assert self.directory is not None
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            paths = list(self.directory.iterdir())
            # Another process may still write here (a restart overlapping
            # the old one's final flush): without the directory's lock
            # nothing is removed but a file that does not parse.
            owner = self._lock is not None and self._lock.acquire()
        except OSError as exc:
            self.problem = f"{type(exc).__name__}: {exc.strerror or exc}"
            log.warning("stored responses directory unusable: %s", self.problem)
            return []
        files: list[tuple[float, Path]] = []
        for path in paths:
            try:
                if path.name.endswith(_TMP_SUFFIX):
                    if owner and temp_is_stale(path):
                        path.unlink()  # a write cut short by a crash
                elif path.suffix == _SUFFIX:
                    files.append((path.stat().st_mtime, path))
            except OSError:
                continue
        files.sort(reverse=True)
        kept: list[StoredResponse] = []
        total = 0
        for _, path in files:
            try:
                # Only a regular file (a FIFO's open waits for a writer), and
                # none larger than the whole store may be.
                raw = read_regular(path, self.budget_bytes)
                rec = StoredResponse.from_json(raw)
                if path.name != _file_name(rec.id):
                    raise ValueError("the file's name does not match its id")
            except NotRegularFile as exc:
                log.warning("stored response %s skipped: %s", path.name, exc.strerror)
                continue
            except FileTooLarge:
                # Beyond the budget on its own: pruned as any record beyond it.
                if owner:
                    with contextlib.suppress(OSError):
                        path.unlink()
                continue
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.warning("stored response %s unreadable (%s): removed", path.name, exc)
                with contextlib.suppress(OSError):
                    path.unlink()
                continue
            if rec.body.get("status") in ("queued", "in_progress"):
                # Its job died with the previous process.
                rec.body["status"] = "failed"
                rec.body["error"] = {
                    "code": "server_error",
                    "message": "the server stopped before this response finished",
                }
            if total + rec.size > self.budget_bytes:
                if owner:
                    with contextlib.suppress(OSError):
                        path.unlink()
                continue
            total += rec.size
            kept.append(rec)
        kept.reverse()
        if kept:
            log.info("%d stored responses read back from %s", len(kept), self.directory)
        return kept
