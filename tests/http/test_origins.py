"""What a web page the user opens can make the server do: cross-origin form
posts and DNS rebinding, in-process over the scripted backend.

A browser sends a form POST (``text/plain``, urlencoded, multipart) or a
bodiless POST to any origin without a preflight, with an ``Origin`` header
naming the page's origin; a DNS-rebound page sends its own name as
``Host``. SDK clients send neither an ``Origin`` nor anything but JSON.
"""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from gezel_trio import cli
from gezel_trio.http.app import HttpSettings, create_app
from gezel_trio.http.origins import OriginPolicy
from gezel_trio.testing import ScriptedBackend, open_test_engine

EVIL = "https://evil.example"
FORM = {"Content-Type": "application/x-www-form-urlencoded"}


async def _call(
    settings: HttpSettings, method: str, path: str, headers: dict[str, str], body: Any = None
) -> tuple[int, Any, Any]:
    async with (
        open_test_engine(ScriptedBackend()) as t,
        create_app(t.engine, settings).test_app() as app,
    ):
        client = app.test_client()
        if isinstance(body, dict):
            r = await client.open(path, method=method, headers=headers, json=body)
        else:
            r = await client.open(path, method=method, headers=headers, data=body or b"")
        return r.status_code, r.headers, await r.get_json()


@pytest.mark.parametrize(
    ("method", "path", "ctype"),
    [
        ("POST", "/admin/flush", "text/plain"),
        ("POST", "/admin/flush", "multipart/form-data; boundary=x"),
        ("POST", "/v1/responses/resp_x/cancel", "application/x-www-form-urlencoded"),
        ("DELETE", "/v1/cache/some-id", None),
        ("DELETE", "/v1/responses/resp_x", None),
    ],
)
async def test_a_foreign_origin_cannot_change_state(
    method: str, path: str, ctype: str | None
) -> None:
    headers = {"Origin": EVIL} | ({"Content-Type": ctype} if ctype else {})
    status, _, body = await _call(HttpSettings(), method, path, headers, b"a=b" if ctype else None)
    assert status == 403
    assert body["error"]["code"] == "forbidden_origin"
    assert EVIL in body["error"]["message"]
    assert "--allowed-origin" in body["error"]["message"]


async def test_a_null_origin_is_refused() -> None:
    # A sandboxed frame or a file: page.
    status, _, body = await _call(HttpSettings(), "POST", "/admin/flush", {"Origin": "null"})
    assert status == 403
    assert body["error"]["code"] == "forbidden_origin"


@pytest.mark.parametrize(
    "origin", [None, "http://localhost", "http://localhost:3000", "http://127.0.0.1:9"]
)
async def test_no_origin_own_origin_and_loopback_origins_flush(origin: str | None) -> None:
    headers = {} if origin is None else {"Origin": origin}
    status, _, body = await _call(HttpSettings(), "POST", "/admin/flush", headers)
    assert status == 200, body
    assert body == {"flushed": 0, "settled": True}


async def test_reads_are_not_refused_for_their_origin() -> None:
    status, headers, _ = await _call(HttpSettings(), "GET", "/v1/models", {"Origin": EVIL})
    assert status == 200
    assert "Access-Control-Allow-Origin" not in headers  # the page cannot read it


async def test_a_form_post_never_runs_a_completion() -> None:
    # No Origin at all (an old browser): the content type alone refuses it.
    status, _, body = await _call(
        HttpSettings(), "POST", "/v1/chat/completions", {"Content-Type": "text/plain"}, b"{}"
    )
    assert status == 415
    assert "application/json" in body["error"]["message"]


async def test_an_allowed_origin_posts_and_gets_cors_headers() -> None:
    settings = HttpSettings(allowed_origins=("https://app.example",))
    hello = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    status, headers, _ = await _call(
        settings, "POST", "/v1/chat/completions", {"Origin": "https://app.example"}, hello
    )
    assert status == 200
    assert headers["Access-Control-Allow-Origin"] == "https://app.example"
    # Its preflight is answered, before any key check.
    preflight = {
        "Origin": "https://app.example",
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type, authorization",
    }
    keyed = HttpSettings(allowed_origins=("https://app.example",), api_key="k")
    status, headers, _ = await _call(keyed, "OPTIONS", "/v1/chat/completions", preflight)
    assert status == 204
    assert headers["Access-Control-Allow-Headers"] == "content-type, authorization"
    assert "POST" in headers["Access-Control-Allow-Methods"]
    # Another origin is still refused.
    status, _, _ = await _call(settings, "POST", "/admin/flush", {"Origin": EVIL})
    assert status == 403


async def test_rebinding_on_an_open_bind_without_a_key_is_refused() -> None:
    open_bind = HttpSettings(host="0.0.0.0")
    status, _, body = await _call(open_bind, "GET", "/v1/models", {"Host": "evil.example:8000"})
    assert status == 403
    assert "evil.example" in body["error"]["message"]
    assert "--allowed-host" in body["error"]["message"]
    for host in ("192.168.1.5:8000", "[fe80::1]:8000", "localhost:8000"):
        status, _, _ = await _call(open_bind, "GET", "/v1/models", {"Host": host})
        assert status == 200, host
    named = HttpSettings(host="0.0.0.0", allowed_hosts=("box.lan",))
    status, _, _ = await _call(named, "GET", "/v1/models", {"Host": "BOX.lan:8000"})
    assert status == 200
    # With a key a rebound page cannot authenticate: any Host is served.
    keyed = HttpSettings(host="0.0.0.0", api_key="k")
    right = {"Host": "box.lan:8000", "Authorization": "Bearer k"}
    status, _, _ = await _call(keyed, "GET", "/v1/models", right)
    assert status == 200


async def test_loopback_bind_takes_allowed_hosts_too() -> None:
    status, _, _ = await _call(HttpSettings(), "GET", "/v1/models", {"Host": "box.lan"})
    assert status == 403
    named = HttpSettings(allowed_hosts=("box.lan",))
    status, _, _ = await _call(named, "GET", "/v1/models", {"Host": "box.lan"})
    assert status == 200


def test_same_origin_is_matched_with_its_port() -> None:
    policy = OriginPolicy.of("0.0.0.0", None, (), ())
    assert policy.origin_allowed("http://10.0.0.2:8000", "10.0.0.2:8000")
    assert policy.origin_allowed("https://10.0.0.2", "10.0.0.2")
    assert not policy.origin_allowed("http://10.0.0.2:9000", "10.0.0.2:8000")
    assert not policy.origin_allowed("http://10.0.0.3:8000", "10.0.0.2:8000")


def _serve_args(*flags: str) -> argparse.Namespace:
    return cli._parser().parse_args(["serve", "--model", "m", *flags])


def test_the_flags_repeat_and_a_bad_origin_is_refused() -> None:
    args = _serve_args(
        "--allowed-origin", "https://a.example", "--allowed-origin", "http://b:3000",
        "--allowed-host", "box.lan",
    )  # fmt: skip
    http = cli._from_flags(HttpSettings, args)
    assert http.allowed_origins == ("https://a.example", "http://b:3000")
    assert http.allowed_hosts == ("box.lan",)
    assert cli._from_flags(HttpSettings, _serve_args()).allowed_origins == ()
    with pytest.raises(ValueError, match="is not an origin"):
        HttpSettings(allowed_origins=("a.example/x",))
