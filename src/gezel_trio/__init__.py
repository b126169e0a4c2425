"""gezel-trio: an OpenAI-compatible MLX inference sidecar on Trio.

The public API for Trio programs (no HTTP involved)::

    async with open_engine(EngineConfig(model=path)) as engine:
        with await engine.chat([{"role": "user", "content": "hi"}], max_tokens=32) as chat:
            async for choice, event in chat:
                match event:
                    case TextDelta(text=text): print(text, end="")
                    case ChatFinished(reason=reason): ...

Cancelling the scope around the ``with`` block withdraws the request.
``open_engine`` and ``run_engine`` here run the MLX backend
(``gezel_trio.mlx.mlx_backend``); ``gezel_trio.engine`` has the same two
with the backend as a required argument.

Importing the package has MLX bound to OpenBLAS on Linux when ``mlx`` is
first imported (see ``gezel_trio.tuning.blas``), so import it before
anything imports ``mlx``.
"""

from .tuning import blas

blas.preload_before_mlx()  # binds MLX's BLAS before anything (ours or yours) imports mlx

from contextlib import AbstractAsyncContextManager

import trio

from . import engine as _engine
from .addons import host_runner
from .core.config import EngineConfig
from .core.errors import (
    EngineClosed,
    EngineFailure,
    GezelError,
    InvalidRequest,
    ModelLoadError,
    QueueFull,
    QueueTimeout,
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
    Started,
    TokenLogprob,
    Usage,
)
from .core.model import ModelInfo
from .core.request import CacheRequest, GenerationRequest, Priority, SamplingParams
from .engine import (
    BackendFactory,
    ChatChoice,
    ChatEvent,
    ChatFinished,
    ChatHandle,
    ChatLogprobs,
    ChatRequest,
    Engine,
    EngineState,
    PreparedChat,
    RequestHandle,
    Warmed,
)
from .host.loop import HostRunner
from .mlx import mlx_backend
from .shaping.shaper import ReasoningDelta, TextDelta, ToolCallDelta, ToolCallDone


def open_engine(
    config: EngineConfig,
    backend_factory: BackendFactory = mlx_backend,
    *,
    host: HostRunner | None = None,
) -> AbstractAsyncContextManager[Engine]:
    """``gezel_trio.engine.open_engine`` over the MLX backend by default,
    its host loop on a thread with the add-ons ``config`` asks for
    (``addons``; ``MissingExtra`` when one's extra is not installed)."""
    return _engine.open_engine(config, backend_factory, host=host or host_runner(config))


async def run_engine(  # noqa: ASYNC128 - the engine's run_engine calls started()
    config: EngineConfig,
    backend_factory: BackendFactory = mlx_backend,
    *,
    task_status: trio.TaskStatus[Engine] = trio.TASK_STATUS_IGNORED,
) -> None:
    """``gezel_trio.engine.run_engine`` over the MLX backend by default,
    with the add-ons ``config`` asks for (``addons``)."""
    await _engine.run_engine(
        config, backend_factory, host=host_runner(config), task_status=task_status
    )


__all__ = [
    "BackendFactory",
    "CacheRequest",
    "ChatChoice",
    "ChatEvent",
    "ChatFinished",
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
    "InvalidRequest",
    "ModelInfo",
    "ModelLoadError",
    "Parked",
    "PreparedChat",
    "Priority",
    "Progress",
    "QueueFull",
    "QueueTimeout",
    "Queued",
    "ReasoningDelta",
    "RequestFailed",
    "RequestHandle",
    "Resumed",
    "SamplingParams",
    "SlowConsumer",
    "Started",
    "TextDelta",
    "TokenLogprob",
    "ToolCallDelta",
    "ToolCallDone",
    "Usage",
    "Warmed",
    "mlx_backend",
    "open_engine",
    "run_engine",
]
