"""What Codex asks of the built-in OpenAI provider beyond ``/v1/responses``,
through the real server and the official ``openai`` SDK.

Codex compacts its history with ``POST /v1/responses/compact`` when the
context fills, and sends the ``compaction`` item it gets back in place of
that history. Here the item seals the history itself (no model call): a
request carrying it renders exactly the prompt the whole history renders,
so the prompt cache serves it. An item this server did not seal, or one
altered on the way, is a 400 naming the item.

With ``supports_websockets`` Codex first opens a WebSocket on
``/v1/responses``; a handshake answered ``426 Upgrade Required`` makes it
use HTTP for the rest of the session at once (any other refusal is retried
first). The handshake is driven here by ``wsproto`` over a plain socket.
"""

from __future__ import annotations

import json
import socket
import uuid
from typing import Any
from urllib.parse import urlsplit

import openai
import pytest
import wsproto
import wsproto.events as ws

from gezel_trio.shaping.replies import ReplySeal
from tests.support.process import Server

SYSTEM = "You are Codex, a coding agent. Keep answers short."


def _history(tag: str) -> list[dict[str, Any]]:
    """A Codex-shaped history: a user turn, a call and its output, a reply."""
    return [
        {"role": "user", "content": [{"type": "input_text", "text": f"List the files ({tag})."}]},
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "exec_command",
            "arguments": '{"cmd": "ls"}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "README.md\nsrc\n"},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "There are README.md and src."}],
        },
    ]


def _compact(server: Server, history: list[dict[str, Any]]) -> Any:
    return server.client.responses.compact(
        model="m",
        input=history,  # type: ignore[arg-type]
        instructions=SYSTEM,
    )


def _ask(server: Server, items: list[dict[str, Any]]) -> Any:
    return server.client.responses.create(
        model="m",
        instructions=SYSTEM,
        input=items,  # type: ignore[arg-type]
        max_output_tokens=1,
        store=False,
        temperature=0,
    )


def test_compaction_round_trips_and_the_prompt_cache_serves_it(dense_server: Server) -> None:
    tag = uuid.uuid4().hex
    history = _history(tag)
    turn = {"role": "user", "content": f"Now read README.md ({tag})."}

    whole = _ask(dense_server, [*history, turn])

    compacted = _compact(dense_server, history)
    assert compacted.object == "response.compaction"
    (item,) = compacted.output
    assert item.type == "compaction"
    assert item.encrypted_content
    assert compacted.usage.output_tokens == 0  # no model call

    carried = _ask(dense_server, [item.model_dump(exclude_none=True), turn])
    # The same prompt as the whole history's, served from the cache.
    assert carried.usage.input_tokens == whole.usage.input_tokens
    assert carried.usage.input_tokens_details.cached_tokens >= whole.usage.input_tokens - 1


def test_items_before_a_compaction_are_the_clients_copies_and_go(dense_server: Server) -> None:
    """Codex re-sends the user messages it keeps and its context before the
    compaction item: the item stands for all of it, so the prompt is the
    whole history's, read from the cache, not the history twice."""
    tag = uuid.uuid4().hex
    history = _history(tag)
    turn = {"role": "user", "content": f"Now read README.md ({tag})."}
    whole = _ask(dense_server, [*history, turn])
    (item,) = _compact(dense_server, history).output
    kept = [history[0], {"role": "developer", "content": f"<environment_context>{tag}"}]
    carried = _ask(dense_server, [*kept, item.model_dump(exclude_none=True), turn])
    assert carried.usage.input_tokens == whole.usage.input_tokens
    assert carried.usage.input_tokens_details.cached_tokens >= whole.usage.input_tokens - 1


def _trigger(server: Server, history: list[dict[str, Any]], *, stream: bool) -> Any:
    """Codex 0.171's compaction: its history and a ``compaction_trigger``
    item, on ``/v1/responses`` as any turn (streamed, as Codex sends it)."""
    asked = server.client.responses.create(
        model="m",
        instructions=SYSTEM,
        input=[*history, {"type": "compaction_trigger"}],  # type: ignore[list-item]
        store=False,
        stream=stream,
    )
    if not stream:
        return asked
    events = list(asked)
    assert [e.type for e in events][-1] == "response.completed"
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [i.type for i in done] == ["compaction"]
    return events[-1].response


@pytest.mark.parametrize("stream", [True, False])
def test_a_compaction_trigger_answers_one_compaction_item(
    dense_server: Server, stream: bool
) -> None:
    tag = uuid.uuid4().hex
    history = _history(tag)
    turn = {"role": "user", "content": f"Now read README.md ({tag})."}

    whole = _ask(dense_server, [*history, turn])

    compacted = _trigger(dense_server, history, stream=stream)
    assert compacted.status == "completed"
    (item,) = compacted.output
    assert item.type == "compaction"
    assert compacted.usage.output_tokens == 0  # no model call

    carried = _ask(dense_server, [item.model_dump(exclude_none=True), turn])
    assert carried.usage.input_tokens == whole.usage.input_tokens
    assert carried.usage.input_tokens_details.cached_tokens >= whole.usage.input_tokens - 1


def test_a_compaction_trigger_with_a_bad_stream_is_a_400_naming_it(
    dense_server: Server,
) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        dense_server.client.responses.create(
            model="m",
            input=[*_history("bad"), {"type": "compaction_trigger"}],  # type: ignore[list-item]
            extra_body={"stream": "yes"},
        )
    body = err.value.body
    assert isinstance(body, dict)
    assert body.get("param") == "stream"


def test_a_compaction_inside_compacted_input_is_expanded_first(dense_server: Server) -> None:
    tag = uuid.uuid4().hex
    history = _history(tag)
    (first,) = _compact(dense_server, history[:2]).output
    more = [first.model_dump(exclude_none=True), *history[2:]]
    (second,) = _compact(dense_server, more).output
    turn = {"role": "user", "content": f"And src? ({tag})"}

    whole = _ask(dense_server, [*history, turn])
    carried = _ask(dense_server, [second.model_dump(exclude_none=True), turn])
    assert carried.usage.input_tokens == whole.usage.input_tokens


def _status_and_param(server: Server, items: list[dict[str, Any]]) -> tuple[int, str | None]:
    with pytest.raises(openai.BadRequestError) as err:
        _ask(server, items)
    body = err.value.body
    assert isinstance(body, dict)
    return err.value.status_code, body.get("param")


def test_an_altered_compaction_is_a_400_naming_it(dense_server: Server) -> None:
    (item,) = _compact(dense_server, _history(uuid.uuid4().hex)).output
    blob = item.encrypted_content
    altered = blob[:-3] + ("AAA" if not blob.endswith("AAA") else "BBB")
    turn = {"role": "user", "content": "Go on."}
    status, param = _status_and_param(
        dense_server, [turn, {"type": "compaction", "encrypted_content": altered}]
    )
    assert (status, param) == (400, "input[1].encrypted_content")


def test_a_compaction_sealed_under_another_key_is_a_400(dense_server: Server) -> None:
    foreign = ReplySeal(b"another server's key", "m").seal_history(_history("elsewhere"))
    item = {"type": "compaction", "encrypted_content": foreign}
    status, param = _status_and_param(dense_server, [item])
    assert (status, param) == (400, "input[0].encrypted_content")


@pytest.mark.parametrize(
    ("extra", "param"), [({"summary": "x"}, "input[0].summary"), ({"id": 7}, "input[0].id")]
)
def test_a_compaction_items_other_fields_are_checked(
    dense_server: Server, extra: dict[str, Any], param: str
) -> None:
    (item,) = _compact(dense_server, _history(uuid.uuid4().hex)).output
    sent = {**item.model_dump(exclude_none=True), **extra}
    assert _status_and_param(dense_server, [sent]) == (400, param)


def test_compact_refuses_what_responses_refuses(dense_server: Server) -> None:
    bad = [{"type": "computer_call_output", "call_id": "c", "output": {}}]
    with pytest.raises(openai.BadRequestError) as err:
        _compact(dense_server, bad)
    body = err.value.body
    assert isinstance(body, dict)
    assert body["param"] == "input[0].type"


@pytest.mark.parametrize("threshold", [None, 200_000])
def test_context_management_compaction_is_accepted(
    dense_server: Server, threshold: int | None
) -> None:
    entry: dict[str, Any] = {"type": "compaction"}
    if threshold is not None:
        entry["compact_threshold"] = threshold
    r = dense_server.client.responses.create(
        model="m",
        input="Say hi.",
        max_output_tokens=1,
        store=False,
        context_management=[entry],  # type: ignore[list-item]
    )
    assert r.status in ("completed", "incomplete")


@pytest.mark.parametrize(
    ("entry", "param"),
    [
        ({"type": "truncate"}, "context_management[0].type"),
        ({"type": "compaction", "compact_threshold": 0}, "context_management[0].compact_threshold"),
        (
            {"type": "compaction", "compact_threshold": "big"},
            "context_management[0].compact_threshold",
        ),
    ],
)
def test_a_bad_context_management_entry_is_a_400_naming_it(
    dense_server: Server, entry: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        dense_server.client.responses.create(
            model="m",
            input="Say hi.",
            max_output_tokens=1,
            store=False,
            context_management=[entry],  # type: ignore[list-item]
        )
    body = err.value.body
    assert isinstance(body, dict)
    assert body["param"] == param


def _handshake(server: Server, target: str) -> list[ws.Event]:
    """A WebSocket opening handshake on ``target``: the events the server's
    answer makes (an ``AcceptConnection``, or a ``RejectConnection`` and its
    body as ``RejectData``)."""
    url = urlsplit(server.url)
    assert url.hostname is not None
    assert url.port is not None
    conn = wsproto.WSConnection(wsproto.ConnectionType.CLIENT)
    events: list[ws.Event] = []
    with socket.create_connection((url.hostname, url.port), timeout=30) as sock:
        sock.sendall(conn.send(ws.Request(host=url.netloc, target=target)))
        while not events or not _ended(events[-1]):
            data = sock.recv(65536)
            conn.receive_data(data or None)
            events += list(conn.events())
            if not data:
                break
    return events


def _ended(event: ws.Event) -> bool:
    if isinstance(event, ws.RejectConnection):
        return not event.has_body
    if isinstance(event, ws.RejectData):
        return event.body_finished
    return isinstance(event, ws.AcceptConnection)


def test_a_websocket_on_responses_is_refused_with_426(dense_server: Server) -> None:
    events = _handshake(dense_server, "/v1/responses")
    reject = events[0]
    assert isinstance(reject, ws.RejectConnection), events
    assert reject.status_code == 426
    body = b"".join(e.data for e in events[1:] if isinstance(e, ws.RejectData))
    error = json.loads(body)["error"]
    assert error["code"] == "websocket_not_supported"
    assert "HTTP" in error["message"]


@pytest.mark.parametrize(
    ("target", "status"),
    [("/v1/chat/completions", 405), ("/v1/models", 400), ("/health", 400), ("/nowhere", 404)],
)
def test_a_websocket_elsewhere_is_refused_in_the_envelope(
    dense_server: Server, target: str, status: int
) -> None:
    events = _handshake(dense_server, target)
    reject = events[0]
    assert isinstance(reject, ws.RejectConnection), events
    assert reject.status_code == status
    body = b"".join(e.data for e in events[1:] if isinstance(e, ws.RejectData))
    assert target in json.loads(body)["error"]["message"]
