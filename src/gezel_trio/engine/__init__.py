"""The engine's Trio side: the task that owns the model and its host loop,
the requests it serves, and the chat-level API every caller uses.

Three parts, a module each: ``Preparer`` (``_prepare``: rendering, images,
grammars on worker threads, then the pure checks of ``core.prepare``),
``HostLink`` (``_link``: the scheduler, every request's channel and the
once-per-step exchange with the host loop) and ``Engine`` (``_engine``: the
facade - prepare, submit, chat, warm, health, close). ``RequestHandle`` is
the one handle of a submitted request (``n >= 1`` sequences of one prompt);
``ChatHandle`` is the same at the level of shaped chat events.
"""

from ..core.prepare import ChatRequest, PreparedChat, roster_fingerprint
from ..host.exchange import Evicted
from ..host.prompt_cache import CacheView
from ._chat import (
    ChatChoice,
    ChatEvent,
    ChatFinished,
    ChatHandle,
    ChatLogprobs,
    combined_usage,
)
from ._engine import BackendFactory, Engine, open_engine, run_engine
from ._handle import RequestHandle
from ._link import (
    WAITING_EVERY,
    Admitted,
    CacheWarmed,
    EngineState,
    Health,
    Note,
    RequestNote,
    Seeded,
)
from ._metrics import EngineMetrics, Snapshot
from ._warm import Warmed

__all__ = [
    "WAITING_EVERY",
    "Admitted",
    "BackendFactory",
    "CacheView",
    "CacheWarmed",
    "ChatChoice",
    "ChatEvent",
    "ChatFinished",
    "ChatHandle",
    "ChatLogprobs",
    "ChatRequest",
    "Engine",
    "EngineMetrics",
    "EngineState",
    "Evicted",
    "Health",
    "Note",
    "PreparedChat",
    "RequestHandle",
    "RequestNote",
    "Seeded",
    "Snapshot",
    "Warmed",
    "combined_usage",
    "open_engine",
    "roster_fingerprint",
    "run_engine",
]
