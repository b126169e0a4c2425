"""A large body never holds the event loop: it is parsed, structured and
checked on a worker thread, and the checks of a token-id list are one C pass.

The test times no request: a Trio instrument records the longest single
task step while an 8 MB body is refused. Parsing on the Trio thread made one
step of several seconds (6.4 s measured); off it, no step comes near the
bound, which is far above a normal step (well under 10 ms)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx2 as httpx
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from gezel_trio.core.errors import InvalidRequest
from gezel_trio.http import strict
from gezel_trio.http.strict import parse_json, parse_json_yielding
from tests.support.inprocess import served

HANG = 120
LONGEST_STEP_S = 1.0


class LongestStep(trio.abc.Instrument):
    """The longest time one Trio task step held the thread."""

    def __init__(self) -> None:
        self.longest = 0.0
        # None until a step begins: the instrument is added mid-step.
        self._began: float | None = None

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self._began = time.perf_counter()

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        if self._began is not None:
            self.longest = max(self.longest, time.perf_counter() - self._began)


def _ids_body(field: str, count: int, **rest: object) -> bytes:
    return json.dumps({field: [1] * count, **rest}, separators=(",", ":")).encode()


async def test_an_8mb_prompt_of_token_ids_is_refused_without_holding_the_loop(
    dense_model: Path,
) -> None:
    body = _ids_body("prompt", 4_000_000, max_tokens=1)
    assert len(body) > 7_900_000
    with trio.fail_after(HANG):
        async with served(dense_model) as (_engine, url), httpx.AsyncClient(base_url=url) as client:
            steps = LongestStep()
            trio.lowlevel.add_instrument(steps)
            try:
                r = await client.post(
                    "/v1/completions",
                    content=body,
                    headers={"Content-Type": "application/json"},
                    timeout=HANG,
                )
            finally:
                trio.lowlevel.remove_instrument(steps)
            assert r.status_code == 400
            assert r.json()["error"]["param"] == "prompt"
            assert steps.longest < LONGEST_STEP_S, f"one step held the loop {steps.longest:.2f} s"
            # The server serves on.
            assert (await client.get("/health")).json()["status"] == "ok"


async def test_a_large_valid_body_still_runs(dense_model: Path) -> None:
    # 200k token ids (1.2 MB): parsed on a worker thread, then detokenized.
    body = _ids_body("tokens", 200_000)
    with trio.fail_after(HANG):
        async with served(dense_model) as (_engine, url), httpx.AsyncClient(base_url=url) as client:
            r = await client.post(
                "/detokenize",
                content=body,
                headers={"Content-Type": "application/json"},
                timeout=HANG,
            )
            assert r.status_code == 200
            assert isinstance(r.json()["prompt"], str)


# Bodies yajl reads otherwise than Python's json, or that only Python reads:
# each must come out of the piecewise parse exactly as out of parse_json.
TRICKY = [
    b'{"a": 1, "a": 2, "b": 3}',
    b'{"x": [1.5, 1e400, -1e400, 1e-400, -0.0, -0, 1E5, 0.1, 123456789012345678901234567890]}',
    b'{"x": NaN}',
    b'{"x": [Infinity]}',
    b'{"x": -Infinity}',
    b'{"x": "\\ud800"}',
    b'{"x": "\\udc00 low first"}',
    b'{"x": "\\ud83d\\ude00"}',
    b'{"x": "\xed\xa0\x80"}',
    b'{"x": "\xff"}',
    b'\xef\xbb\xbf{"bom": 1}',
    '{"utf16": "é"}'.encode("utf-16"),
    b'{"x": 1} trailing',
    b'{"x": 1}\x00',
    b'{"x": 1}\x0c',
    b'\x0b{"x": 1}',
    b'{"x": 1}\r\n\t ',
    b'{"x": [' + b"9" * 5000 + b"]}",
    b'{"x": "' + b"9" * 5000 + b'"}',
    b'{"x": ' + b"[" * 400 + b"]" * 400 + b"}",
    b'{"x": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    b'{"x": ' + b"[" * 100 + b"1.5" + b"]" * 100 + b"}",
    b'{"x": "a\x01b"}',
    b'{"x": "\\u0000\\/\\n"}',
    b'{"x": [1, 2,]}',
    b"",
    b"1.5",
    b'"text"',
    b'{"x": [true, false, null, "s", 1, 2.5, {"y": [0.25]}]}',
]


def _outcome(parse: Any, raw: bytes) -> tuple[str, Any]:
    try:
        return "value", parse(raw)
    except InvalidRequest as err:
        return "refused", err.param


@pytest.fixture(autouse=True)
def _piecewise_always(monkeypatch: pytest.MonkeyPatch) -> None:
    # Short bodies, of few values, are parsed in one call: these must not be.
    monkeypatch.setattr(strict, "_FEW_VALUES", 0)


@pytest.mark.parametrize("raw", TRICKY)
def test_the_piecewise_parse_gives_what_parse_json_gives(raw: bytes) -> None:
    got = _outcome(parse_json_yielding, raw)
    want = _outcome(parse_json, raw)
    assert repr(got) == repr(want)  # repr: NaN-free, -0.0 and 0 told apart
    if got[0] == "value":
        assert _types(got[1]) == _types(want[1])


def _types(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _types(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_types(v) for v in value]
    return type(value).__name__


def _longest_wait(body: bytes) -> tuple[float, float]:
    """The longest this thread waited to run while a worker thread parsed
    ``body``, and how long the parse took."""
    done = threading.Event()
    took: list[float] = []

    def parse() -> None:
        done.wait(0.05)  # this thread is looping first
        began = time.perf_counter()
        parse_json_yielding(body)
        took.append(time.perf_counter() - began)
        done.set()

    worker = threading.Thread(target=parse)
    worker.start()
    longest, last = 0.0, time.perf_counter()
    while not done.is_set():
        time.sleep(0.0005)
        now = time.perf_counter()
        longest, last = max(longest, now - last), now
    worker.join()
    return longest, took[0]


def test_the_piecewise_parse_lets_other_threads_run() -> None:
    # While a worker thread parses 8 MB, this thread runs between its
    # pieces: the longest wait for the GIL is a small part of the parse
    # (json.loads in one call made it all of it: a ratio near 1). The best
    # of three, so that a loaded machine's own pauses do not decide it.
    body = _ids_body("prompt", 4_000_000, max_tokens=1)
    runs = [_longest_wait(body) for _ in range(3)]
    longest, took = min(runs, key=lambda run: run[0] / run[1])
    assert longest < took / 3, f"waited {longest:.3f} s of a {took:.3f} s parse"


_LEAVES = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text()
    # Lone surrogates too (JSON escapes can carry them; Python's writer
    # escapes them, or writes their bytes with surrogatepass).
    | st.text(st.characters(exclude_categories=()))
    | st.sampled_from(["\ud800", "a\udfff", "\ud83d\ude00", "\U0001f600"])
)
_VALUES = st.recursive(
    _LEAVES,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(), inner, max_size=5),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(value=_VALUES, ascii_only=st.booleans(), spaced=st.booleans())
def test_the_piecewise_parse_agrees_on_any_json(value: Any, ascii_only: bool, spaced: bool) -> None:
    separators = (", ", ": ") if spaced else (",", ":")
    raw = json.dumps(value, ensure_ascii=ascii_only, separators=separators).encode(
        "utf-8", "surrogatepass"
    )
    got = _outcome(parse_json_yielding, raw)
    want = _outcome(parse_json, raw)
    assert repr(got) == repr(want)
    if got[0] == "value":
        assert _types(got[1]) == _types(want[1])


# --- the engine's view and the freeing, off the loop ------------------------

_PARTS = [{"type": "text", "text": "a"}] * 50
_INPUT_TEXT = {"type": "input_text", "text": "a"}


def _many_parts(path: str) -> dict[str, Any]:
    """A body over the inline size whose bulk is many small objects: 64
    turns of 50 content parts each (the 4,096-turn version of it held the
    loop 37-73 ms building the engine's view, 15-21 ms freeing it)."""
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": _PARTS} for i in range(65)]
    if path == "/v1/responses":
        items = [
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "a"}] * 50,
            }
            for _ in range(65)
        ]
        return {"input": items, "max_output_tokens": 16}
    if path == "/v1/completions":
        # Four-digit ids: over the inline size in 3,000 tokens (a prompt of
        # 9,000 one-digit ones took the tiny model 10 s to prefill).
        return {"prompt": [2000] * 3000, "max_tokens": 1}
    return {"messages": turns, "max_tokens": 1}


# The route's parse function and the view it builds, by module global name.
_ROUTES = {
    "/v1/chat/completions": ("openai_chat", "parse_chat_request", "chat_request"),
    "/v1/messages": ("anthropic_messages", "parse_messages_request", "chat_request"),
    "/v1/responses": ("openai_responses", "parse_responses_request", "_input_messages"),
    "/v1/completions": ("openai_completions", "parse_completion_request", "completion_request"),
}


@pytest.mark.parametrize("path", list(_ROUTES))
async def test_a_large_bodys_view_is_built_and_freed_off_the_loop(
    dense_model: Path, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib
    import weakref

    module = importlib.import_module(f"gezel_trio.http.{_ROUTES[path][0]}")
    parse_name, view_name = _ROUTES[path][1:]
    loop = threading.current_thread()
    viewed_on: list[threading.Thread] = []
    freed_on: list[threading.Thread] = []
    parse, view = getattr(module, parse_name), getattr(module, view_name)

    def watched_parse(body: Any, *args: Any) -> Any:
        req = parse(body, *args)
        weakref.finalize(req, lambda: freed_on.append(threading.current_thread()))
        return req

    def watched_view(req: Any, **kw: Any) -> Any:
        viewed_on.append(threading.current_thread())
        return view(req, **kw)

    monkeypatch.setattr(module, parse_name, watched_parse)
    monkeypatch.setattr(module, view_name, watched_view)
    body = json.dumps(_many_parts(path)).encode()
    assert len(body) > 16_384  # the inline size: parsed on a worker
    with trio.fail_after(HANG):
        async with served(dense_model) as (_engine, url), httpx.AsyncClient(base_url=url) as client:
            r = await client.post(
                path, content=body, headers={"Content-Type": "application/json"}, timeout=HANG
            )
            assert r.status_code == 200, r.text
    assert viewed_on
    assert loop not in viewed_on
    assert freed_on
    assert loop not in freed_on
