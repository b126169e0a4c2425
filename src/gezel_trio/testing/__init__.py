"""Deterministic engine tests without MLX.

``ScriptedBackend`` implements the engine's backend protocol exactly - chunked
prefill, one token per decode step, trimmable or untrimmable cache states,
scripted tokens, injectable step failures - and runs inside Trio, so a whole
engine runs under ``trio.testing.MockClock(autojump_threshold=0)`` and every
run schedules identically. ``Breakpoints`` stops the world at a named point
(``admitted``, ``prefill``, ``decode``, ``snapshot``, ``finished``,
``removed``, ``parked``, ``resumed``, ``shutdown``) so a test can cancel or
inject exactly there. ``open_test_engine`` wires the two together::

    async with open_test_engine(backend=ScriptedBackend(trimmable=False)) as t:
        bp = t.breakpoints.add("decode", index=3)
        ...

See ``docs/testing.md``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import attrs

from ..core.config import EngineConfig
from ..engine import Engine, open_engine
from ..host.exchange import Point
from ..host.loop import inline
from ._breakpoints import Breakpoint, Breakpoints
from ._scripted import EOS, ScriptedBackend, ScriptedState, StepFailure

__all__ = [
    "EOS",
    "Breakpoint",
    "Breakpoints",
    "Point",
    "ScriptedBackend",
    "ScriptedState",
    "StepFailure",
    "TestEngine",
    "open_test_engine",
]


@attrs.frozen
class TestEngine:
    engine: Engine
    backend: ScriptedBackend
    breakpoints: Breakpoints

    __test__ = False  # not a pytest test class


@asynccontextmanager
async def open_test_engine(
    backend: ScriptedBackend | None = None,
    *,
    cache_budget_mb: float = 64.0,
    **overrides: Any,
) -> AsyncIterator[TestEngine]:
    """An engine over a scripted backend, its host loop a Trio task.

    ``overrides`` sets any other engine setting by its flag's name, valued
    as on the command line (``EngineConfig.from_flags``: ``max_queue=2``,
    ``static_waves=True``; an unknown name is a ``TypeError``); the rest
    keep ``EngineConfig``'s defaults, except the prefill step, the
    backend's own, and a cache budget small enough for a test to fill."""
    backend = backend or ScriptedBackend()
    breakpoints = Breakpoints()
    config = EngineConfig.from_flags(
        **{"prefill_step_size": backend.prefill_step, **overrides},
        cache_budget_mb=cache_budget_mb,
    )
    async with open_engine(config, lambda _: backend, host=inline(breakpoints)) as engine:
        yield TestEngine(engine, backend, breakpoints)
