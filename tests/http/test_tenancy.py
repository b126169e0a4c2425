"""Tenancy: each API key is a tenant, and what one makes is its own.

In-process over the scripted backend (a token is a character, so a prompt's
``cached_tokens`` is exact and readable): two keys, ``alice`` and ``bob``,
against one app, each request sent with its own ``Authorization`` header.
The three leaks tenancy closes, each of which these tests saw on a server
without it: ``/v1/cache/stats`` listed every tenant's ids, those
ids then fetched (or deleted, or cancelled) another tenant's stored
responses, and ``cached_tokens`` answered, character by character, how much
of a guessed prompt another tenant had sent.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from gezel_trio import cli
from gezel_trio.http.app import HttpSettings, create_app
from gezel_trio.http.response_store import StoredResponse
from gezel_trio.http.tenancy import KeyRing, Tenant, read_key_file, tenant_id
from gezel_trio.testing import ScriptedBackend, open_test_engine

ALICE, BOB = "alice-key-1", "bob-key-2"
SECRET = "The vault code is 4711-0815-2236. Never say it. "


class Caller:
    """One tenant's client of the in-process app."""

    def __init__(self, client: Any, key: str | None) -> None:
        self.client = client
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}

    async def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        r = await self.client.open(path, method=method, headers=self.headers, json=body)
        return r.status_code, await r.get_json()

    async def cached(self, prompt: str, **extra: Any) -> int:
        """``cached_tokens`` of a completion of ``prompt``."""
        status, body = await self.call(
            "POST",
            "/v1/completions",
            {"prompt": prompt, "max_tokens": 2, "temperature": 0, **extra},
        )
        assert status == 200, body
        return int(body["usage"]["prompt_tokens_details"]["cached_tokens"])

    async def stats(self) -> Any:
        status, body = await self.call("GET", "/v1/cache/stats")
        assert status == 200, body
        return body


@asynccontextmanager
async def app(
    keys: tuple[str, ...] = (ALICE, BOB), **engine_kw: Any
) -> AsyncIterator[tuple[Caller, Caller]]:
    """The app over a scripted engine: a caller with each of the first two
    keys (with no keys: two callers of the one tenant)."""
    async with (
        open_test_engine(ScriptedBackend(), **engine_kw) as t,
        create_app(t.engine, HttpSettings(api_key=keys)).test_app() as served,
    ):
        client = served.test_client()
        a, b = (*keys, None, None)[:2]
        yield Caller(client, a), Caller(client, b)


def _ids(stats: Any) -> set[str]:
    return {e["cache_id"] for e in stats["data"]}


async def _respond(caller: Caller, text: str, **extra: Any) -> str:
    status, body = await caller.call(
        "POST", "/v1/responses", {"input": text, "max_output_tokens": 3, **extra}
    )
    assert status == 200, body
    return str(body["id"])


# --- stats and named entries ------------------------------------------------


async def test_stats_list_only_the_callers_own_entries() -> None:
    async with app() as (alice, bob):
        await alice.call(
            "POST",
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": SECRET}],
                "max_tokens": 2,
                "cache_id": "alice-session",
            },
        )
        first = await _respond(alice, SECRET)
        await _respond(alice, "and then?", previous_response_id=first)
        mine, theirs = _ids(await alice.stats()), _ids(await bob.stats())
        # Alice sees her names as she wrote them, the chain's entry included.
        assert {"alice-session", f"responses:{first}"} <= mine
        # Bob sees none of her entries, named or anonymous.
        assert theirs.isdisjoint(mine)
        assert (await bob.stats())["totals"]["entries"] == len(theirs)
        await bob.cached("Bob's own prompt, his alone.")
        assert _ids(await bob.stats()).isdisjoint(mine)


async def test_another_tenants_named_entry_cannot_be_evicted_or_warmed_from() -> None:
    system = [{"role": "system", "content": SECRET * 2}]
    async with app() as (alice, bob):
        status, warmed = await alice.call(
            "POST", "/v1/cache/warm", {"cache_id": "shared", "messages": system}
        )
        assert status == 200, warmed
        assert warmed["cache_id"] == "shared"
        status, gone = await bob.call("DELETE", "/v1/cache/shared")
        assert (status, gone["evicted"]) == (200, False)
        assert "shared" in _ids(await alice.stats())
        # Bob's "shared" is his own name: using it seeds nothing of Alice's.
        status, body = await bob.call(
            "POST",
            "/v1/chat/completions",
            {
                "messages": [*system, {"role": "user", "content": "?"}],
                "max_tokens": 2,
                "cache_id": "shared",
                "prefix_cache_id": "shared",
            },
        )
        assert status == 200, body
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        # Nor can he drop one of her anonymous entries by the id she sees.
        await alice.cached("Alice asks something of her own.")
        anon = next(i for i in _ids(await alice.stats()) if i.startswith("anon:"))
        status, gone = await bob.call("DELETE", f"/v1/cache/{anon}")
        assert gone["evicted"] is False
        assert anon in _ids(await alice.stats())
        # Her own delete still works.
        status, gone = await alice.call("DELETE", "/v1/cache/shared")
        assert gone["evicted"] is True


# --- stored responses -----------------------------------------------------------


async def test_another_tenants_stored_response_is_an_unknown_one() -> None:
    async with app() as (alice, bob):
        rid = await _respond(alice, SECRET)
        unknown = await bob.call("GET", "/v1/responses/resp_0000000000000000")
        assert unknown[0] == 404
        for method, path in (
            ("GET", f"/v1/responses/{rid}"),
            ("POST", f"/v1/responses/{rid}/cancel"),
            ("DELETE", f"/v1/responses/{rid}"),
        ):
            status, body = await bob.call(method, path)
            assert status == 404, (method, body)
            assert body["error"]["code"] == unknown[1]["error"]["code"]
            assert body["error"]["param"] == unknown[1]["error"]["param"]
        # Continuing it is refused as continuing an unknown id is.
        status, body = await bob.call(
            "POST", "/v1/responses", {"input": "go on", "previous_response_id": rid}
        )
        assert status == 400
        assert body["error"]["param"] == "previous_response_id"
        assert "not found" in body["error"]["message"]
        # Alice's response is untouched by all of it.
        status, body = await alice.call("GET", f"/v1/responses/{rid}")
        assert status == 200
        assert body["id"] == rid
        assert await _respond(alice, "go on", previous_response_id=rid)


def test_a_stored_response_keeps_its_owner_in_its_file() -> None:
    rec = StoredResponse("resp_1", {"id": "resp_1"}, [], "resp_1", owner=tenant_id(ALICE))
    back = StoredResponse.from_json(rec.to_json())
    assert back.owner == tenant_id(ALICE)
    # A record of a server without keys is written as it always was.
    assert b"owner" not in StoredResponse("r", {}, [], "r").to_json()
    assert StoredResponse.from_json(StoredResponse("r", {}, [], "r").to_json()).owner == ""
    malformed = {**json.loads(rec.to_json()), "owner": ["not", "a", "tenant"]}
    with pytest.raises(ValueError, match="owner"):
        StoredResponse.from_json(json.dumps(malformed).encode())


async def test_stored_responses_keep_their_owner_across_a_restart(tmp_path: Path) -> None:
    from gezel_trio.http.response_store import ResponseStore

    async def serve_once(scenario: Any) -> Any:
        store = ResponseStore(directory=tmp_path)
        async with trio.open_nursery() as nursery:
            await nursery.start(store.run)
            async with (
                open_test_engine(ScriptedBackend()) as t,
                create_app(t.engine, HttpSettings(api_key=(ALICE, BOB)), store).test_app() as a,
            ):
                client = a.test_client()
                result = await scenario(Caller(client, ALICE), Caller(client, BOB))
            nursery.cancel_scope.cancel()
        return result

    async def make(alice: Caller, _bob: Caller) -> str:
        return await _respond(alice, SECRET)

    rid = await serve_once(make)

    async def read(alice: Caller, bob: Caller) -> tuple[int, int]:
        return (await alice.call("GET", f"/v1/responses/{rid}"))[0], (
            await bob.call("GET", f"/v1/responses/{rid}")
        )[0]

    assert await serve_once(read) == (200, 404)


# --- the content-addressed cache -----------------------------------------------


async def test_cached_tokens_says_nothing_of_another_tenants_prompt() -> None:
    prefix = SECRET.split("4711")[0]
    guesses = [prefix + guess + "?" for guess in ("4", "47", "471", "4711", "4711-0815")]

    async def bob_guesses(alice_spoke: bool) -> list[int]:
        async with app() as (alice, bob):
            if alice_spoke:
                assert await alice.cached(SECRET + "Hello.") == 0
            answers = [await bob.cached(g) for g in guesses]
            answers.append(await bob.cached(SECRET + "Hello."))
            if alice_spoke:
                # Alice herself reuses her prompt as before.
                assert await alice.cached(SECRET + "Hello.") == len(SECRET + "Hello.") - 1
            return answers

    # Guessing the code digit by digit: without tenancy each right digit was
    # one more cached token (17, 18, 19 ...). Bob's answers are what they are
    # on a server Alice never spoke to: his own earlier guesses only.
    assert await bob_guesses(alice_spoke=True) == await bob_guesses(alice_spoke=False)


async def test_a_cache_salt_partitions_one_tenants_cache() -> None:
    prompt = SECRET + "What now?"
    full = len(prompt) - 1
    for keys in ((ALICE, BOB), ()):
        async with app(keys) as (alice, _):
            assert await alice.cached(prompt, cache_salt="user-1") == 0
            assert await alice.cached(prompt, cache_salt="user-2") == 0
            assert await alice.cached(prompt) == 0
            assert await alice.cached(prompt, cache_salt="user-1") == full
            assert await alice.cached(prompt) == full


async def test_without_keys_everyone_is_one_tenant() -> None:
    async with app(()) as (one, other):
        await one.call(
            "POST",
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": SECRET}], "max_tokens": 2, "cache_id": "s"},
        )
        assert "s" in _ids(await other.stats())
        rid = await _respond(one, SECRET)
        assert (await other.call("GET", f"/v1/responses/{rid}"))[0] == 200
        assert await one.cached(SECRET + "x") == 0
        assert await other.cached(SECRET + "x") == len(SECRET + "x") - 1


async def test_salted_disk_entries_seed_only_their_tenant(tmp_path: Path) -> None:
    prompt = SECRET * 3
    async with app(persist_dir=tmp_path) as (alice, _):
        assert await alice.cached(prompt) == 0
        assert (await alice.call("POST", "/admin/flush"))[1]["flushed"] >= 1
    # A new process: only the disk holds it.
    async with app(persist_dir=tmp_path) as (alice, bob):
        assert await bob.cached(prompt) == 0
        assert await alice.cached(prompt) == len(prompt) - 1


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/responses", {"input": "hi"}),
        ("/v1/messages", {"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/cache/warm", {"cache_id": "w", "messages": [{"role": "user", "content": "hi"}]}),
    ],
)
@pytest.mark.parametrize("salt", ["", "x" * 1025, 7, None])
async def test_a_bad_cache_salt_is_refused_naming_it(
    path: str, body: dict[str, Any], salt: Any
) -> None:
    async with app() as (alice, _):
        status, answer = await alice.call("POST", path, {**body, "cache_salt": salt})
    if salt is None:
        assert status == 200, answer
        return
    assert status == 400, answer
    assert "cache_salt" in str(answer["error"])


# --- keys -------------------------------------------------------------------------


def test_a_key_file_holds_one_key_a_line(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("# the team's keys\n\n  alpha  \nbeta\n# gamma\n")
    assert read_key_file(path) == ("alpha", "beta")
    empty = tmp_path / "empty"
    empty.write_text("\n# nobody yet\n")
    with pytest.raises(ValueError, match="holds no key"):
        read_key_file(empty)
    with pytest.raises(ValueError, match="cannot be read"):
        read_key_file(tmp_path / "missing")
    # A startup error, from the settings the command line builds.
    with pytest.raises(ValueError, match="holds no key"):
        HttpSettings(api_key_file=empty)


def _serve_args(*flags: str) -> argparse.Namespace:
    return cli._parser().parse_args(["serve", "--model", "m", *flags])


def test_api_key_repeats_and_adds_to_the_key_file(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("gamma\n")
    http = cli._from_flags(
        HttpSettings,
        _serve_args("--api-key", "alpha", "--api-key", "beta", "--api-key-file", str(path)),
    )
    assert http.api_key == ("alpha", "beta")
    ring = KeyRing.of(http.api_key, http.api_key_file)
    assert len(ring) == 3
    for key in ("alpha", "beta", "gamma"):
        assert ring.tenant({"Authorization": f"Bearer {key}"}) == Tenant(tenant_id(key))
        assert ring.tenant({"x-api-key": key}) == Tenant(tenant_id(key))
    assert ring.tenant({"Authorization": "Bearer alph"}) is None
    assert ring.tenant({"Authorization": "alpha"}) is None
    assert ring.tenant({}) is None
    assert cli._from_flags(HttpSettings, _serve_args()).api_key == ()
    with pytest.raises(ValueError, match="empty"):
        HttpSettings(api_key=("",))


def test_a_tenant_id_is_never_the_key() -> None:
    tid = tenant_id(ALICE)
    assert len(tid) == 16
    assert ALICE not in tid
    assert tid == tenant_id(ALICE) != tenant_id(BOB)


async def test_a_key_file_key_is_a_tenant(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text(f"{ALICE}\n")
    async with (
        open_test_engine(ScriptedBackend()) as t,
        create_app(t.engine, HttpSettings(api_key_file=path)).test_app() as served,
    ):
        client = served.test_client()
        assert (await Caller(client, ALICE).call("GET", "/v1/models"))[0] == 200
        assert (await Caller(client, BOB).call("GET", "/v1/models"))[0] == 401


# --- the real SDK, the real server ---------------------------------------------------


async def test_two_openai_sdk_clients_with_their_own_keys(dense_model: Path) -> None:
    """The official SDK, one client per key, against hypercorn over the MLX
    engine: one's stored response is another's NotFoundError, and one's
    prompt is not in the other's cached_tokens."""
    import openai

    from tests.support.inprocess import served

    system = "You are the lighthouse keeper. The lamp's code word is " + "BRIGHTWATER " * 20

    def sdk(url: str, key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)

    def cached(client: openai.OpenAI) -> int:
        r = client.chat.completions.create(
            model="demo",
            messages=[{"role": "system", "content": system}, {"role": "user", "content": "Hi"}],
            max_tokens=2,
            temperature=0,
        )
        assert r.usage is not None
        assert r.usage.prompt_tokens_details is not None
        return r.usage.prompt_tokens_details.cached_tokens or 0

    def scenario(url: str) -> None:
        alice, bob = sdk(url, ALICE), sdk(url, BOB)
        stored = alice.responses.create(model="demo", input=SECRET, max_output_tokens=3)
        with pytest.raises(openai.NotFoundError):
            bob.responses.retrieve(stored.id)
        with pytest.raises(openai.NotFoundError):
            bob.responses.delete(stored.id)
        assert alice.responses.retrieve(stored.id).id == stored.id
        with pytest.raises(openai.AuthenticationError):
            sdk(url, "carol-key-3").models.list()
        # Alice's earlier response may share her prompt's first tokens.
        first = cached(alice)
        assert cached(bob) == 0
        assert cached(alice) > first + 100

    with trio.fail_after(180):
        async with served(dense_model, HttpSettings(api_key=(ALICE, BOB))) as (_engine, url):
            await trio.to_thread.run_sync(scenario, url)
