"""Persistence under faults: killed writers, a full disk, a
read-only disk, a directory removed while serving.

* SIGKILL during a write, 200 trials: a writer process saves entries (1 MiB
  each, written in 64 KiB pieces) and reports each completed save. Half the
  trials run in lockstep with the test and are killed right after a piece it
  chose at random (so the kill surely lands mid-file); the other half run
  free and are killed at a random moment. The next open loads every
  completed entry, byte for byte, and every file present is whole - never a
  torn one. Writers are forked from a preloaded ``forkserver`` so 200
  trials take seconds.
* ENOSPC, EROFS, removal: the real server runs in a private user and mount
  namespace (``unshare``) with its persist dir on a 512 KiB tmpfs, so the
  disk really fills, is really remounted read-only (``nsenter`` into the
  namespace) and its directory really vanishes. Nothing is simulated:
  requests keep being served, each cause is logged once, and ``/health``
  reports degraded persistence until saves work again.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import multiprocessing
import os
import random
import subprocess
import sys
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import httpx2 as httpx
import pytest

from gezel_trio.host.persist import DiskCache

PIECE = 64 * 1024
PIECES = 16
TRIALS = int(os.environ.get("GEZEL_KILL_TRIALS", "200"))


def _payload(cache_id: str) -> bytes:
    seed = hashlib.sha256(cache_id.encode()).digest()
    return (seed * (PIECE // len(seed))) * PIECES


class _SlowCodec:
    """Writes a 1 MiB state in flushed pieces, so a kill can land mid-file,
    and its metadata in a header line (as the real codec keeps it in the file).

    In a lockstep writer each flushed piece is announced on ``_STEP`` and the
    writer waits for a go-ahead, so the parent can kill it after exactly the
    piece it chose."""

    def dump_state(self, state: Any, metadata: dict[str, str], path: Path) -> None:
        with path.open("wb") as f:
            f.write(json.dumps(metadata).encode() + b"\n")
            for i in range(PIECES):
                f.write(state[i * PIECE : (i + 1) * PIECE])
                f.flush()
                if _STEP is not None:
                    _STEP.send(("piece", i))
                    _STEP.recv()

    def forget_state(self, path: Path) -> None:
        pass

    def load_state(self, payload: bytes, path: Path) -> tuple[Any, dict[str, str]]:
        header, _, state = payload.partition(b"\n")
        return state, json.loads(header)


_STEP: Connection | None = None


def _writer(root: str, trial: int, conn: Connection, lockstep: bool) -> None:
    """The child: save entries until killed, reporting each completed one."""
    global _STEP
    _STEP = conn if lockstep else None
    disk = DiskCache(Path(root), "fp", _SlowCodec())
    n = 0
    while True:
        key = f"t{trial}-e{n}"
        if not disk.save(key, [n], _payload(key), kind="session", roster=""):
            raise SystemExit(f"save {key} failed")
        conn.send(("done", n))
        n += 1


def test_sigkill_during_persist_writes_never_leaves_a_torn_entry(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["gezel_trio.host.persist", "tests.host.test_faults"])
    rng = random.Random(9)
    loaded = torn = mid_write = chosen_mid_write = 0
    for trial in range(TRIALS):
        root = tmp_path / f"trial{trial}"
        # Even trials run in lockstep and die after a chosen piece of the
        # write after ``wanted`` (a kill known to land mid-file); odd trials
        # run free and die at whatever moment the timer picks.
        lockstep = trial % 2 == 0
        conn, child = ctx.Pipe(duplex=True)
        proc = ctx.Process(target=_writer, args=(str(root), trial, child, lockstep))
        proc.start()
        child.close()
        done = -1
        wanted = rng.randrange(0, 3)
        kill_after_piece = rng.randrange(PIECES)
        while conn.poll(30):
            kind, n = conn.recv()
            if kind == "done":
                done = n
                if not lockstep and done >= wanted:
                    break
            elif done >= wanted and n == kill_after_piece:
                chosen_mid_write += 1
                break
            else:
                conn.send("go")
        if not lockstep and rng.random() < 0.7:
            conn.poll(rng.uniform(0, 0.02))
        proc.kill()
        proc.join(10)
        with contextlib.suppress(EOFError, OSError):
            while conn.poll():
                kind, n = conn.recv()
                if kind == "done":
                    done = n
        conn.close()
        assert proc.exitcode == -9, "the writer died of SIGKILL"
        segment = next(root.iterdir())
        mid_write += any(p.name.endswith(".tmp.safetensors") for p in segment.iterdir())
        # The next start: the temp files are swept, every file is checked.
        disk = DiskCache(root, "fp", _SlowCodec())
        for n in range(done + 1):
            key = f"t{trial}-e{n}"
            entry = disk.load(key)
            assert entry is not None, f"completed entry {key} was lost"
            assert entry.state == _payload(key)
            loaded += 1
        for path in disk.dir.iterdir():
            assert not path.name.endswith(".tmp.safetensors"), "a temp file survived the sweep"
        # Any other file (renamed before its progress message went out) is whole.
        extra = done + 1
        if disk.exists(f"t{trial}-e{extra}"):
            entry = disk.load(f"t{trial}-e{extra}")
            if entry is None:
                torn += 1
    assert torn == 0
    assert loaded > 0
    # Every lockstep kill landed inside a write and left a temp file to sweep.
    assert chosen_mid_write == (TRIALS + 1) // 2
    assert mid_write >= chosen_mid_write, f"only {mid_write} of {TRIALS} kills left a temp file"


# --- a real full, read-only and vanished disk --------------------------------


def _can_unshare() -> bool:
    probe = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "true"], capture_output=True
    )
    return probe.returncode == 0


needs_namespaces = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not _can_unshare(),
    reason="needs user and mount namespaces (unshare)",
)


class _Jailed:
    def __init__(self, proc: subprocess.Popen[str], url: str, log: Path, mnt: Path) -> None:
        self.proc = proc
        self.url = url
        self.log = log
        self.mnt = mnt
        self.client = httpx.Client(base_url=url, timeout=60)

    def inside(self, *cmd: str) -> None:
        """Run ``cmd`` in the server's namespaces (where the tmpfs is)."""
        subprocess.run(
            ["nsenter", "-t", str(self.proc.pid), "-U", "-m", "--preserve-credentials", *cmd],
            check=True,
            capture_output=True,
        )

    def chat(self, cache_id: str) -> int:
        body = {
            "messages": [{"role": "user", "content": f"Entry {cache_id}: " + "word " * 40}],
            "max_tokens": 3,
            "cache_id": cache_id,
        }
        return self.client.post("/v1/chat/completions", json=body).status_code

    def flush(self) -> int:
        return int(self.client.post("/admin/flush").json()["flushed"])

    def health(self) -> dict[str, Any]:
        body: dict[str, Any] = self.client.get("/health").json()
        return body

    def log_count(self, text: str) -> int:
        return self.log.read_text().count(text)


@pytest.fixture
def jailed(dense_model: Path, tmp_path: Path) -> Iterator[_Jailed]:
    mnt = tmp_path / "persist"
    mnt.mkdir()
    log = tmp_path / "server.log"
    script = (
        f"mount -t tmpfs -o size=512k tmpfs {mnt} && exec {sys.executable} -m gezel_trio serve"
        f" --model {dense_model} --port 0 --persist-dir {mnt} --log-level WARNING"
    )
    with log.open("w") as err:
        proc = subprocess.Popen(
            ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
    assert proc.stdout is not None
    url = None
    for line in proc.stdout:
        if line.startswith("gezel-trio listening on "):
            url = line.split()[-1]
            break
    assert url is not None, log.read_text()
    jail = _Jailed(proc, url, log, mnt)
    try:
        yield jail
    finally:
        jail.client.close()
        proc.terminate()
        proc.wait(30)
        proc.stdout.close()


@needs_namespaces
@pytest.mark.slow
def test_a_full_read_only_or_vanished_disk_never_stops_serving(jailed: _Jailed) -> None:
    # Fill the 512 KiB tmpfs: each entry is ~60 KiB of KV on the tiny model.
    written = 0
    for i in range(16):
        assert jailed.chat(f"fill-{i}") == 200
        written += jailed.flush()
    assert 0 < written < 16, "the disk filled"
    health = jailed.health()
    assert health["status"] == "degraded"
    assert "No space left on device" in health["reasons"][0]
    assert jailed.log_count("No space left on device") == 1, "one log line per cause"
    # Free space: saves work again and /health says so.
    for i in range(16):
        jailed.client.delete(f"/v1/cache/fill-{i}")
    assert jailed.chat("after-full") == 200
    assert jailed.flush() == 1
    assert jailed.health()["status"] == "ok"

    jailed.inside("mount", "-o", "remount,ro", str(jailed.mnt))
    for i in range(3):
        assert jailed.chat(f"ro-{i}") == 200
        assert jailed.flush() == 0
    health = jailed.health()
    assert health["status"] == "degraded"
    assert "Read-only file system" in health["reasons"][0]
    assert jailed.log_count("Read-only file system") == 1
    jailed.inside("mount", "-o", "remount,rw", str(jailed.mnt))
    assert jailed.flush() == 3
    assert jailed.health()["status"] == "ok"

    # The segment directory vanishes: the next save recreates it.
    jailed.inside("sh", "-c", f"rm -rf {jailed.mnt}/*")
    assert jailed.chat("after-rm") == 200
    assert jailed.flush() == 1
    assert jailed.health()["status"] == "ok"
    assert jailed.proc.poll() is None
