"""gezel-trio: an OpenAI-compatible MLX inference sidecar on Trio.

The public API for Trio programs (no HTTP involved)::

    async with open_engine(EngineConfig(model=path)) as engine:
        prompt = (await engine.render_chat([{"role": "user", "content": "hi"}])).tokens
        with engine.submit_nowait(GenerationRequest(prompt, max_tokens=32)) as handle:
            async for event in handle:
                match event:
                    case Delta(text=text): print(text, end="")
                    case Finished(reason=reason): ...

Cancelling the scope around the ``with`` block withdraws the request.

Importing the package binds MLX to OpenBLAS on Linux (see ``gezel_trio.blas``),
so import it before anything imports ``mlx``.
"""

from .mlx import blas

blas.preload()  # before any of our modules (or yours) imports mlx

from .core.config import EngineConfig
from .core.errors import (
    EngineClosed,
    EngineFailure,
    GezelError,
    InvalidRequest,
    ModelLoadError,
    QueueFull,
    RequestFailed,
    SlowConsumer,
)
from .core.events import (
    Delta,
    Event,
    Failed,
    Finished,
    Parked,
    Progress,
    Queued,
    Resumed,
    TokenLogprob,
    Usage,
)
from .core.model import ModelInfo
from .core.request import CacheRequest, GenerationRequest, Priority, SamplingParams
from .engine import (
    ChatEvent,
    ChatFinished,
    ChatGroupHandle,
    ChatHandle,
    ChatLogprobs,
    ChatRequest,
    Engine,
    EngineState,
    GroupHandle,
    PreparedChat,
    RequestHandle,
    open_engine,
    run_engine,
)
from .shaping.shaper import ReasoningDelta, TextDelta, ToolCallDelta, ToolCallDone

__all__ = [
    "CacheRequest",
    "ChatEvent",
    "ChatFinished",
    "ChatGroupHandle",
    "ChatHandle",
    "ChatLogprobs",
    "ChatRequest",
    "Delta",
    "Engine",
    "EngineClosed",
    "EngineConfig",
    "EngineFailure",
    "EngineState",
    "Event",
    "Failed",
    "Finished",
    "GenerationRequest",
    "GezelError",
    "GroupHandle",
    "InvalidRequest",
    "ModelInfo",
    "ModelLoadError",
    "Parked",
    "PreparedChat",
    "Priority",
    "Progress",
    "QueueFull",
    "Queued",
    "ReasoningDelta",
    "RequestFailed",
    "RequestHandle",
    "Resumed",
    "SamplingParams",
    "SlowConsumer",
    "TextDelta",
    "TokenLogprob",
    "ToolCallDelta",
    "ToolCallDone",
    "Usage",
    "open_engine",
    "run_engine",
]
