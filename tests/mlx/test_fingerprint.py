"""The model fingerprint and the stored states it guards, on the real tiny
dense demo model (a copy per test, so its weight files can be rewritten).

Persisted prompt-cache entries are filed under the fingerprint: a model
whose weights changed (even in place, same names and sizes), or that holds
its weights in another dtype, must find none of the old entries; and a
stored state whose arrays do not fit the live model's cache is a miss with
one warning, never served.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
import trio
from mlx_lm.models.cache import KVCache, save_prompt_cache

from gezel_trio import (
    EngineConfig,
    Failed,
    Finished,
    GenerationRequest,
    SamplingParams,
    open_engine,
)
from gezel_trio.core.request import CacheRequest
from gezel_trio.host.persist import DiskCache
from gezel_trio.mlx.fingerprint import DIGESTS_DIR, model_fingerprint, weights_digest

HANG = 120
PROMPT = tuple(range(100, 160))


@pytest.fixture
def model(dense_model: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "model"
    shutil.copytree(dense_model, copy)
    return copy


def flip_in_place(weights: Path) -> None:
    """Other weights in the same file, same size: the sign bit of every
    2- and 4-byte value (the high byte of each, little endian) flipped, so
    every value stays finite."""
    with weights.open("r+b") as f:
        header = int.from_bytes(f.read(8), "little")
        f.seek(8 + header)
        data = bytearray(f.read())
        for i in range(1, len(data), 2):
            data[i] ^= 0x80
        f.seek(8 + header)
        f.write(data)


async def cached_tokens(engine: Any, prompt: tuple[int, ...], cache_id: str | None) -> int:
    req = GenerationRequest(
        prompt, 3, SamplingParams(temperature=0.0), cache=CacheRequest(cache_id=cache_id)
    )
    with engine.submit_nowait(req) as handle:
        async for _, event in handle:
            if isinstance(event, Finished):
                return int(event.usage.cached_tokens)
            assert not isinstance(event, Failed), event
    raise AssertionError("no terminal event")


async def test_weights_rewritten_in_place_are_another_model(model: Path, tmp_path: Path) -> None:
    config = EngineConfig.from_flags(model=model, persist_dir=tmp_path / "persist")
    weights = model / "model.safetensors"
    with trio.fail_after(HANG):
        async with open_engine(config) as engine:
            assert await cached_tokens(engine, PROMPT, "s") == 0
            first = engine.info.fingerprint
        # The same files: the same fingerprint, and the entry is a disk hit.
        async with open_engine(config) as engine:
            assert engine.info.fingerprint == first
            assert await cached_tokens(engine, (*PROMPT, 7, 8), "s") > 0
        size = weights.stat().st_size
        flip_in_place(weights)
        assert weights.stat().st_size == size
        async with open_engine(config) as engine:
            assert engine.info.fingerprint != first
            assert await cached_tokens(engine, (*PROMPT, 7, 8, 9), "s") == 0


def test_a_digest_is_remembered_until_the_file_changes(
    model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    digests = tmp_path / DIGESTS_DIR
    weights = model / "model.safetensors"
    caplog.set_level(logging.INFO, logger="gezel_trio.mlx")
    first = weights_digest(weights, digests)
    assert weights_digest(weights, digests) == first
    assert sum("hashed model.safetensors" in r.message for r in caplog.records) == 1
    # Rewritten with its old mtime restored (as cp -p or tar would): the
    # ctime still changed, and the file is hashed again.
    st = weights.stat()
    flip_in_place(weights)
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert weights.stat().st_mtime_ns == st.st_mtime_ns
    assert weights_digest(weights, digests) != first
    assert sum("hashed model.safetensors" in r.message for r in caplog.records) == 2


def test_a_chat_template_edit_keeps_the_fingerprint(model: Path) -> None:
    before = model_fingerprint(model, held="float32", digests=None)
    path = model / "tokenizer_config.json"
    data = json.loads(path.read_text())
    data["chat_template"] = "{{ messages }}"
    path.write_text(json.dumps(data))
    assert model_fingerprint(model, held="float32", digests=None) == before
    data["model_max_length"] = 17
    path.write_text(json.dumps(data))
    assert model_fingerprint(model, held="float32", digests=None) != before


async def test_keep_quantized_changes_the_fingerprint_where_it_changes_the_weights(
    model: Path, tmp_path: Path
) -> None:
    # Half-precision weights: on the CPU they run as float32 unless kept.
    weights = model / "model.safetensors"
    arrays = mx.load(str(weights))
    mx.save_safetensors(str(weights), {k: v.astype(mx.float16) for k, v in arrays.items()})
    prints = {}
    with trio.fail_after(HANG):
        for keep in (False, True):
            config = EngineConfig.from_flags(
                model=model, persist_dir=tmp_path / "p", keep_quantized=keep
            )
            async with open_engine(config) as engine:
                prints[keep] = engine.info.fingerprint
    if mx.default_device() == mx.cpu:
        assert prints[False] != prints[True]
    else:  # the weights are held as stored either way: the same KV
        assert prints[False] == prints[True]


class _Writer:
    """Writes a hand-made state as the MLX backend does (tests' own thread)."""

    def dump_state(self, state: Any, metadata: dict[str, str], path: Path) -> None:
        save_prompt_cache(str(path), state, metadata)

    def forget_state(self, path: Path) -> None:
        pass

    def load_state(self, payload: bytes, path: Path) -> tuple[Any, dict[str, str]]:
        raise NotImplementedError


def layers(model: Path, length: int, *, heads: int = 0, dtype: Any = mx.float32) -> list[Any]:
    cfg = json.loads((model / "config.json").read_text())
    shape = (1, cfg["num_key_value_heads"] + heads, length, cfg["head_dim"])
    out = []
    for _ in range(cfg["num_hidden_layers"]):
        c = KVCache()
        c.keys, c.values = mx.zeros(shape, dtype=dtype), mx.zeros(shape, dtype=dtype)
        c.offset = length
        out.append(c)
    return out


@pytest.mark.parametrize(
    "wrong",
    [
        pytest.param({"heads": 1}, id="kv-heads"),
        pytest.param({"dtype": mx.float16}, id="dtype"),
    ],
)
async def test_a_stored_state_of_the_wrong_shape_is_a_miss_with_a_warning(
    model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, wrong: dict[str, Any]
) -> None:
    persist = tmp_path / "persist"
    config = EngineConfig.from_flags(model=model, persist_dir=persist)
    with trio.fail_after(HANG):
        async with open_engine(config) as engine:
            fingerprint = engine.info.fingerprint
        disk = DiskCache(persist, fingerprint, _Writer())
        good, bad = PROMPT[:40], tuple(range(300, 340))
        for tokens, state in ((good, layers(model, 40)), (bad, layers(model, 40, **wrong))):
            key = f"anon:{tokens[0]}-{tokens[-1]}"
            assert disk.save(key, tokens, state, kind="session", roster="")
        disk.lock.release()
        caplog.set_level(logging.WARNING)
        async with open_engine(config) as engine:
            # A state of the right shape seeds (the control) ...
            assert await cached_tokens(engine, (*good, 1, 2), None) >= 32
            # ... one of the wrong shape is refused, once, and never served.
            assert await cached_tokens(engine, (*bad, 1, 2), None) == 0
            assert engine.health().status == "ok"
    refused = [r.message for r in caplog.records if "rejected" in r.message]
    assert len(refused) == 1, refused
    assert "layer 0 holds" in refused[0]
