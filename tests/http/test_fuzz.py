"""Fuzz every route of the real server on the real MLX backend.

A bounded number of hypothesis examples (``GEZEL_FUZZ_EXAMPLES``, 300 by
default, which keeps CI in its time; ``python -m bench fuzz`` runs 50,000)
against one server process on the tiny dense demo model (its window cut to
320 tokens, so a budget of 2^63 or 10^400 goes as drawn and is cut to what
the window leaves), while a healthy greedy stream loops beside the fuzzer.
A fifth as many examples send broken images to a server on the demo VLM,
whose stdout must carry no traceback. The strategies and invariants are in
``tests/support/fuzzing.py``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import pytest
from hypothesis import HealthCheck, example, given, settings

from tests.support.fuzzing import (
    FUZZ_SERVER_ARGS,
    HealthyStream,
    Request,
    bomb_request,
    check,
    grammar_bombs,
    health_ok,
    image_requests,
    ref_chain,
    requests,
    rule_chain,
    send,
    terminal_chain,
)
from tests.support.models import with_context
from tests.support.process import Server, spawn_server, start_server, stop_server, terminate

pytestmark = pytest.mark.slow

EXAMPLES = int(os.environ.get("GEZEL_FUZZ_EXAMPLES", "300"))


@pytest.fixture(scope="module")
def fuzzed(
    dense_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Server, httpx.Client]]:
    # A 320-token window: a budget of 2^63 is cut to what it leaves.
    short = with_context(dense_model, tmp_path_factory.mktemp("fuzz") / "model", 320)
    srv = start_server(short, "--max-concurrency", "4", *FUZZ_SERVER_ARGS)
    healthy = HealthyStream(srv.url)
    healthy.start()
    client = httpx.Client(base_url=srv.url, timeout=60)
    try:
        yield srv, client
    finally:
        runs, mismatches = healthy.stop()
        client.close()
        assert stop_server(srv) == 0, "the fuzzed server must still drain cleanly"
    assert runs > 0, "the healthy stream never completed beside the fuzzer"
    assert mismatches == [], f"{len(mismatches)} of {runs} healthy streams were harmed"


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(req=requests(huge_budgets=True))
def test_no_request_hurts_the_server_or_another_request(
    fuzzed: tuple[Server, httpx.Client], req: Request
) -> None:
    _, client = fuzzed
    resp = send(client, req)
    assert check(resp) == (), f"{req.method} {req.path} {req.content!r:.300}"
    assert health_ok(client) is None


@pytest.fixture(scope="module")
def vision_fuzzed(vision_model: Path) -> Iterator[tuple[httpx.Client, list[str]]]:
    """A server on the demo VLM, its stdout (the supervisor's channel)
    gathered line by line beside the fuzzer."""
    proc = spawn_server(vision_model, "--max-concurrency", "4", *FUZZ_SERVER_ARGS)
    assert proc.stdout is not None
    url = next(
        (line.split()[-1] for line in proc.stdout if line.startswith("gezel-trio listening on ")),
        None,
    )
    assert url is not None, f"the server exited with {proc.wait()} before listening"
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout or ()), daemon=True)
    reader.start()
    client = httpx.Client(base_url=url, timeout=60)
    try:
        yield client, lines
    finally:
        client.close()
        status = terminate(proc)
        reader.join()
        proc.stdout.close()
    assert status == 0, "the fuzzed vision server must still drain cleanly"
    # A client's bad image is a 400, never a traceback on the supervisor's channel.
    assert [line for line in lines if "Traceback" in line or "[http] |" in line] == []


@settings(
    max_examples=max(50, EXAMPLES // 5),
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(req=image_requests())
def test_no_image_hurts_the_vision_server(
    vision_fuzzed: tuple[httpx.Client, list[str]], req: Request
) -> None:
    client, _ = vision_fuzzed
    resp = send(client, req)
    assert check(resp) == (), f"{req.path} {req.content!r:.300}"
    assert resp.status_code in (200, 400), resp.text
    assert health_ok(client) is None


@settings(
    max_examples=max(1, EXAMPLES // 10),
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(req=grammar_bombs)
# Each past the depth that overflowed an 8 MiB stack in llguidance 1.9.1.
@example(req=bomb_request("responses", rule_chain(3_000)))
@example(req=bomb_request("chat", terminal_chain(4_000)))
@example(req=bomb_request("response_format", ref_chain(1_000)))
def test_no_grammar_bomb_hurts_the_server_or_another_request(
    fuzzed: tuple[Server, httpx.Client], req: Request
) -> None:
    """Long rule chains, deep nesting, many alternatives and deep $ref
    chains, each in every field that reaches llguidance: the small ones
    served, the rest refused by the grammar bounds, the server unharmed."""
    srv, client = fuzzed
    resp = send(client, req)
    assert srv.proc.poll() is None, "the server died"
    assert check(resp) == (), f"{req.method} {req.path} {req.content!r:.300}"
    assert health_ok(client) is None
