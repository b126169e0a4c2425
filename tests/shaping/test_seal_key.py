"""The key sealed replies are signed with never starts empty.

A key file left 0 bytes long by a first start on a full disk, then read
back by a start with room, signed every ``encrypted_content`` with the
empty key: anyone could forge one. The key is written as a temp file,
fsynced and renamed, so the file is whole or absent; and every start
checks the length of what it reads, replacing a short file. The full disk
is real: a child process whose file-size limit is 0 (``RLIMIT_FSIZE``,
no root needed) cannot write one byte into a file.
"""

from __future__ import annotations

import logging
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from gezel_trio.shaping.replies import SECRET_BYTES, GeneratedReply, ReplySeal, load_secret

FINGERPRINT = "demo-model"
REPLY = GeneratedReply((1, 2), (3, 4, 5))

_ON_A_FULL_DISK = """
import resource, signal, sys
from pathlib import Path
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))
from gezel_trio.shaping.replies import load_secret
print(len(load_secret(Path(sys.argv[1]))))
"""


def test_a_first_start_on_a_full_disk_leaves_no_empty_key(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-c", _ON_A_FULL_DISK, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    # The process seals with a key of its own, and says it could not keep it.
    assert out.stdout.split() == [str(SECRET_BYTES)]
    assert "cannot write" in out.stderr
    key = tmp_path / "reply-seal.key"
    assert not key.exists(), f"left {key.stat().st_size} bytes"
    assert [p.name for p in tmp_path.iterdir()] == [], "a temp file was left behind"
    # A start with room makes a whole key, and the next one reads it back.
    made = load_secret(tmp_path)
    assert len(made) == SECRET_BYTES
    assert key.read_bytes() == made == load_secret(tmp_path)
    assert stat.S_IMODE(key.stat().st_mode) == 0o600


@pytest.mark.parametrize("kept", [b"", b"\x00" * 16, b"\x07" * (SECRET_BYTES - 1)])
def test_a_short_key_file_is_replaced_never_used(
    tmp_path: Path, kept: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    key = tmp_path / "reply-seal.key"
    key.write_bytes(kept)
    with caplog.at_level(logging.WARNING):
        secret = load_secret(tmp_path)
    assert len(secret) == SECRET_BYTES
    assert key.read_bytes() == secret
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert [r.getMessage() for r in caplog.records if "replaced" in r.getMessage()] == [
        f"{key} holds {len(kept)} bytes, not a {SECRET_BYTES}-byte key: replaced "
        "(replies sealed under the old one are ignored)"
    ]


def test_a_blob_sealed_with_an_empty_key_is_not_this_servers(tmp_path: Path) -> None:
    forged = ReplySeal(b"", FINGERPRINT).seal(REPLY)
    (tmp_path / "reply-seal.key").write_bytes(b"")
    seal = ReplySeal(load_secret(tmp_path), FINGERPRINT)
    assert seal.open(forged) is None
    assert seal.open(seal.seal(REPLY)) == REPLY


def test_a_whole_key_is_kept_across_starts(tmp_path: Path) -> None:
    first = load_secret(tmp_path)
    os.utime(tmp_path / "reply-seal.key")
    assert load_secret(tmp_path) == first
