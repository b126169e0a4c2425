"""``/metrics``' memory gauges on the scripted engine: MLX's figures as the
host thread last read them, the buffer cache given back when the engine goes
idle (once, not at every step), and the bookkeeping sizes.

The scripted backend leaves ``buffer_growth`` bytes in a simulated buffer
cache at each model step; ``reclaim`` empties it. Each scenario is a whole
engine in one Trio run under ``MockClock``; ``wait_until`` wakes at every
host exchange, so no test waits for a figure by time.
"""

from __future__ import annotations

from typing import Any

import attrs
import pytest
import trio
import trio.testing
from prometheus_client.parser import text_string_to_metric_families

from gezel_trio.core.figures import BackendFigures, MemoryFigures, SpecFigures, published
from gezel_trio.host import loop
from gezel_trio.testing import ScriptedBackend, TestEngine, open_test_engine
from tests.support.scenarios import drain, req


def _gauges(t: TestEngine) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(t.engine.metrics.exposition().decode()):
        for sample in family.samples:
            out[sample.name] = sample.value
    return out


def test_the_buffer_cache_shows_and_is_given_back_when_the_engine_goes_idle(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    trims: list[None] = []
    monkeypatch.setattr(loop, "_malloc_trim", lambda: trims.append(None))

    async def scenario() -> None:
        backend = ScriptedBackend(buffer_growth=4096)
        async with open_test_engine(backend) as t:
            seen: list[float] = []
            async with trio.open_nursery() as nursery:

                async def watch() -> None:
                    await t.engine.wait_until(
                        lambda _: (
                            bool(seen.append(_gauges(t)["gezel_mlx_cache_memory_bytes"]))
                            or seen[-1] > 0
                        )
                    )

                nursery.start_soon(watch)
                await drain(t, req(max_tokens=20))
            assert max(seen) >= 4096, "the cache grows while the engine steps"
            await t.engine.wait_until(lambda _: _gauges(t)["gezel_mlx_cache_memory_bytes"] == 0)
            assert backend.reclaims == 1
            gauges = _gauges(t)
            assert gauges["gezel_mlx_cache_limit_bytes"] == 1 << 30
            assert gauges["gezel_process_resident_memory_bytes"] > 0
            # One trim per busy spell, not one per step: 20 steps, one trim.
            steps = backend.steps
            await drain(t, req(max_tokens=20))
            await t.engine.wait_until(lambda _: _gauges(t)["gezel_mlx_cache_memory_bytes"] == 0)
            assert backend.steps - steps >= 20
            assert backend.reclaims == 2
            assert len(trims) == 2, "glibc's free pages go back with the buffer cache"

    trio.run(scenario, clock=trio.testing.MockClock(autojump_threshold=0))


def _numbered(cls: type[Any], start: int) -> Any:
    """An instance of a figures class whose every declared figure holds a
    value of its own (``start``, ``start + 1``, ...)."""
    names = [f.name for f in attrs.fields(cls) if "metric" in f.metadata]
    return cls(**{name: start + i for i, name in enumerate(names)})


class _Measuring(ScriptedBackend):
    """Reports a value of its own for every figure ``core.figures`` declares."""

    def figures(self) -> BackendFigures:
        return attrs.evolve(
            super().figures(),
            memory=_numbered(MemoryFigures, 1000),
            speculation=_numbered(SpecFigures, 2000),
        )


def test_every_declared_backend_figure_is_on_metrics_under_its_name() -> None:
    expected = {m.name: (m.kind, v) for m, v in published(_Measuring().figures())}
    assert len(expected) == 8, "the memory gauges and the speculation counters"

    async def scenario() -> None:
        async with open_test_engine(_Measuring()) as t:
            await drain(t, req(max_tokens=3))
            families = {
                f.name: f
                for f in text_string_to_metric_families(t.engine.metrics.exposition().decode())
            }
            for name, (kind, value) in expected.items():
                family = families[name.removesuffix("_total")]
                assert family.type == kind, name
                assert [s.value for s in family.samples if s.name.endswith(("_total", name))] == [
                    value
                ], name

    trio.run(scenario, clock=trio.testing.MockClock(autojump_threshold=0))
