"""The engine's Trio side: the task that owns the model and its host
thread, the requests it serves, and the chat-level API every caller uses.

``Engine`` (``open_engine``, ``run_engine``) queues requests and exchanges
orders and events with the host thread once per step; ``RequestHandle`` is
one submitted request; ``ChatRequest`` / ``ChatHandle`` are the same at the
level of messages and shaped events (``Engine.chat``); ``EngineMetrics`` is
an engine's Prometheus registry.
"""

from ._chat import (
    ChatEvent,
    ChatFinished,
    ChatGroupHandle,
    ChatHandle,
    ChatLogprobs,
    ChatRequest,
    PreparedChat,
    combined_usage,
    roster_fingerprint,
)
from ._engine import (
    Engine,
    EngineState,
    GroupHandle,
    Health,
    RequestHandle,
    RequestNote,
    open_engine,
    run_engine,
)
from ._metrics import EngineMetrics, Snapshot

__all__ = [
    "ChatEvent",
    "ChatFinished",
    "ChatGroupHandle",
    "ChatHandle",
    "ChatLogprobs",
    "ChatRequest",
    "Engine",
    "EngineMetrics",
    "EngineState",
    "GroupHandle",
    "Health",
    "PreparedChat",
    "RequestHandle",
    "RequestNote",
    "Snapshot",
    "combined_usage",
    "open_engine",
    "roster_fingerprint",
    "run_engine",
]
