"""``/openapi.json`` describes the server, and schemathesis holds it to that.

schemathesis (its own CLI, positive and negative generation) runs against a
real server on the tiny dense demo model: no 5xx, every status and content
type documented, responses matching their schemas, schema-invalid requests
refused with a 4xx, 405s with an ``Allow`` header. Not checked:
``positive_data_acceptance`` (rules that span fields - ``tool_choice``
needs ``tools``, ``top_logprobs`` needs ``logprobs``, a prompt must fit the
context - are not expressible in the schema, so a schema-valid body may be a
400) and ``allow_header_conformance`` (``DELETE /v1/cache/{cache_id}``
also matches ``/v1/cache/stats`` and ``/v1/cache/warm``: an entry may be
named ``stats``). Response time is held only to the request timeout (speed
belongs in bench/; a length field such as a Messages body's ``max_tokens``
is lowered to 64 by a hook, tests/support/schemathesis_hooks.py, so no
example decodes for minutes). The coverage
phase is left out: its boundary cases (4096 messages) are legitimate
prompts of tens of thousands of tokens, minutes of prefill on CI's CPUs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import pytest
from jsonschema import Draft202012Validator

from tests.support.fuzzing import FUZZ_SERVER_ARGS
from tests.support.process import Server, start_server, stop_server

pytestmark = pytest.mark.slow

_ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = os.environ.get("GEZEL_SCHEMATHESIS_EXAMPLES", "25")


@pytest.fixture(scope="module")
def server(dense_model: Path) -> Iterator[Server]:
    srv = start_server(dense_model, "--max-concurrency", "4", *FUZZ_SERVER_ARGS)
    yield srv
    assert stop_server(srv) == 0


def test_the_document_covers_every_route_and_field(server: Server) -> None:
    doc = httpx.get(f"{server.url}/openapi.json", timeout=10).json()
    assert doc["openapi"].startswith("3.1")
    assert set(doc["paths"]) == {
        "/v1/chat/completions",
        "/chat/completions",
        "/v1/responses",
        "/v1/responses/compact",
        "/v1/responses/{response_id}",
        "/v1/responses/{response_id}/cancel",
        "/v1/models",
        "/v1/models/{model_id}",
        "/health",
        "/metrics",
        "/openapi.json",
        "/v1/cache/stats",
        "/v1/cache/{cache_id}",
        "/v1/cache/warm",
        "/admin/flush",
        "/v1/completions",
        "/completions",
        "/infill",
        "/tokenize",
        "/detokenize",
        "/v1/messages",
        "/v1/messages/count_tokens",
    }
    chat = doc["components"]["schemas"]["ChatCompletionRequest"]
    for field in ("cache_id", "priority", "tool_grammar", "prompt_cache_key", "metadata"):
        assert field in chat["properties"]
    assert "gezel" in chat["properties"]["cache_id"]["description"]
    # Unknown properties are ignored (and named in a header), so allowed.
    assert "additionalProperties" not in chat
    messages = doc["components"]["schemas"]["MessagesRequest"]
    for field in ("system", "thinking", "tool_choice", "stop_sequences", "cache_control"):
        assert field in messages["properties"]
    assert messages["required"] == ["messages", "max_tokens"]
    error = doc["paths"]["/v1/messages"]["post"]["responses"]["400"]
    assert error["content"]["application/json"]["schema"]["$ref"].endswith("/AnthropicError")
    for schema in doc["components"]["schemas"].values():
        Draft202012Validator.check_schema(schema)


# schemathesis's rejection statuses, and 413: an invalid body can be one
# too large (an array past its maxItems), which the edge refuses before
# reading it as the document says.
_REJECTED = ["400", "401", "403", "404", "405", "406", "409", "413", "415", "422", "428", "429"]


def test_schemathesis_positive_and_negative(server: Server, tmp_path: Path) -> None:
    cli = Path(sys.executable).with_name("schemathesis")
    # Read from the working directory.
    statuses = ", ".join(f'"{s}"' for s in [*_REJECTED, "5xx"])
    (tmp_path / "schemathesis.toml").write_text(
        f"[checks.negative_data_rejection]\nexpected-statuses = [{statuses}]\n"
    )
    run = subprocess.run(
        [
            str(cli),
            "run",
            f"{server.url}/openapi.json",
            "--mode",
            "all",
            "--max-examples",
            EXAMPLES,
            "--phases",
            "examples,fuzzing",
            "--checks",
            "all",
            "--exclude-checks",
            "positive_data_acceptance,allow_header_conformance",
            # Speed belongs in bench/: only a hung request fails.
            "--max-response-time",
            "120",
            "--request-timeout",
            "120",
            "--generation-database",
            "none",
            "--no-color",
        ],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
        env={
            **os.environ,
            "SCHEMATHESIS_TELEMETRY": "false",
            # Length fields lowered to 64 (tests/support/schemathesis_hooks.py).
            "SCHEMATHESIS_HOOKS": "tests.support.schemathesis_hooks",
            "PYTHONPATH": os.pathsep.join([str(_ROOT), os.environ.get("PYTHONPATH", "")]),
        },
    )
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
