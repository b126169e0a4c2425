"""A large body never holds the event loop: it is parsed, structured and
checked on a worker thread, and the checks of a token-id list are one C pass.

The test times no request: a Trio instrument records the longest single
task step while an 8 MB body is refused. Parsing on the Trio thread made one
step of several seconds (6.4 s measured); off it, no step comes near the
bound, which is far above a normal step (well under 10 ms)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx2 as httpx
import trio

from tests.support.inprocess import served

HANG = 120
LONGEST_STEP_S = 1.0


class LongestStep(trio.abc.Instrument):
    """The longest time one Trio task step held the thread."""

    def __init__(self) -> None:
        self.longest = 0.0
        # None until a step begins: the instrument is added mid-step.
        self._began: float | None = None

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self._began = time.perf_counter()

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        if self._began is not None:
            self.longest = max(self.longest, time.perf_counter() - self._began)


def _ids_body(field: str, count: int, **rest: object) -> bytes:
    return json.dumps({field: [1] * count, **rest}, separators=(",", ":")).encode()


async def test_an_8mb_prompt_of_token_ids_is_refused_without_holding_the_loop(
    dense_model: Path,
) -> None:
    body = _ids_body("prompt", 4_000_000, max_tokens=1)
    assert len(body) > 7_900_000
    with trio.fail_after(HANG):
        async with served(dense_model) as (_engine, url), httpx.AsyncClient(base_url=url) as client:
            steps = LongestStep()
            trio.lowlevel.add_instrument(steps)
            try:
                r = await client.post(
                    "/v1/completions",
                    content=body,
                    headers={"Content-Type": "application/json"},
                    timeout=HANG,
                )
            finally:
                trio.lowlevel.remove_instrument(steps)
            assert r.status_code == 400
            assert r.json()["error"]["param"] == "prompt"
            assert steps.longest < LONGEST_STEP_S, f"one step held the loop {steps.longest:.2f} s"
            # The server serves on.
            assert (await client.get("/health")).json()["status"] == "ok"


async def test_a_large_valid_body_still_runs(dense_model: Path) -> None:
    # 200k token ids (1.2 MB): parsed on a worker thread, then detokenized.
    body = _ids_body("tokens", 200_000)
    with trio.fail_after(HANG):
        async with served(dense_model) as (_engine, url), httpx.AsyncClient(base_url=url) as client:
            r = await client.post(
                "/detokenize",
                content=body,
                headers={"Content-Type": "application/json"},
                timeout=HANG,
            )
            assert r.status_code == 200
            assert isinstance(r.json()["prompt"], str)
