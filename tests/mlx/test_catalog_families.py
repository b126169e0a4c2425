"""Models of the seed's catalog families that load unlike the others, each a
tiny local demo of the family's shape (``demo_model``), loaded through the
real loader and decoded over the real engine and HTTP app in this Trio run:

* ``ple``: Gemma 4 E-series, with a per-layer embedding table, sliding-window
  and KV-shared layers, and a vision config it serves without; also started
  from the seed supervisor's own command line, whose ``--external-ple-dir``
  once refused it and now has its table read from the model's files;
* ``ple-gemma3n``: the same for Gemma 3n, with Hugging Face's tensor names;
* ``lfm2``: an LFM2.5 config that gives the feed-forward width only as
  ``intermediate_size`` (the seed patched ``block_ff_dim`` into the file for
  mlx-lm 0.31 and mlx-vlm 0.6);
* ``qwen3_5-text``: a text-only Qwen 3.5 export, ``language_model.*`` shards
  and no vision config (the seed relaxed mlx-vlm 0.6's strict loading).

Every request is greedy, so a repeat must decode the same tokens; the repeat
runs from the prompt cache, which checks that each family's cache layout
(rotating windows, shared KV, convolution state) is saved and restored whole.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx2 as httpx
import pytest
import trio
from PIL import Image

from gezel_trio import cli
from gezel_trio.core.cache_plan import SNAPSHOT_MARGIN
from gezel_trio.mlx.model_source import per_layer_embedding_table
from tests.support.inprocess import served, served_config
from tests.support.seed import seed_command_line

pytestmark = pytest.mark.slow

HANG = 120
MESSAGES = [
    {"role": "system", "content": "You keep the harbour's berth ledger. " * 4},
    {"role": "user", "content": "Which berth has the Aurora tonight?"},
]


@pytest.fixture(params=["ple", "ple-gemma3n", "lfm2", "qwen3_5-text"])
def family_model(request: pytest.FixtureRequest) -> Path:
    name = {
        "ple": "ple_model",
        "ple-gemma3n": "ple_gemma3n_model",
        "lfm2": "lfm2_model",
        "qwen3_5-text": "qwen3_5_text_model",
    }
    path: Path = request.getfixturevalue(name[request.param])
    return path


async def chat(client: httpx.AsyncClient, **extra: Any) -> dict[str, Any]:
    body = {"messages": MESSAGES, "max_tokens": 8, "temperature": 0, **extra}
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    reply: dict[str, Any] = r.json()
    return reply


async def test_each_family_loads_and_decodes_the_same_tokens_again_from_the_cache(
    family_model: Path,
) -> None:
    with trio.fail_after(HANG):
        async with (
            served(family_model) as (engine, url),
            httpx.AsyncClient(base_url=url, timeout=HANG) as client,
        ):
            assert not engine.info.vision
            first = await chat(client)
            again = await chat(client)
    assert first["choices"][0]["finish_reason"] == "length"
    assert first["usage"]["completion_tokens"] == 8
    text = first["choices"][0]["message"]["content"]
    assert text.strip()
    assert again["choices"][0]["message"]["content"] == text
    prompt = again["usage"]["prompt_tokens"]
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert prompt - SNAPSHOT_MARGIN <= cached < prompt


async def test_the_ple_model_serves_from_the_seed_command_line_with_its_table_mapped(
    ple_model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    argv, profile = cli._command_line(seed_command_line(ple_model, tmp_path), seed_launch=False)
    args = cli._parser(profile).parse_args(argv)
    assert args.external_ple_dir == tmp_path / "ple-view"
    table = per_layer_embedding_table(ple_model)
    assert table is not None
    assert "vocab_size_per_layer_input" in table
    notice = cli._ple_notice(ple_model, args)
    assert notice == (
        f"--external-ple-dir: {table}; its rows are read from the model's own files as "
        f"tokens need them (memory-mapped), not held in memory; {tmp_path / 'ple-view'} "
        "is not used"
    )
    config = cli.server_config(args, ple_model)
    assert config.engine.loading.map_per_layer_embeddings
    png = io.BytesIO()
    Image.new("RGB", (8, 8), "orange").save(png, "PNG")
    pixel = base64.b64encode(png.getvalue()).decode()
    image = [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{pixel}"}},
    ]
    with trio.fail_after(HANG), caplog.at_level(logging.INFO, logger="gezel_trio.mlx"):
        async with (
            served_config(config) as (engine, url),
            httpx.AsyncClient(base_url=url, timeout=HANG) as client,
        ):
            reply = await chat(client)
            refused = await client.post(
                "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": image}], "max_tokens": 4},
            )
            assert engine.info.context_length == 32768
    assert reply["usage"]["completion_tokens"] == 8
    assert reply["choices"][0]["message"]["content"].strip()
    # Served as text: its vision config is not the image path's to batch.
    assert refused.status_code == 400
    assert "text-only" in refused.json()["error"]["message"]
    assert not (tmp_path / "ple-view").exists()
    text = json.loads((ple_model / "config.json").read_text())["text_config"]
    rows, width = text["vocab_size_per_layer_input"], 4 * text["hidden_size_per_layer_input"]
    mapped = [r.getMessage() for r in caplog.records if "read from its files" in r.getMessage()]
    assert mapped == [
        f"{ple_model.name}: per-layer embedding table read from its files as needed: "
        f"language_model.model.embed_tokens_per_layer: {rows} rows of {width}, float32, "
        f"{rows * width * 4 / 2**20:.1f} MiB"
    ]


def test_external_ple_dir_on_a_model_without_a_table_is_a_notice_that_it_does_not_apply(
    dense_model: Path, tmp_path: Path
) -> None:
    argv, profile = cli._command_line(seed_command_line(dense_model, tmp_path), seed_launch=False)
    args = cli._parser(profile).parse_args(argv)
    assert cli._ple_notice(dense_model, args) == (
        "--external-ple-dir: not applicable, the model declares no per-layer embedding table"
    )
    without = cli._parser().parse_args(["serve", "--model", str(dense_model)])
    assert cli._ple_notice(dense_model, without) is None


def test_the_seed_command_line_serves_the_ple_model_in_a_real_process(
    ple_model: Path, tmp_path: Path
) -> None:
    """``gezel-trio`` itself, as the supervisor starts it: it once exited 2
    here. One notice on stderr, an answer, and a clean stop on SIGTERM."""
    stderr = tmp_path / "stderr.txt"
    with stderr.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gezel_trio", *seed_command_line(ple_model, tmp_path)],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    try:
        assert proc.stdout is not None
        url = None
        for line in proc.stdout:  # ends if the process dies: then url stays None
            if line.startswith("gezel-trio listening on "):
                url = line.split()[-1]
                break
        assert url is not None, stderr.read_text()
        body = {"messages": MESSAGES, "max_tokens": 4, "temperature": 0}
        reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=HANG)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 4
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=HANG) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    notices = [n for n in stderr.read_text().splitlines() if "--external-ple-dir" in n]
    assert len(notices) == 1, notices
    assert notices[0].startswith("gezel-trio: --external-ple-dir: gemma4 declares a per-layer")
    assert "(memory-mapped), not held in memory" in notices[0]
