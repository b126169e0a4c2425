"""The seed sidecar's command line, parsed by ours (no server started).

Every flag the seed declares parses; each is mapped to ours, honoured, or
noticed on stderr; a model the PLE flags cannot serve is refused before
anything loads. ``tests/server/test_seed_compat.py`` starts the real server with
the same command line.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gezel_trio import cli
from tests.support.seed import seed_command_line


def test_the_seed_command_line_maps_onto_ours(tmp_path: Path) -> None:
    args = cli._parser().parse_args(seed_command_line(tmp_path, tmp_path))
    config = cli.server_config(args, tmp_path)
    assert config.engine.memory.limit_mb == 8192  # --gpu-memory-limit-mb
    assert config.engine.memory.wired_limit_mb == 4096
    assert config.engine.scheduling.max_concurrency == 2
    assert config.engine.scheduling.prefill_step_size == 64
    assert config.engine.cache.budget_mb == 4096
    assert config.engine.cache.persist_dir == tmp_path / "persist"
    assert config.engine.loading.fingerprint == "seed-compat-test"
    assert config.http.stream_tool_calls is True
    assert (config.stdout.prefill_min_tokens, config.stdout.prefill_interval) == (2048, 4.0)
    assert (config.engine.kv_quant.bits, config.engine.kv_quant.group_size) == (8, 64)
    assert config.engine.kv_quant.start == 256
    notes = cli._seed_notices(args)
    assert [n.split(":")[0] for n in notes] == [
        "--spec-draft-model " + str(tmp_path / "drafter") + " --spec-draft-kind mtp "
        "--spec-block-size 4",
        "--vision",
    ]
    assert all("\n" not in n for n in notes)


def test_the_seed_defaults_ask_for_nothing_this_build_lacks(tmp_path: Path) -> None:
    args = cli._parser().parse_args(["serve", "--model", str(tmp_path)])
    assert cli._seed_notices(args) == []
    config = cli.server_config(args, tmp_path)
    assert config.engine.memory.limit_mb is None
    assert config.engine.memory.wired_limit_mb is None


@pytest.mark.parametrize(
    ("argv", "on"),
    [
        ([], True),
        (["--stream-tool-calls"], True),
        (["--stream-tool-calls", "on"], True),
        (["--stream-tool-calls", "off"], False),
        (["--no-stream-tool-calls"], False),
    ],
)
def test_stream_tool_calls_on_or_off(tmp_path: Path, argv: list[str], on: bool) -> None:
    args = cli._parser().parse_args(["serve", *argv])
    assert cli.server_config(args, tmp_path).http.stream_tool_calls is on


def test_the_seeds_serial_concurrency_and_our_own_limit_win_with_a_notice(tmp_path: Path) -> None:
    argv = ["--max-concurrency", "0", "--gpu-memory-limit-mb", "100", "--memory-limit-mb", "50"]
    args = cli._parser().parse_args(["serve", *argv])
    config = cli.server_config(args, tmp_path)
    assert config.engine.scheduling.max_concurrency == 1
    assert config.engine.memory.limit_mb == 50
    notes = cli._seed_notices(args)
    assert any(n.startswith("--max-concurrency 0") for n in notes)
    assert any(n.startswith("--gpu-memory-limit-mb 100") for n in notes)


def _model_with_ple(root: Path) -> Path:
    model = root / "ple-model"
    model.mkdir()
    config = {
        "model_type": "qwen4",
        "text_config": {"vocab_size_per_layer_input": 262144, "hidden_size_per_layer_input": 256},
    }
    (model / "config.json").write_text(json.dumps(config))
    return model


def test_a_model_with_a_ple_table_is_served_mapped_with_a_notice_not_refused(
    tmp_path: Path,
) -> None:
    model = _model_with_ple(tmp_path)
    argv = ["serve", "--model", str(model), "--external-ple-dir", str(tmp_path / "view")]
    for extra in ([], ["--allow-resident-ple-fallback"]):
        args = cli._parser().parse_args([*argv, *extra])
        notice = cli._ple_notice(model, args)
        assert notice is not None
        assert notice.startswith("--external-ple-dir: qwen4 declares a per-layer embedding")
        assert "(memory-mapped), not held in memory" in notice
        assert cli.server_config(args, model).engine.loading.map_per_layer_embeddings
    # Without --external-ple-dir nothing was asked of the table: no notice,
    # and the table is loaded as any other weight unless our flag asks.
    plain = cli._parser().parse_args(["serve"])
    assert cli._ple_notice(model, plain) is None
    assert not cli.server_config(plain, model).engine.loading.map_per_layer_embeddings
    ours = cli._parser().parse_args(["serve", "--map-per-layer-embeddings"])
    assert cli.server_config(ours, model).engine.loading.map_per_layer_embeddings
    alone = cli._parser().parse_args(["serve", "--allow-resident-ple-fallback"])
    assert "--allow-resident-ple-fallback: no effect without --external-ple-dir" in (
        cli._seed_notices(alone)
    )


def test_out_of_range_marker_settings_are_a_message(tmp_path: Path) -> None:
    args = cli._parser().parse_args(["serve", "--prefill-marker-interval", "nan"])
    with pytest.raises(ValueError, match="prefill_interval"):
        cli.server_config(args, tmp_path)
