"""A per-layer embedding table read from the model's own files, row by row.

Gemma 3n and the Gemma 4 E-series give every token, in every layer, a row of
a second embedding table (``embed_tokens_per_layer``:
``vocab_size_per_layer_input`` rows of layers x ``hidden_size_per_layer_input``).
It is a large part of the model - in Gemma 4 E4B, 262,144 rows of 42 x 256,
1.4 GB at 4 bits, 5.6 GB in bfloat16 - of which a conversation reads the rows
of the few thousand distinct tokens it holds.

``map_table`` replaces the loaded model's table, before its arrays are read
(the model is loaded lazily), by a ``MappedEmbedding``: the table's tensors
memory-mapped where they lie in the model's safetensors files, and each
forward's rows read from them and dequantized exactly as MLX's
``QuantizedEmbedding`` does, so the output is the same to the bit. The
operating system's page cache keeps the rows in use and drops them under
pressure; nothing is copied or written beside the model (the seed's view
directory held hard links and a manifest for its loader; here the files are
read in place).

What it costs: the rows are read on the host, so each forward waits for the
ids it embeds, which in decode are the previous step's sample. Building the
next step's graph then no longer overlaps the running step, as it does in
mlx-lm's decode loop (``async_eval``).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import attrs
import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_unflatten

__all__ = ["MappedEmbedding", "UnmappableTable", "map_table"]

# The module that holds the table in mlx-lm's gemma3n and gemma4 classes.
TABLE = "embed_tokens_per_layer"

# Safetensors dtypes as stored: bfloat16 has no numpy type, so its bits are
# read as uint16 and viewed as bfloat16 in MLX.
_STORED: dict[str, tuple[np.dtype[Any], mx.Dtype]] = {
    "F32": (np.dtype("<f4"), mx.float32),
    "F16": (np.dtype("<f2"), mx.float16),
    "BF16": (np.dtype("<u2"), mx.bfloat16),
    "U32": (np.dtype("<u4"), mx.uint32),
    "U8": (np.dtype("u1"), mx.uint8),
}


class UnmappableTable(ValueError):
    """The table is not stored in a way ``map_table`` can read in place."""


class _Rows:
    """One tensor of the table, memory-mapped: rows gathered as MLX arrays."""

    def __init__(self, array: np.memmap[Any, Any], dtype: mx.Dtype) -> None:
        self.array = array
        self.dtype = dtype

    def take(self, ids: np.ndarray[Any, Any]) -> mx.array:
        # Fancy indexing copies just these rows out of the mapping.
        rows = mx.array(self.array[ids])
        return rows.view(self.dtype) if self.dtype == mx.bfloat16 else rows


@attrs.frozen
class _Table:
    rows: dict[str, _Rows]  # weight, and scales (and biases) when quantized
    quantized: dict[str, Any] | None  # group_size, bits, mode


# mlx ships no type information for nn.Module, which mypy sees as Any.
class MappedEmbedding(nn.Module):  # type: ignore[misc]
    """An ``Embedding`` or ``QuantizedEmbedding`` whose tensors stay in the
    model's files. They are not parameters (not MLX arrays, held in a plain
    attribute), so nothing evaluates, copies or converts them."""

    def __init__(self, table: _Table, dtype: mx.Dtype) -> None:
        super().__init__()
        self._table = table
        # The output's dtype: the stored one, or float32 where the loader
        # holds every table as float32 (``loading.hold_float32``).
        self.output_dtype = dtype

    @property
    def nbytes(self) -> int:
        return sum(r.array.nbytes for r in self._table.rows.values())

    def __call__(self, x: mx.array) -> mx.array:
        ids = np.asarray(x, dtype=np.int64)  # waits for x: see the module docstring
        flat = ids.reshape(-1)
        rows, quantized = self._table.rows, self._table.quantized
        weight = rows["weight"].take(flat)
        if quantized is None:
            out = weight
        else:
            biases = rows.get("biases")
            out = mx.dequantize(
                weight,
                scales=rows["scales"].take(flat),
                biases=biases.take(flat) if biases is not None else None,
                **quantized,
            )
        return out.astype(self.output_dtype).reshape(*ids.shape, -1)


def map_table(model: Any, model_dir: Path) -> str:
    """Replace ``model``'s per-layer embedding table (loaded lazily, not yet
    read) by a ``MappedEmbedding`` over the files of ``model_dir``; return a
    description for the log. Raises ``UnmappableTable`` when the model has
    no such table or the files do not hold it as the model uses it (then the
    caller keeps it resident)."""
    found = [(p, m) for p, m in model.named_modules() if p.split(".")[-1] == TABLE]
    if len(found) != 1:
        raise UnmappableTable(f"{len(found)} modules named {TABLE}")
    path, module = found[0]
    if isinstance(module, nn.QuantizedEmbedding):
        quantized: dict[str, Any] | None = {
            "group_size": module.group_size,
            "bits": module.bits,
            "mode": module.mode,
        }
        parts = ["weight", "scales"] + (["biases"] if "biases" in module else [])
    elif isinstance(module, nn.Embedding):
        quantized, parts = None, ["weight"]
    else:
        raise UnmappableTable(f"{path} is a {type(module).__name__}")
    stored = _tensors(model_dir, [f"{TABLE}.{part}" for part in parts])
    rows = {}
    for part in parts:
        file, entry, data_start = stored[f"{TABLE}.{part}"]
        loaded = module[part]
        kind = _STORED.get(entry["dtype"])
        shape = tuple(entry["shape"])
        if kind is None or kind[1] != loaded.dtype or shape != tuple(loaded.shape):
            raise UnmappableTable(
                f"{TABLE}.{part} is stored as {entry['dtype']} {list(shape)}, the model "
                f"uses {loaded.dtype} {list(loaded.shape)}"
            )
        begin, end = entry["data_offsets"]
        if end - begin != int(np.prod(shape)) * kind[0].itemsize:
            raise UnmappableTable(f"{TABLE}.{part}: its byte range does not match its shape")
        array = np.memmap(file, dtype=kind[0], mode="r", offset=data_start + begin, shape=shape)
        rows[part] = _Rows(array, kind[1])
    dtype = module.scales.dtype if quantized is not None else module.weight.dtype
    mapped = MappedEmbedding(_Table(rows, quantized), dtype)
    model.update_modules(tree_unflatten([(path, mapped)]))
    form = f"{quantized['bits']}-bit" if quantized is not None else str(dtype).split(".")[-1]
    count, cols = module.weight.shape
    width = cols * 32 // quantized["bits"] if quantized is not None else cols
    return f"{path}: {count} rows of {width}, {form}, {mapped.nbytes / 2**20:.1f} MiB"


def _tensors(model_dir: Path, suffixes: list[str]) -> dict[str, tuple[Path, dict[str, Any], int]]:
    """For each suffix, the one tensor whose name ends with it, across the
    model's safetensors files: ``(file, header entry, data start)``."""
    out: dict[str, tuple[Path, dict[str, Any], int]] = {}
    for file in sorted(model_dir.glob("model*.safetensors")):
        header, start = _header(file)
        for name, entry in header.items():
            for suffix in suffixes:
                if name == suffix or name.endswith("." + suffix):
                    if suffix in out:
                        raise UnmappableTable(f"more than one tensor named *{suffix}")
                    out[suffix] = (file, entry, start)
    missing = [s for s in suffixes if s not in out]
    if missing:
        raise UnmappableTable(f"no tensor named *{missing[0]} in {model_dir.name}")
    return out


def _header(file: Path) -> tuple[dict[str, Any], int]:
    """The safetensors header (8 bytes of length, then JSON) and where the
    data after it starts."""
    try:
        with file.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
    except (OSError, ValueError, struct.error) as exc:
        raise UnmappableTable(f"{file.name}: unreadable safetensors header: {exc}") from exc
    header.pop("__metadata__", None)
    return header, 8 + length
