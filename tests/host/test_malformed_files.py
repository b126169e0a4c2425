"""One malformed file in the persist directory never stops a start: a
prompt-cache file whose sealed metadata is valid JSON of the wrong shape,
and a stored response whose JSON is, are each removed with a log line, and
the good files beside them are read back."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gezel_trio.host import persist
from gezel_trio.host.persist import FORMAT_VERSION, DiskCache
from gezel_trio.http.response_store import ResponseStore, StoredResponse
from tests.support.fakes import FakeOps, FakeState

TOKENS = tuple(range(20))

# Any JSON value, objects with the metadata's own keys among the others.
_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text()
_keys = st.sampled_from(["file_key", "tokens", "fingerprint", "kind", "owner", "roster", "x"])
_json = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_keys | st.text(), inner),
    max_leaves=12,
)
_deep = st.integers(min_value=1, max_value=100_000).map(lambda n: "[" * n + "]" * n)
_SHAPES = _json.map(lambda v: json.dumps(v).encode()) | _deep.map(str.encode)


def _sealed(payload: bytes, meta: bytes) -> bytes:
    """A file as the disk cache writes it, with ``meta`` as its metadata."""
    body = payload + meta + len(meta).to_bytes(4, "big")
    return body + persist.MAGIC + FORMAT_VERSION.to_bytes(4, "big") + hashlib.sha256(body).digest()


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(meta=_SHAPES)
def test_any_metadata_shape_is_skipped_or_indexed_never_fatal(tmp_path: Path, meta: bytes) -> None:
    root = tmp_path / "fuzz"
    good = DiskCache(root, "m", FakeOps(trimmable=True))
    assert good.save("good", TOKENS, FakeState(TOKENS, True), kind="session", roster="r")
    bad = good.dir / ("f" * 64 + ".gzc")
    bad.write_bytes(_sealed(b"\0" * 16, meta))
    reopened = DiskCache(root, "m", FakeOps(trimmable=True))
    assert "good" in reopened.index
    assert reopened.load("good") is not None
    for path in root.rglob("*.gzc"):
        path.unlink()


def test_metadata_that_is_not_an_object_is_removed(tmp_path: Path) -> None:
    d = DiskCache(tmp_path, "m", FakeOps(trimmable=True))
    shapes = [
        b"[1, 2]",
        b'"text"',
        b"17",
        b"null",
        b'{"file_key": 3, "tokens": []}',
        b'{"file_key": "k", "tokens": "abc"}',
        b"[" * 50_000 + b"]" * 50_000,
    ]
    bad = [d.dir / (f"{i:064x}" + ".gzc") for i in range(len(shapes))]
    for path, meta in zip(bad, shapes, strict=True):
        path.write_bytes(_sealed(b"\0" * 16, meta))
    reopened = DiskCache(tmp_path, "m", FakeOps(trimmable=True))
    assert reopened.index == {}
    assert not any(path.exists() for path in bad)


def _record(rid: str) -> bytes:
    return StoredResponse(rid, {"id": rid, "status": "completed"}, [], rid).to_json()


_RECORD_FIELDS = st.fixed_dictionaries(
    {"format": st.just(1)},
    optional={k: _json for k in ("id", "body", "messages", "root")},
)


async def _read_back(directory: Path) -> ResponseStore:
    store = ResponseStore(1 << 20, directory)
    async with trio.open_nursery() as nursery:
        await nursery.start(store.run)
        nursery.cancel_scope.cancel()
    return store


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=_RECORD_FIELDS | _json)
def test_any_stored_response_shape_is_removed_or_read_never_fatal(
    tmp_path: Path, data: Any
) -> None:
    directory = tmp_path / "responses"
    directory.mkdir(exist_ok=True)
    (directory / hashlib.sha256(b"good").hexdigest()).with_suffix(".json").write_bytes(
        _record("good")
    )
    odd = directory / ("e" * 64 + ".json")
    odd.write_text(json.dumps(data))
    store = trio.run(_read_back, directory)
    assert store.get("good") is not None
    got = [rec for rec in store._records.values() if rec.id != "good"]
    for rec in got:  # only a record of the right shapes is read back
        assert isinstance(rec.body, dict)
        assert isinstance(rec.messages, list)
        assert all(isinstance(m, dict) for m in rec.messages)
    for path in directory.iterdir():
        path.unlink()


def test_stored_responses_of_the_wrong_shapes_are_removed(tmp_path: Path) -> None:
    directory = tmp_path / "responses"
    directory.mkdir()
    good = directory / (hashlib.sha256(b"good").hexdigest() + ".json")
    good.write_bytes(_record("good"))
    shapes = [
        b'{"format": 1, "id": "a", "body": {}, "messages": ["text"], "root": "a"}',
        b'{"format": 1, "id": "a", "body": [["k", 1]], "messages": [], "root": "a"}',
        b'{"format": 1, "id": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
    ]
    bad = [directory / (f"{i:064x}" + ".json") for i in range(len(shapes))]
    for path, raw in zip(bad, shapes, strict=True):
        path.write_bytes(raw)
    store = trio.run(_read_back, directory)
    assert [rec.id for rec in store._records.values()] == ["good"]
    assert not any(path.exists() for path in bad)
