"""A name in the persist directory that is not a regular file never stops
a start and is never read: a FIFO named like a prompt-cache file or a
stored response hung startup (its ``open`` waits for a writer), and a
symlink to ``/dev/zero`` is endless. Every loader of the directory (the
disk cache's index and loads, stored responses, the reply ledger, the seal
key, remembered weight digests) opens only regular files and skips the
rest with a log line.

Each loader runs on a thread joined with a bound: a hang is the bug, so
the bound is there only to turn one into a failure (a FIFO that hung is
then opened for writing, which releases its reader).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import queue
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import openai
import pytest
import trio

from gezel_trio.core.shared_dir import NotRegularFile, read_regular
from gezel_trio.host import persist
from gezel_trio.host.persist import DiskCache
from gezel_trio.http.response_store import ResponseStore, StoredResponse
from gezel_trio.mlx.fingerprint import weights_digest
from gezel_trio.shaping.replies import SECRET_BYTES, ReplyLedger, load_ledger, load_secret
from tests.support.fakes import FakeOps, FakeState
from tests.support.process import spawn_server, start_server, stop_server, terminate

T = TypeVar("T")
HANG = 20.0
TOKENS = tuple(range(20))
KINDS = ["fifo", "socket", "zero"]


@pytest.fixture
def sockets() -> Iterator[list[socket.socket]]:
    held: list[socket.socket] = []
    yield held
    for s in held:
        s.close()


def special(path: Path, kind: str, sockets: list[socket.socket]) -> Path:
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "socket":
        s = socket.socket(socket.AF_UNIX)
        with contextlib.chdir(path.parent):  # a socket's path is at most 107 bytes
            s.bind(path.name)
        sockets.append(s)
    else:
        path.symlink_to("/dev/zero")
    return path


def finishes(fn: Callable[[], T], fifos: list[Path]) -> T:
    """``fn()`` on a thread; a failure if it does not return within HANG."""
    out: list[T] = []
    errors: list[Exception] = []

    def run() -> None:
        try:
            out.append(fn())
        except Exception as exc:
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(HANG)
    hung = thread.is_alive()
    if hung:
        for fifo in fifos:  # release the reader so the thread ends
            with contextlib.suppress(OSError):  # ENXIO: nobody reads this one
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join()
    assert not hung, f"still reading after {HANG} s"
    if errors:
        raise errors[0]
    return out[0]


@pytest.mark.parametrize("kind", KINDS)
def test_read_regular_refuses_at_once(
    tmp_path: Path, kind: str, sockets: list[socket.socket]
) -> None:
    path = special(tmp_path / "x", kind, sockets)
    with pytest.raises(NotRegularFile):
        finishes(lambda: read_regular(path, 1 << 20), [path] if kind == "fifo" else [])


@pytest.mark.parametrize("kind", KINDS)
def test_the_disk_cache_skips_what_is_not_a_file(
    tmp_path: Path, kind: str, sockets: list[socket.socket]
) -> None:
    good = DiskCache(tmp_path, "m", FakeOps(trimmable=True))
    assert good.save("good", TOKENS, FakeState(TOKENS, True), kind="session", roster="r")
    odd = special(good.dir / (persist._file_key("odd") + ".gzc"), kind, sockets)
    fifos = [odd] if kind == "fifo" else []
    reopened = finishes(lambda: DiskCache(tmp_path, "m", FakeOps(trimmable=True)), fifos)
    assert "good" in reopened.index
    assert finishes(lambda: reopened.load("odd"), fifos) is None
    assert reopened.load("good") is not None
    assert odd.is_symlink() or odd.exists(), "a name that is not a cache file is left alone"


async def _read_back(directory: Path) -> ResponseStore:
    store = ResponseStore(1 << 20, directory)
    async with trio.open_nursery() as nursery:
        await nursery.start(store.run)
        nursery.cancel_scope.cancel()
    return store


@pytest.mark.parametrize("kind", KINDS)
def test_stored_responses_skip_what_is_not_a_file(
    tmp_path: Path, kind: str, sockets: list[socket.socket], caplog: pytest.LogCaptureFixture
) -> None:
    directory = tmp_path / "responses"
    directory.mkdir()
    rec = StoredResponse("good", {"id": "good", "status": "completed"}, [], "good")
    (directory / (hashlib.sha256(b"good").hexdigest() + ".json")).write_bytes(rec.to_json())
    odd = special(directory / (hashlib.sha256(b"odd").hexdigest() + ".json"), kind, sockets)
    with caplog.at_level(logging.WARNING):
        store = finishes(lambda: trio.run(_read_back, directory), [odd] if kind == "fifo" else [])
    assert [r.id for r in store._records.values()] == ["good"]
    assert odd.is_symlink() or odd.exists(), "skipped, not removed"
    assert len([r for r in caplog.records if odd.name in r.getMessage()]) == 1


@pytest.mark.parametrize("kind", KINDS)
def test_the_reply_ledger_and_seal_key_skip_what_is_not_a_file(
    tmp_path: Path, kind: str, sockets: list[socket.socket]
) -> None:
    ledger_file = special(tmp_path / "replies-0123456789abcdef.bin", kind, sockets)
    key_file = special(tmp_path / "reply-seal.key", kind, sockets)
    fifos = [ledger_file, key_file] if kind == "fifo" else []
    ledger = ReplyLedger(1000)
    assert finishes(lambda: load_ledger(ledger, ledger_file), fifos) == 0
    secret = finishes(lambda: load_secret(tmp_path), fifos)
    assert len(secret) == SECRET_BYTES
    # The key is made anew, as a regular file.
    assert not key_file.is_symlink()
    assert key_file.read_bytes() == secret


@pytest.mark.parametrize("kind", KINDS)
def test_a_remembered_weight_digest_that_is_not_a_file_is_hashed_again(
    tmp_path: Path, kind: str, sockets: list[socket.socket]
) -> None:
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"w" * 1000)
    digests = tmp_path / "weight-digests"
    first = weights_digest(weights, digests)
    [record] = list(digests.iterdir())
    record.unlink()
    special(record, kind, sockets)
    again = finishes(lambda: weights_digest(weights, digests), [record] if kind == "fifo" else [])
    assert again == first == hashlib.sha256(b"w" * 1000).hexdigest()


@pytest.mark.slow
def test_a_server_starts_beside_fifos_named_like_its_files(
    dense_model: Path, tmp_path: Path, sockets: list[socket.socket]
) -> None:
    """The real server, restarted on a persist directory where a FIFO sits
    under a cache file's name, a stored response's, the ledger's, the key's
    and each remembered weight digest's, and a symlink to ``/dev/zero`` beside them: it listens, and
    answers."""
    persist_dir = tmp_path / "persist"
    first = start_server(dense_model, "--persist-dir", str(persist_dir))
    assert stop_server(first) == 0
    [segment] = persist_dir.glob(f"*-v{persist.FORMAT_VERSION}")
    [ledger] = persist_dir.glob("replies-*.bin")
    digests = list((persist_dir / "weight-digests").iterdir())
    for path in [ledger, persist_dir / "reply-seal.key", *digests]:
        path.unlink()
    cache_fifo = special(segment / (persist._file_key("odd") + ".gzc"), "fifo", sockets)
    response_fifo = special(persist_dir / "responses" / ("0" * 64 + ".json"), "fifo", sockets)
    for path in [*digests, ledger, persist_dir / "reply-seal.key"]:
        special(path, "fifo", sockets)
    special(segment / (persist._file_key("zero") + ".gzc"), "zero", sockets)
    proc = spawn_server(dense_model, "--persist-dir", str(persist_dir))
    assert proc.stdout is not None
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout or ()], daemon=True)
    reader.start()
    url = None
    deadline = time.monotonic() + HANG
    with contextlib.suppress(queue.Empty):
        while url is None:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            if line.startswith("gezel-trio listening on "):
                url = line.split()[-1]
    if url is None:
        proc.kill()
    try:
        assert url is not None, f"not listening after {HANG} s"
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        with client:
            answer = client.completions.create(model="m", prompt="The harbour", max_tokens=3)
        assert answer.choices[0].finish_reason == "length"
    finally:
        assert terminate(proc) == 0 or url is None
        reader.join()  # the pipe's end: the process is gone
        assert proc.stdout is not None
        proc.stdout.close()
    # Skipped, not removed (the key, ledger and digests were written anew).
    assert stat.S_ISFIFO(cache_fifo.lstat().st_mode)
    assert stat.S_ISFIFO(response_fifo.lstat().st_mode)
    assert (persist_dir / "reply-seal.key").stat().st_size == SECRET_BYTES
