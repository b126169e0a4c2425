"""The per-layer embedding table read from the model's files (``mlx.ple``):
the same logits to the bit as the table held in memory, for the table as
float32, bfloat16 and 4-bit (converted from the ple demo model by mlx-lm's
own ``convert``) and for Gemma 3n's, on the loader's float32 path and with
weights kept as stored; and a table the files do not hold as the model uses
it stays in memory, with a warning, rather than failing the load."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from gezel_trio import EngineConfig
from gezel_trio.mlx import loading
from gezel_trio.mlx.loading import load_model
from gezel_trio.mlx.ple import MappedEmbedding, UnmappableTable, map_table

pytestmark = pytest.mark.slow

IDS = mx.array([[5, 60, 70, 80, 90, 100, 3, 2, 41, 41]])


def _converted(source: Path, dest: Path, **kw: Any) -> Path:
    from mlx_lm import convert

    convert(str(source), mlx_path=str(dest), **kw)
    shutil.copy(source / "tokenizer.json", dest / "tokenizer.json")
    return dest


@pytest.fixture(scope="module", params=["float32", "bfloat16", "4-bit", "gemma3n"])
def stored(
    request: pytest.FixtureRequest, ple_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    if request.param == "float32":
        return ple_model
    if request.param == "gemma3n":
        path: Path = request.getfixturevalue("ple_gemma3n_model")
        return path
    dest = tmp_path_factory.mktemp("ple") / request.param
    if request.param == "bfloat16":
        return _converted(ple_model, dest, dtype="bfloat16")
    return _converted(ple_model, dest, quantize=True, q_bits=4, q_group_size=32)


def _table(model: Any) -> Any:
    (table,) = [m for p, m in model.named_modules() if p.endswith(".embed_tokens_per_layer")]
    return table


@pytest.mark.parametrize("keep", [False, True], ids=["float32-on-cpu", "as-stored"])
def test_the_mapped_table_gives_the_resident_tables_logits_to_the_bit(
    stored: Path, keep: bool
) -> None:
    resident = load_model(EngineConfig.from_flags(model=stored, keep_quantized=keep))
    mapped = load_model(
        EngineConfig.from_flags(model=stored, keep_quantized=keep, map_per_layer_embeddings=True)
    )
    assert not isinstance(_table(resident.model), MappedEmbedding)
    assert isinstance(_table(mapped.model), MappedEmbedding)
    want, got = resident.model(IDS), mapped.model(IDS)
    assert got.dtype == want.dtype
    assert mx.array_equal(got, want).item()


def test_a_table_the_files_do_not_hold_stays_resident_with_a_warning(
    ple_model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from mlx_lm.utils import load

    model, _ = load(str(ple_model), lazy=True)
    with pytest.raises(UnmappableTable, match=r"no tensor named \*embed_tokens_per_layer.weight"):
        map_table(model, tmp_path)
    # The loader's step, given a directory that does not hold the table:
    # the model keeps it in memory and serves.
    with caplog.at_level(logging.WARNING, logger="gezel_trio.mlx"):
        loading._map_table(model, tmp_path)
    assert not isinstance(_table(model), MappedEmbedding)
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warning == (
        f"{tmp_path.name}: the per-layer embedding table is held in memory: "
        f"no tensor named *embed_tokens_per_layer.weight in {tmp_path.name}"
    )
    resident = load_model(EngineConfig(model=ple_model))
    assert mx.array_equal(model(IDS), resident.model(IDS)).item()


def test_a_model_without_a_table_is_not_mappable(lfm2_model: Path) -> None:
    from mlx_lm.utils import load

    model, _ = load(str(lfm2_model), lazy=True)
    with pytest.raises(UnmappableTable, match="0 modules named embed_tokens_per_layer"):
        map_table(model, lfm2_model)
