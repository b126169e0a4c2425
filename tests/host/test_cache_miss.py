"""Where a prompt left the prompt cache (``SeedInfo.miss``), decided at
admission on the host thread: each reason in its case, none on a prompt
that reused all the cache held for it, the message the divergence falls in
and the decoded text of both sides - with fake states, MLX-free."""

from __future__ import annotations

from typing import Any

from gezel_trio.core.request import CacheRequest, GenerationRequest
from gezel_trio.host.prompt_cache import PromptCache
from tests.support.prompt_cache import Harness, request


def _decoding(h: Harness) -> Harness:
    # Tokens as characters, so the excerpts read as text.
    h.cache._decode = lambda ids: "".join(chr(t) for t in ids)
    return h


def text(s: str) -> tuple[int, ...]:
    return tuple(ord(c) for c in s)


def miss(h: Harness, prompt: tuple[int, ...], **cache: Any) -> Any:
    rid, adm, seed = h.start(request(prompt, **cache))
    h.prefill(rid, adm)
    h.cache.finished(rid, None)
    return seed.miss


def test_an_empty_cache_is_cold_and_a_repeated_prompt_is_no_miss() -> None:
    h = Harness(trimmable=True)
    first = miss(h, tuple(range(100)))
    assert first is not None
    assert (first.reason, first.token, first.reused) == ("cold", 0, 0)
    h.run(request(range(100)))
    assert miss(h, tuple(range(100))) is None  # all but the token that must run


def test_a_prompt_that_extends_a_cached_turn_is_no_miss() -> None:
    h = Harness(trimmable=True)
    h.run(request(range(100)), generated=(900, 901))
    assert miss(h, (*range(100), 900, 5, 6, 7)) is None


def test_a_changed_system_prompt_names_the_message_the_token_and_both_sides() -> None:
    h = _decoding(Harness(trimmable=True))
    system_a = "system: You are a harbour pilot. Answer briefly.\n"
    system_b = "system: You are a harbour pilot. Answer at length.\n"
    user = "user: When does the ferry leave?\nassistant:"
    starts = (0, len(system_a))
    roles = ("system", "user")
    h.run(GenerationRequest(text(system_a + user), 4, cache=CacheRequest()))
    prompt = text(system_b + user)
    got = miss(h, prompt, message_starts=starts, message_roles=roles)
    at = system_a.index("briefly")
    assert got is not None
    assert (got.reason, got.token, got.reused) == ("diverged", at, at)
    assert (got.message, got.role) == (0, "system")
    assert got.common.endswith("Answer ")
    assert got.cached.startswith("briefly.")
    assert got.prompt.startswith("at length.")
    assert len(got.cached) <= 24
    assert len(got.common) <= 8


def test_a_changed_user_turn_falls_in_that_message() -> None:
    h = _decoding(Harness(trimmable=True))
    head = "system: S.\n"
    h.run(GenerationRequest(text(head + "user: one\nassistant:"), 4))
    got = miss(
        h,
        text(head + "user: two\nassistant:"),
        message_starts=(0, len(head)),
        message_roles=("system", "user"),
    )
    assert got is not None
    assert (got.reason, got.message, got.role) == ("diverged", 1, "user")


def test_an_untrimmable_model_reports_the_checkpoint_it_restarted_from() -> None:
    h = Harness(trimmable=False)
    base = tuple(range(100))
    h.run(request(base, boundaries=(40,)))
    got = miss(h, (*base[:70], 7, 7, 7), boundaries=(40,))
    assert got is not None
    assert got.reason == "checkpoint"
    assert got.token == 70
    assert got.reused == 40


def test_an_eviction_that_cost_the_prefix_says_so() -> None:
    h = Harness(trimmable=True, budget=10 * 150)
    h.run(request(range(100)))
    for i in range(1, 4):  # other conversations push it out
        h.run(request(range(1000 * i, 1000 * i + 100)))
    assert not any(e.tokens[:100] == tuple(range(100)) for e in h.cache.store)
    got = miss(h, (*range(100), 5, 5))
    assert got is not None
    assert got.reason == "evicted"
    assert got.reused == 0


def test_a_diagnosis_that_fails_is_absent_never_an_error() -> None:
    h = Harness(trimmable=True)
    h.run(request(range(50)))
    cache: PromptCache = h.cache

    def broken(_: Any) -> str:
        raise RuntimeError("no tokenizer")

    cache._decode = broken
    got = miss(h, (*range(20), 99, 98))
    # The excerpts are left out; the place is still said.
    assert got is not None
    assert got.reason == "diverged"
    assert got.cached == ""
