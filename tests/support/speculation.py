"""Decoding a few prompts to the end through a ``BatchGenerator``, with
and without speculation (``mlx.speculation``), on the real MLX backend."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from mlx_lm.generate import BatchGenerator

from gezel_trio.mlx import speculation
from gezel_trio.mlx.sampling import Sampling, greedy
from gezel_trio.mlx.speculation.draft import DraftModel, DraftPool

TOKENS = 48


class AlwaysPays(speculation.gate.Gate):
    """Every proposal verified: the tests are about correctness, and the
    measured gate would refuse some on the tiny models."""

    def pays(
        self, batch: int, width: int, expected: float, proposing: int, drafted: bool = False
    ) -> bool:
        return True


def oracle(
    prompts: list[list[int]], plain: list[list[int]], *, spoil: bool
) -> Callable[[Any, int], list[int]]:
    """An ``NgramLookup.propose`` that proposes plain decoding's own text
    (``plain``, per prompt), for the random-weight models that repeat
    nothing; ``spoil``: its last token wrong every other time, so verifies
    accept different counts per sequence (holes) and reject some."""

    def propose(self: Any, k: int) -> list[int]:
        i = next(i for i, p in enumerate(prompts) if self.tokens[: len(p)] == p)
        done = len(self.tokens) - len(prompts[i])
        out = plain[i][done : done + k]
        if spoil and len(out) >= 2 and (done + i) % 2 == 0:
            out[-1] = (out[-1] + 1) % 1000
        return out

    return propose


def prompts_of(tok: Any) -> list[list[int]]:
    text = Path(speculation.__file__).read_text()[:600]
    return [
        tok.encode("Repeat:\n" + text + "\nAgain:\n" + text[:120]),
        tok.encode("one two three four one two three four one two"),
        tok.encode("a fox"),
    ]


def run(
    model: Any,
    prompts: list[list[int]],
    *,
    spec: bool,
    samplers: list[Any] | None = None,
    processors: list[list[Any]] | None = None,
    opted_out: set[int] | None = None,
    max_tokens: list[int] | None = None,
    draft: DraftModel | None = None,
    pool: DraftPool | None = None,
    caches: list[list[Any]] | None = None,
    after_step: Callable[[BatchGenerator], None] | None = None,
    gate: speculation.gate.Gate | None = None,
) -> tuple[list[list[int]], list[Any], speculation.SpecStats, list[bool]]:
    """Decode ``prompts`` to the end; an unseeded ``Sampling`` among
    ``samplers`` speculates, as the backend's roster says; ``draft``
    proposes where the lookup does not; ``caches``: each prompt's fresh
    cache (mlx-lm's plain one when ``None``); ``after_step`` is called
    with the generator after each step, as the backend's lane does;
    ``gate``: the lane's gate (one that verifies every proposal when
    ``None``)."""
    gen = BatchGenerator(model, completion_batch_size=8, prefill_batch_size=8, stop_tokens=None)
    stats = speculation.SpecStats()
    holey: list[bool] = []
    roster = speculation.Roster(opted_out if opted_out is not None else set())
    if spec:
        speculation.install(gen, 3, roster, stats, None, draft, pool)
        type(gen._generation_batch).gate = gate if gate is not None else AlwaysPays()
    n = len(prompts)
    samplers = samplers or [greedy] * n
    uids = gen.insert(
        prompts,
        max_tokens=max_tokens or [TOKENS] * n,
        samplers=samplers,
        logits_processors=processors,
        caches=caches,
    )
    for uid, s in zip(uids, samplers, strict=True):
        if isinstance(s, Sampling) and not s.seeded:
            roster.sampled[uid] = s
    out: dict[int, list[int]] = {u: [] for u in uids}
    finals: dict[int, Any] = {}
    try:
        while len(finals) < n:
            _, responses = gen.next()
            if after_step is not None:
                after_step(gen)
            for r in responses:
                out[r.uid].append(r.token)
                if r.finish_reason is not None:
                    finals[r.uid] = r
            cache = gen._generation_batch.prompt_cache
            holey.append(bool(cache) and getattr(cache[0], "holes", None) is not None)
    finally:
        gen.close()
    return [out[u] for u in uids], [finals[u] for u in uids], stats, holey
