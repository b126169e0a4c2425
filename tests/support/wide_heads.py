"""Demo models whose attention heads are 32 wide, MLX's smallest KV
quantization group (the tiny demo models' heads are 16), and the prompts the
quantized-KV tests batch."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from gezel_trio.testing.demo_models import _builder as demo_model


def wide_heads(kind: demo_model.DemoKind, dest: Path) -> Path:
    """A tiny demo model of ``kind`` with 32-wide heads, built by the demo
    builder (its tokenizer, its weight initialisation)."""
    wide = dataclasses.replace(demo_model._dims("tiny"), head_dim=32)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(demo_model, "_dims", lambda _size: wide)
        demo_model._build(kind, "tiny", dest)
    return dest


def batch_prompts() -> list[list[int]]:
    return [[5 + (7 * i) % 900 for i in range(40)], [11, 12, 13, 14, 15, 16], [300, 301]]
