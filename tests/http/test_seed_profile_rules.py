"""The seed profile's reasoning, history and stop rules as flags: the
profile sets each default, a flag given wins, the standard profile keeps
gezel-trio's own behaviour (no server started)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gezel_trio import cli
from gezel_trio.profiles import SEED, STANDARD
from gezel_trio.server import ServerConfig


def config(profile: str, *argv: str, model: Path) -> ServerConfig:
    args = cli._parser(profile).parse_args(["serve", *argv])
    return cli.server_config(args, model)


def test_reasoning_format_follows_the_profile_and_the_flag_wins(tmp_path: Path) -> None:
    assert config(STANDARD, model=tmp_path).http.reasoning_format == "auto"
    assert config(SEED, model=tmp_path).http.reasoning_format == "none"
    flag = ("--reasoning-format", "auto")
    assert config(SEED, *flag, model=tmp_path).http.reasoning_format == "auto"
    flag = ("--reasoning-format", "none")
    assert config(STANDARD, *flag, model=tmp_path).http.reasoning_format == "none"


def test_an_unknown_reasoning_format_flag_is_a_usage_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli._parser().parse_args(["serve", "--reasoning-format", "deepseek-legacy"])
    assert exit_.value.code == 2
    assert "--reasoning-format" in capsys.readouterr().err


def test_dropping_past_tool_calls_follows_the_profile_and_the_flag_wins(tmp_path: Path) -> None:
    assert config(STANDARD, model=tmp_path).engine.shaping.drop_past_tool_calls is False
    assert config(SEED, model=tmp_path).engine.shaping.drop_past_tool_calls is True
    off = config(SEED, "--no-drop-past-tool-calls", model=tmp_path)
    assert off.engine.shaping.drop_past_tool_calls is False
    on = config(STANDARD, "--drop-past-tool-calls", model=tmp_path)
    assert on.engine.shaping.drop_past_tool_calls is True


def test_the_tool_call_stop_follows_the_profile_and_the_flag_wins(tmp_path: Path) -> None:
    assert config(STANDARD, model=tmp_path).engine.shaping.stop_at_tool_call_end is False
    assert config(SEED, model=tmp_path).engine.shaping.stop_at_tool_call_end is True
    off = config(SEED, "--stop-at-tool-call-end", "off", model=tmp_path)
    assert off.engine.shaping.stop_at_tool_call_end is False


def test_think_by_default_is_a_flag_neither_profile_sets(tmp_path: Path) -> None:
    assert config(STANDARD, model=tmp_path).engine.shaping.think_by_default is False
    assert config(SEED, model=tmp_path).engine.shaping.think_by_default is False
    assert (
        config(SEED, "--think-by-default", model=tmp_path).engine.shaping.think_by_default is True
    )
