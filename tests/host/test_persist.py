"""Disk persistence faults: every bad file is a clean miss, nothing
is written outside the persist dir, and an interrupted write leaves nothing
behind once the directory is reopened."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gezel_trio.host.persist import FORMAT_VERSION, DiskCache, safe_fingerprint
from tests.support.fakes import FakeOps, FakeState

TOKENS = tuple(range(50))


def disk(root: Path, fp: str = "model-a") -> DiskCache:
    return DiskCache(root, fp, FakeOps(trimmable=True))


def save(d: DiskCache, key: str = "session-1") -> Path:
    assert d.save(key, TOKENS, FakeState(TOKENS, True), kind="session", roster="r")
    return d.path_for(key)


def test_round_trip(tmp_path: Path) -> None:
    d = disk(tmp_path)
    save(d)
    loaded = d.load("session-1")
    assert loaded is not None
    assert loaded.tokens == TOKENS
    assert loaded.state == FakeState(TOKENS, True)
    assert loaded.roster == "r"


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda b: b[: len(b) // 2], id="truncated"),
        pytest.param(lambda b: b[:10] + bytes([b[10] ^ 0xFF]) + b[11:], id="flipped-byte"),
        pytest.param(lambda b: b[:-20] + bytes([b[-20] ^ 1]) + b[-19:], id="flipped-checksum"),
        pytest.param(lambda b: b"", id="empty"),
        pytest.param(lambda b: b"x" * 200, id="garbage"),
    ],
)
def test_damaged_file_is_a_clean_miss_and_is_removed(tmp_path: Path, damage) -> None:  # type: ignore[no-untyped-def]
    d = disk(tmp_path)
    path = save(d)
    path.write_bytes(damage(path.read_bytes()))
    assert d.load("session-1") is None
    assert not path.exists()


def test_wrong_format_version_is_a_miss(tmp_path: Path) -> None:
    d = disk(tmp_path)
    path = save(d)
    data = bytearray(path.read_bytes())
    data[-36:-32] = (FORMAT_VERSION + 1).to_bytes(4, "big")
    path.write_bytes(bytes(data))
    assert d.load("session-1") is None


def test_another_models_file_never_loads(tmp_path: Path) -> None:
    a = disk(tmp_path, "model-a")
    b = disk(tmp_path, "model-b")
    path = save(a)
    assert b.load("session-1") is None  # separate directory: not even seen
    # Copied into b's directory by hand, its own metadata still refuses it.
    b.path_for("session-1").write_bytes(path.read_bytes())
    assert b.load("session-1") is None


def test_a_file_for_another_id_is_refused(tmp_path: Path) -> None:
    d = disk(tmp_path)
    path = save(d, "a")
    d.path_for("b").write_bytes(path.read_bytes())
    assert d.load("b") is None


HOSTILE = [
    "../../etc/passwd",
    "/etc/passwd",
    "a\x00b",
    "x" * 10_000,
    "ｓｅｓｓｉｏｎ",  # fullwidth look-alikes
    "séssion",
    "..",
    "\\windows\\system32",
]


@pytest.mark.parametrize("cache_id", HOSTILE)
def test_hostile_ids_stay_inside_the_persist_dir(tmp_path: Path, cache_id: str) -> None:
    root = tmp_path / "persist"
    d = disk(root)
    path = save(d, cache_id)
    assert path.parent == d.dir
    assert d.dir.resolve().is_relative_to(root.resolve())
    everything = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert everything == [path]
    loaded = d.load(cache_id)
    assert loaded is not None
    assert loaded.tokens == TOKENS
    assert d.load("session") is None


def test_hostile_fingerprint_is_made_safe(tmp_path: Path) -> None:
    for fp in ("../../x", "/abs", "a/b", "..", "ok-fp.1"):
        d = disk(tmp_path / "p", fp)
        assert d.dir.parent == tmp_path / "p"
    assert safe_fingerprint("ok-fp.1") == "ok-fp.1"


def test_unwritable_persist_dir_disables_saves_without_crashing(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    d = disk(blocker)
    assert not d.writable
    assert not d.save("s", TOKENS, FakeState(TOKENS, True), kind="session", roster="")
    assert d.load("s") is None


def test_disk_budget_prunes_oldest_but_never_newest_or_protected(tmp_path: Path) -> None:
    d = disk(tmp_path)
    for i, key in enumerate(["old", "pinned", "mid", "new"]):
        path = save(d, key)
        os.utime(path, (1000 + i, 1000 + i))
    size = d.path_for("old").stat().st_size
    deleted = d.prune(budget_bytes=int(size * 2.5), protect=["pinned"])
    left = {n for n, _, _ in d.files()}
    assert d.path_for("new").name in left
    assert d.path_for("pinned").name in left
    assert d.path_for("old").name in deleted
    assert sum(s for _, s, _ in d.files()) <= size * 2.5 or len(left) == 2


KILL_SCRIPT = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from gezel_trio.host.persist import DiskCache

    class SlowCodec:
        def dump_state(self, state, metadata, path):
            with open(path, "wb") as f:
                f.write(b"partial" * 1000)
                f.flush()
                print("writing", flush=True)
                sys.stdin.read()  # blocks until the parent kills us

        def forget_state(self, path):
            pass

        def load_state(self, payload, path):
            raise AssertionError("never loaded")

    disk = DiskCache(Path(sys.argv[1]), "fp", SlowCodec())
    disk.save("s", [1, 2], None, kind="session", roster="")
    """
)


def test_sigkill_mid_write_leaves_no_entry_and_no_temp_file(tmp_path: Path) -> None:
    root = tmp_path / "persist"
    proc = subprocess.Popen(
        [sys.executable, "-c", KILL_SCRIPT, str(root)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "writing"  # the write is under way
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stdout.close()
    assert proc.stdin is not None
    proc.stdin.close()
    leftovers = list(root.rglob("*.tmp.safetensors"))
    assert leftovers, "the killed writer left its temp file"
    d = disk(root, "fp")  # reopening (a restart) sweeps it
    assert list(root.rglob("*.tmp.safetensors")) == []
    assert d.load("s") is None
    assert d.files() == []
