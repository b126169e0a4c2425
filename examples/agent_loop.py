"""A small Trio agent runtime on the embedded engine, no HTTP.

    python examples/agent_loop.py [MODEL_DIR | FILE.gguf]

The agent answers a question with a tool: the model calls a Python function
(forced on the first turn, its choice afterwards), the result goes back as a
``tool`` message, and the final answer streams. Each turn runs under
``trio.move_on_after``: a turn that takes too long is withdrawn, and the
prompt cache keeps what it prefilled, so asking again starts from there.
Meanwhile a summarisation task runs at ``background`` priority in the same
nursery: the engine parks it whenever the agent's interactive turns need the
model, and it resumes where it stopped.

Without an argument it runs on the default model, SmolLM2-135M-Instruct
(fetched once from the package index and converted). Import gezel_trio
before anything imports mlx: on Linux it binds MLX to OpenBLAS.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import trio

from gezel_trio import (
    ChatFinished,
    EngineConfig,
    Failed,
    Parked,
    Resumed,
    SamplingParams,
    TextDelta,
    ToolCallDone,
    open_engine,
)

TURN_SECONDS = 300.0
GREEDY = SamplingParams(temperature=0.0)

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "The city"}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
]


def get_weather(city: str) -> str:
    """The agent's one tool: plain Python, run in the agent's own task."""
    return f"It is 18 degrees Celsius and sunny in {city}."


def run_tool(name: str, arguments: str) -> str:
    try:
        args = json.loads(arguments or "{}")
    except json.JSONDecodeError as exc:
        return f"error: the arguments are not JSON ({exc})"
    if name != "get_weather" or not isinstance(args, dict):
        return f"error: no tool {name!r}"
    return get_weather(str(args.get("city", "")))


async def turn(engine: Any, messages: list[dict[str, Any]], **options: Any) -> dict[str, Any]:
    """One model turn, streamed to stdout; returns the assistant message."""
    with await engine.chat(messages, sampling=GREEDY, **options) as chat:
        async for _, event in chat:
            match event:
                case TextDelta(text=text):
                    print(text, end="", flush=True)
                case ToolCallDone(name=name, arguments=arguments):
                    print(f"[tool call: {name}({arguments})]", flush=True)
                case ChatFinished(reason=reason, usage=usage, message=message):
                    print(
                        f"\n[{reason}: {usage.output_tokens} tokens,"
                        f" {usage.cached_tokens} of {usage.input_tokens} prompt tokens cached]",
                        flush=True,
                    )
                    return message
                case Failed(error=error):
                    raise error
    raise RuntimeError("the chat ended without a result")


async def summarise(engine: Any, notes: list[str], done: trio.Event) -> None:
    """A background task: summarise the conversation so far. Parked while the
    agent's turns run; leaving the ``with`` block (cancellation) withdraws it."""
    text: list[str] = []
    messages = [
        {"role": "system", "content": "Summarise the notes in one short sentence."},
        {"role": "user", "content": "\n".join(notes)},
    ]
    with await engine.chat(messages, priority="background", sampling=GREEDY, max_tokens=24) as chat:
        async for _, event in chat:
            match event:
                case Parked():
                    print("[summary parked for the agent's turn]", flush=True)
                case Resumed():
                    print("[summary resumed]", flush=True)
                case TextDelta(text=piece):
                    text.append(piece)
                case ChatFinished():
                    print(f"[summary: {''.join(text).strip()}]", flush=True)
                case Failed(error=error):
                    print(f"[summary failed: {error}]", flush=True)
    done.set()


async def main(model: Path | None) -> None:
    async with open_engine(EngineConfig(model=model)) as engine, trio.open_nursery() as nursery:
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": "You are a helpful assistant. Use tools for facts."},
            {"role": "user", "content": "What is the weather in Paris?"},
        ]
        notes = ["The user asked about the weather in Paris."]
        summary_done = trio.Event()
        for step in range(3):
            # The first turn must call the tool; later turns may answer.
            choice = "required" if step == 0 else "auto"
            with trio.move_on_after(TURN_SECONDS) as scope:
                message = await turn(
                    engine, messages, tools=TOOLS, tool_choice=choice, max_tokens=64
                )
            if scope.cancelled_caught:
                print("[turn timed out: withdrawn, its prefill kept in the cache]")
                break
            messages.append(message)
            calls = message.get("tool_calls") or []
            if not calls:
                break
            for call in calls:
                result = run_tool(call["function"]["name"], call["function"]["arguments"])
                print(f"[tool result: {result}]", flush=True)
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
                notes.append(f"The tool said: {result}")
            if step == 0:
                nursery.start_soon(summarise, engine, notes, summary_done)
        if messages[-1]["role"] == "tool":
            # The final answer, no more tools: it streams as it is generated.
            with trio.move_on_after(TURN_SECONDS):
                await turn(engine, messages, tools=TOOLS, tool_choice="none", max_tokens=48)
        with trio.move_on_after(TURN_SECONDS):
            await summary_done.wait()
        nursery.cancel_scope.cancel()  # nothing else runs; a late summary is withdrawn


if __name__ == "__main__":
    trio.run(main, Path(sys.argv[1]) if len(sys.argv) > 1 else None)
