"""Fuzz every route of the real server on the real MLX backend.

A bounded number of hypothesis examples (``GEZEL_FUZZ_EXAMPLES``, 500 by
default, which keeps CI in its time; ``python -m bench fuzz`` runs 50,000)
against one server process on the tiny dense demo model, while a healthy
greedy stream loops beside the fuzzer. The strategies and invariants are in
``tests/support/fuzzing.py``.
"""

from __future__ import annotations

import os
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
    ref_chain,
    requests,
    rule_chain,
    send,
    terminal_chain,
)
from tests.support.process import Server, start_server, stop_server

pytestmark = pytest.mark.slow

EXAMPLES = int(os.environ.get("GEZEL_FUZZ_EXAMPLES", "500"))


@pytest.fixture(scope="module")
def fuzzed(dense_model: Path) -> Iterator[tuple[Server, httpx.Client]]:
    srv = start_server(dense_model, "--max-concurrency", "4", *FUZZ_SERVER_ARGS)
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
@given(req=requests())
def test_no_request_hurts_the_server_or_another_request(
    fuzzed: tuple[Server, httpx.Client], req: Request
) -> None:
    _, client = fuzzed
    resp = send(client, req)
    assert check(resp) == (), f"{req.method} {req.path} {req.content!r:.300}"
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
