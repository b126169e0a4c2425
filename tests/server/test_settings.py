"""Settings declared once (``gezel_trio.core.settings``): the config classes'
fields are the only place a default is written, so ``serve``'s flags, its
``--help`` and the test factory cannot drift from them.

``tests/test_cli_seed.py`` checks the seed sidecar's flags and their special
mappings; this module checks the derivation itself.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import attrs
import pytest

from gezel_trio import cli
from gezel_trio.core.config import EngineConfig
from gezel_trio.core.settings import MIB, Setting, flag_default, flags_of, sections_of, settings_of
from gezel_trio.http.app import HttpSettings
from gezel_trio.server import ServerConfig
from gezel_trio.stdout_protocol import StdoutSettings
from gezel_trio.testing import open_test_engine

CONFIGS = [EngineConfig, HttpSettings, ServerConfig, StdoutSettings]


def _flagged() -> list[tuple[type, attrs.Attribute[Any], Setting]]:
    return [flagged for cls in CONFIGS for flagged in flags_of(cls)]


def _classes() -> list[type]:
    """The config classes and their sections."""
    found = list(CONFIGS)
    for cls in found:
        found += [part for _, part, _ in sections_of(cls)]
    return found


def _help_entries(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """``serve --help``, one entry per flag: the text argparse prints from
    the flag's name up to the next flag or group, on one line."""
    monkeypatch.setenv("COLUMNS", "100")
    entries: dict[str, list[str]] = {}
    flag = None
    for line in _serve_parser().format_help().splitlines():
        if line.startswith("  -"):
            flag = line.split()[0].rstrip(",")
        elif not line.startswith("    "):
            flag = None  # a heading, or the usage
        if flag is not None:
            entries.setdefault(flag, []).append(line)
    return {flag: " ".join(" ".join(lines).split()) for flag, lines in entries.items()}


def _serve_parser() -> argparse.ArgumentParser:
    parser = cli._parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    serve: argparse.ArgumentParser = sub.choices["serve"]
    return serve


def test_every_setting_declares_its_help() -> None:
    for cls in _classes():
        for field, meta in settings_of(cls):
            assert meta.help.strip(), f"{cls.__name__}.{field.name}"


def test_every_setting_with_a_flag_shows_its_default_in_help(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    entries = _help_entries(monkeypatch)
    flagged = _flagged()
    assert len(flagged) >= 29
    for cls, field, meta in flagged:
        assert meta.flag is not None
        entry = entries[meta.flag]
        default = flag_default(field, meta)
        shown = "none" if default is None else "off" if default is False else str(default)
        assert entry.endswith(f"(default: {shown})"), (cls.__name__, field.name, entry)
    # Figures as a reader of --help sees them, in the flag's unit.
    assert entries["--max-queue"].endswith("(default: 64)")
    assert entries["--max-image-mb"].endswith("(default: 8.0)")
    assert entries["--max-body-mb"].endswith("(default: 8.0)")
    assert entries["--wired-limit-mb"].endswith("(default: 0)")
    assert entries["--static-waves"].endswith("(default: off)")
    assert entries["--stream-tool-calls"].endswith("(default: on)")
    assert entries["--exit-with-parent"].endswith("(default: off)")
    assert entries["--model"].endswith("(default: none)")
    assert "85% of" in entries["--memory-limit-mb"]


def test_every_flag_of_serve_shows_its_default(monkeypatch: pytest.MonkeyPatch) -> None:
    entries = _help_entries(monkeypatch)
    # The seed's flags and the process's own too, except a flag that only
    # restates another (--no-stream-tool-calls) and --help.
    quiet = {"-h"} | {f for f in entries if f.startswith("--no-") and f"--{f[5:]}" in entries}
    assert "--no-stream-tool-calls" in quiet
    assert len(entries) > 40
    for flag, entry in entries.items():
        assert flag in quiet or "(default: " in entry, entry


def test_no_flags_give_exactly_the_config_classes_defaults(tmp_path: Path) -> None:
    args = cli._parser().parse_args(["serve"])
    config = cli.server_config(args, tmp_path)
    assert config.engine == EngineConfig(model=tmp_path)
    assert config.http == HttpSettings()
    assert config.stdout == StdoutSettings()
    assert config == ServerConfig(engine=EngineConfig(model=tmp_path))


def test_a_flag_in_mb_sets_bytes_and_zero_means_unset(tmp_path: Path) -> None:
    argv = ["serve", "--max-image-mb", "0.5", "--max-body-mb", "2", "--stall-timeout", "0"]
    config = cli.server_config(cli._parser().parse_args(argv), tmp_path)
    assert config.engine.images.bytes == MIB // 2
    assert config.http.max_body_bytes == 2 * MIB
    assert config.engine.scheduling.stall_timeout is None
    assert config.engine.scheduling.continuous_batching is True
    argv = ["serve", "--static-waves", "--keep-quantized", "--max-tokens-default", "9"]
    config = cli.server_config(cli._parser().parse_args(argv), tmp_path)
    assert config.engine.scheduling.continuous_batching is False
    assert config.engine.loading.keep_quantized is True
    assert config.engine.requests.default_max_tokens == 9


def test_an_out_of_range_flag_names_its_setting(tmp_path: Path) -> None:
    args = cli._parser().parse_args(["serve", "--max-queue", "-1"])
    with pytest.raises(ValueError, match="max_queue"):
        cli.server_config(args, tmp_path)


async def test_the_test_factory_takes_any_engine_setting() -> None:
    async with open_test_engine(max_images=2, max_tokens_default=7) as t:
        assert (t.engine.config.images.count, t.engine.config.requests.default_max_tokens) == (2, 7)
    async with open_test_engine() as t:
        # Its own defaults: the backend's prefill step, a test-sized cache;
        # every other setting is EngineConfig's.
        config = t.engine.config
        assert (config.scheduling.prefill_step_size, config.cache.budget_mb) == (
            t.backend.prefill_step,
            64,
        )
        assert (
            attrs.evolve(
                config,
                scheduling=attrs.evolve(config.scheduling, prefill_step_size=512),
                cache=attrs.evolve(config.cache, budget_mb=2048.0),
            )
            == EngineConfig()
        )
    with pytest.raises(TypeError, match="no_such_setting"):
        async with open_test_engine(no_such_setting=1):
            pass


def test_the_engine_config_is_the_model_and_its_parts_sections() -> None:
    sections = {field.name for field, _, _ in sections_of(EngineConfig)}
    assert [f.name for f in attrs.fields(EngineConfig) if f.name not in sections] == ["model"]
    flags = [meta.flag for _, _, meta in _flagged()]
    assert len(flags) == len(set(flags))


def test_serve_help_shows_each_section_under_its_title(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "100")
    under: dict[str, list[str]] = {}
    heading = ""
    for line in _serve_parser().format_help().splitlines():
        if line and not line.startswith(" "):
            heading = line.removesuffix(":")
        elif line.startswith("  --") and not line.startswith("  --no-"):
            under.setdefault(heading, []).append(line.split()[0])
    for _, part, title in sections_of(EngineConfig):
        assert under[title] == [meta.flag for _, meta in settings_of(part)], title
    assert under["the model"] == ["--model"]


def test_from_flags_builds_what_the_command_line_does(tmp_path: Path) -> None:
    argv = ["serve", "--kv-bits", "4", "--static-waves", "--max-image-mb", "0.5"]
    argv += ["--stall-timeout", "0", "--write-behind", "on", "--max-tokens-default", "9"]
    parsed = cli.server_config(cli._parser().parse_args(argv), tmp_path).engine
    built = EngineConfig.from_flags(
        model=tmp_path,
        kv_bits=4,
        static_waves=True,
        max_image_mb=0.5,
        stall_timeout=0,
        write_behind=True,
        max_tokens_default=9,
    )
    assert built == parsed
    assert built.kv_quant.bits == 4
    assert built.scheduling.continuous_batching is False
    assert built.scheduling.stall_timeout is None
    assert (built.images.bytes, built.cache.write_behind) == (MIB // 2, True)
    assert built.requests.default_max_tokens == 9
    with pytest.raises(TypeError, match="kv_bitz"):
        EngineConfig.from_flags(kv_bitz=4)


def test_a_setting_that_needs_another_names_both(tmp_path: Path) -> None:
    replay = "tcp://127.0.0.1:5558"
    with pytest.raises(
        ValueError, match="kv_events_replay replays the KV events: it needs kv_events"
    ):
        EngineConfig.from_flags(kv_events_replay=replay)
    args = cli._parser().parse_args(["serve", "--kv-events-replay", replay])
    with pytest.raises(ValueError, match="it needs kv_events"):
        cli.server_config(args, tmp_path)
    config = EngineConfig.from_flags(kv_events="tcp://127.0.0.1:5557", kv_events_replay=replay)
    assert (config.kv_events.endpoint, config.kv_events.replay) == ("tcp://127.0.0.1:5557", replay)
    # A value out of range is named by its flag, whichever section holds it.
    with pytest.raises(ValueError, match="kv_group_size must be 32, 64 or 128"):
        EngineConfig.from_flags(kv_group_size=48)
    with pytest.raises(ValueError, match="cache_budget_mb must be > 0"):
        EngineConfig.from_flags(cache_budget_mb=0)
