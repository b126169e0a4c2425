"""The seed profile's defaults (``gezel_trio.profiles``), as ``serve``'s
flags parse them, and the two settings of its own that this module owns:
the temperature of a request that names none and the shape of
``/v1/cache/stats``. ``tests/server/test_seed_launch.py`` starts the real
server both ways a seed launch comes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx2 as httpx
import pytest
import trio

from gezel_trio import cli
from gezel_trio.http import anthropic_messages, openai_chat, openai_completions
from gezel_trio.http.anthropic_wire import parse_messages_request
from gezel_trio.http.openai_wire import parse_chat_request, parse_completion_request
from gezel_trio.profiles import SEED, SEED_DEFAULTS, STANDARD
from tests.support.inprocess import served

MSG = [{"role": "user", "content": "Tell me about the harbour in the morning."}]


def test_every_seed_default_is_a_serve_flags_default_under_the_seed_profile() -> None:
    seed = cli._parser(SEED).parse_args(["serve"])
    standard = cli._parser().parse_args(["serve"])
    assert (seed.profile, standard.profile) == (SEED, STANDARD)
    for dest, value in SEED_DEFAULTS.items():
        assert getattr(seed, dest) == value, dest
        assert getattr(standard, dest) != value, f"{dest}: the entry changes nothing"


@pytest.mark.parametrize(
    ("argv", "seed_launch", "profile"),
    [
        (["--model", "m"], False, SEED),  # flags, no subcommand: as the seed was started
        (["--model", "m"], True, SEED),  # the installed gezel_mlx_server.py
        (["--model", "m", "--profile", "standard"], True, STANDARD),
        (["serve", "--model", "m"], False, STANDARD),
        (["serve", "--profile", "seed"], False, SEED),
    ],
)
def test_which_launch_selects_which_profile(
    argv: list[str], seed_launch: bool, profile: str
) -> None:
    assert cli._command_line(argv, seed_launch)[1] == profile


def _config(tmp_path: Path, profile: str, *argv: str) -> Any:
    return cli.server_config(cli._parser(profile).parse_args(["serve", *argv]), tmp_path)


def test_the_seed_profile_greedy_and_stats_as_an_array_and_flags_given_win(
    tmp_path: Path,
) -> None:
    standard = _config(tmp_path, STANDARD)
    assert standard.engine.requests.default_temperature == 1.0
    assert standard.http.cache_stats_format == "object"
    assert standard.engine.requests.strict_max_tokens is False
    seed = _config(tmp_path, SEED)
    assert seed.engine.requests.default_temperature == 0.0
    assert seed.http.cache_stats_format == "array"
    assert seed.engine.requests.strict_max_tokens is False
    given = _config(
        tmp_path,
        SEED,
        "--default-temperature",
        "0.7",
        "--cache-stats-format",
        "object",
        "--strict-max-tokens",
    )
    assert given.engine.requests.default_temperature == 0.7
    assert given.http.cache_stats_format == "object"
    assert given.engine.requests.strict_max_tokens is True


def test_out_of_range_values_are_a_message_naming_the_setting(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cache_stats_format"):
        _config(tmp_path, STANDARD, "--cache-stats-format", "list")
    with pytest.raises(ValueError, match="default_temperature"):
        _config(tmp_path, STANDARD, "--default-temperature", "-1")


@pytest.mark.parametrize(
    ("given", "default", "expected"),
    [({}, 1.0, 1.0), ({}, 0.0, 0.0), ({"temperature": 0.7}, 0.0, 0.7)],
)
def test_the_default_temperature_fills_in_only_where_none_is_named(
    given: dict[str, float], default: float, expected: float
) -> None:
    chats = [
        openai_chat.chat_request(
            parse_chat_request({"messages": MSG, **given}), default_temperature=default
        ),
        openai_completions.completion_request(
            parse_completion_request({"prompt": "The harbour", **given}),
            default_temperature=default,
        ),
        anthropic_messages.chat_request(
            parse_messages_request({"max_tokens": 4, "messages": MSG, **given}),
            default_temperature=default,
        ),
    ]
    assert [c.sampling.temperature for c in chats] == [expected] * 3


@pytest.mark.slow
async def test_greedy_by_default_on_every_protocol_when_set(dense_model: Path) -> None:
    """With ``--default-temperature 0`` an answer that names no temperature
    is the greedy one (sampled at 1.0 it would differ: the tiny model's
    sampled texts never repeat), and Responses echoes what it sampled with."""
    asks: list[tuple[str, dict[str, Any], Any]] = [
        (
            "/v1/chat/completions",
            {"messages": MSG, "max_tokens": 16, "ignore_eos": True},
            lambda b: b["choices"][0]["message"]["content"],
        ),
        (
            "/v1/completions",
            {"prompt": "The harbour in the morning", "max_tokens": 16, "ignore_eos": True},
            lambda b: b["choices"][0]["text"],
        ),
        (
            "/v1/messages",
            {"model": "demo", "messages": MSG, "max_tokens": 16},
            lambda b: b["content"],
        ),
        (
            "/v1/responses",
            {"input": MSG[0]["content"], "max_output_tokens": 16},
            lambda b: b["output"][-1]["content"],
        ),
    ]
    with trio.fail_after(120):
        async with (
            served(dense_model, default_temperature=0.0) as (_engine, url),
            httpx.AsyncClient(base_url=url, timeout=120) as client,
        ):
            for path, body, answer in asks:
                unnamed = (await client.post(path, json=body)).json()
                greedy = (await client.post(path, json={**body, "temperature": 0})).json()
                assert answer(greedy), path
                assert answer(unnamed) == answer(greedy), path
                if path == "/v1/responses":
                    assert unnamed["temperature"] == 0.0
