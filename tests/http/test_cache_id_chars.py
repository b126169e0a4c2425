"""A cache id holds no whitespace and no control character: ids are printed
in the supervisor's stdout lines (``Prefill: ... cache=<id>``), whose reader
splits on whitespace, so an id ``"a cache=b"`` would draw its progress bar in
session ``b``'s row. Every field that takes an id refuses one with a 400
naming the field."""

from __future__ import annotations

import re
import sys
import unicodedata

import httpx2 as httpx
import pytest
import trio

from gezel_trio.core.errors import InvalidRequest
from gezel_trio.http.checks import CACHE_ID_REFUSED, check_cache_id
from tests.support.inprocess import served_scripted

HANG = 120
FORGED = "mine cache=theirs"
USER = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("value", [FORGED, "tab\there", "nbsp\u00a0", "line\u2028sep", "x\n"])
def test_whitespace_or_a_control_character_is_refused(value: str) -> None:
    with pytest.raises(InvalidRequest, match="whitespace or control") as caught:
        check_cache_id(value, "cache_id")
    assert caught.value.param == "cache_id"


@pytest.mark.parametrize("value", ["session-1", "gone/with_../slashes", "ünïcode", "a=b"])
def test_other_text_is_an_id(value: str) -> None:
    check_cache_id(value, "cache_id")


def test_the_refused_class_is_exactly_controls_and_whitespace() -> None:
    # The OpenAPI pattern shares the class: it must say what the check does.
    refused = re.compile(f"[{CACHE_ID_REFUSED}]")
    for code in range(sys.maxunicode + 1):
        c = chr(code)
        expected = unicodedata.category(c) in ("Cc", "Zs", "Zl", "Zp")
        assert bool(refused.match(c)) == expected, hex(code)


async def test_every_id_field_refuses_a_forged_tag() -> None:
    cases = [
        ("/v1/chat/completions", {"messages": USER, "cache_id": FORGED}, "cache_id"),
        (
            "/v1/chat/completions",
            {"messages": USER, "prompt_cache_key": FORGED},
            "prompt_cache_key",
        ),
        (
            "/v1/chat/completions",
            {"messages": USER, "prefix_cache_ids": ["ok", FORGED]},
            "prefix_cache_ids[1]",
        ),
        ("/v1/completions", {"prompt": "hi", "cache_id": FORGED}, "cache_id"),
        ("/v1/responses", {"input": "hi", "prompt_cache_key": FORGED}, "prompt_cache_key"),
        ("/v1/cache/warm", {"messages": USER, "cache_id": FORGED}, "cache_id"),
    ]
    with trio.fail_after(HANG):
        async with served_scripted() as (_engine, url), httpx.AsyncClient(base_url=url) as client:
            for path, body, param in cases:
                r = await client.post(path, json=body)
                assert r.status_code == 400, (path, r.text)
                assert r.json()["error"]["param"] == param, (path, r.text)
            d = await client.delete("/v1/cache/mine%20cache=theirs")
            assert d.status_code == 400
            assert d.json()["error"]["param"] == "cache_id"
