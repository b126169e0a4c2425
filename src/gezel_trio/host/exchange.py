"""What the host thread and the engine's Trio side say to each other.

Once per engine step the host thread hands the Trio side a ``StepReport``
(what the step produced) and gets ``Orders`` back (what to remove, admit,
run and step next). Cache commands travel in the orders and their typed
results in the next report. ``EngineLink`` is the Trio side as the host
loop sees it; ``Observer`` is told of named moments (``Point``) with the
world stopped there, which is how ``gezel_trio.testing`` takes breakpoints.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

import attrs

from ..core.errors import EngineFailure
from ..core.events import Event
from ..core.figures import BackendFigures
from ..core.model import ModelInfo
from ..core.request import GenerationRequest, Priority

if TYPE_CHECKING:
    from ..core.backend import ConstraintCompiler, ImagePreparer, PromptRenderer
    from .prompt_cache import CacheDelta, PromptCache

__all__ = [
    "CacheEvict",
    "CacheFlush",
    "CacheInspect",
    "CommandFailed",
    "EngineLink",
    "Evicted",
    "HostCommand",
    "Inspected",
    "Observer",
    "Orders",
    "Point",
    "StepReport",
]

R = TypeVar("R", covariant=True)


class HostCommand(Protocol, Generic[R]):
    """Work on the prompt cache, run on the host thread between two steps;
    ``run`` returns the command's typed result."""

    def run(self, cache: PromptCache) -> R: ...


@attrs.frozen
class Evicted:
    """What ``CacheEvict`` dropped: the name was in memory, on disk."""

    memory: bool
    disk: bool


@attrs.frozen
class Inspected:
    """The entry a name points at (``tokens``, the tool ``roster`` it was
    built with; both ``None`` when there is none) and whether a running
    request pins it."""

    tokens: int | None
    roster: str | None
    pinned: bool


@attrs.frozen
class CacheEvict:
    cache_id: str

    def run(self, cache: PromptCache) -> Evicted:
        memory, disk = cache.evict(self.cache_id)
        return Evicted(memory, disk)


@attrs.frozen
class CacheFlush:
    """Write dirty entries to disk; the result is how many were written."""

    def run(self, cache: PromptCache) -> int:
        return cache.flush()


@attrs.frozen
class CacheInspect:
    cache_id: str

    def run(self, cache: PromptCache) -> Inspected:
        found = cache.inspect(self.cache_id)
        pinned = cache.pinned(self.cache_id)
        if found is None:
            return Inspected(None, None, pinned)
        return Inspected(found[0], found[1], pinned)


@attrs.frozen
class CommandFailed:
    """A host command raised; the Trio side re-raises it as ``RequestFailed``."""

    error: str


@attrs.frozen
class StepReport:
    """What one step produced, per request id; ``ended`` lists sequences that
    left the backend by themselves (their last event is in ``events``).
    ``cache_view`` is set when the prompt cache changed: what changed since
    the last one (every one must reach the Trio side's ``CacheBook``); ``replies`` answer
    the previous orders' commands. ``stepped`` says a model step ran and
    ``step_failure`` why it failed, if it did; ``persistence`` names the
    disk cache's current trouble (``None``: fine, or no disk cache).
    ``seeded`` tells, per request admitted in this step, how many prompt
    tokens its cache seed reused and where the seed came from
    (``SeedInfo.source``: ``memory:session``, ``disk:prefix``, ``fresh``...)."""

    events: tuple[tuple[int, Event], ...] = ()
    ended: tuple[int, ...] = ()
    replies: tuple[tuple[int, Any], ...] = ()
    cache_view: CacheDelta | None = None
    memory: int | None = None
    stepped: bool = False
    step_failure: str | None = None
    persistence: str | None = None
    seeded: tuple[tuple[int, int, str], ...] = ()
    # What the backend measured (for /metrics and /health), read after the step.
    figures: BackendFigures | None = None

    @property
    def has_news(self) -> bool:
        """Something the Trio side must hear before the host may sleep."""
        return bool(
            self.events
            or self.ended
            or self.replies
            or self.cache_view is not None
            or self.step_failure
            or self.seeded
        )


@attrs.frozen
class Orders:
    """Before the next step: remove, run commands, admit, then step ``lane``
    (``None``: nothing to step). ``parked``/``resumed`` are for observers."""

    stop: bool = False
    remove: tuple[int, ...] = ()
    admit: tuple[tuple[int, GenerationRequest], ...] = ()
    commands: tuple[tuple[int, HostCommand[Any]], ...] = ()
    lane: Priority | None = None
    parked: tuple[int, ...] = ()
    resumed: tuple[int, ...] = ()


class EngineLink(Protocol):
    """The Trio side, as the host loop sees it; every method runs in the
    Trio thread (the threaded host reaches them through its Trio token).

    ``wants_answer`` is the one thing the host thread reads itself, without
    the Trio thread: ``True`` when something arrived since the last orders
    (a request, a withdrawal, a command, the close) that the next orders
    must answer before the host steps on."""

    @property
    def wants_answer(self) -> bool: ...
    def ready(
        self,
        info: ModelInfo,
        renderer: PromptRenderer,
        compiler: ConstraintCompiler | None,
        images: ImagePreparer | None = None,
    ) -> None: ...
    def exchange(self, report: StepReport) -> Orders: ...
    async def wait_for_work(self) -> None: ...
    def die(self, error: EngineFailure) -> None: ...


@attrs.frozen
class Point:
    """A named moment in the engine's life, for observers (``gezel_trio.testing``):
    ``admitted``, ``prefill`` (chunk ``index`` of a request done), ``decode``
    (token ``index`` emitted), ``snapshot`` (a snapshot captured), ``finished``,
    ``removed`` (a withdrawn request left the batch), ``parked``, ``resumed``,
    ``shutdown`` (the engine began to stop)."""

    kind: str
    rid: int | None = None
    index: int = 0


class Observer(Protocol):
    async def at(self, point: Point) -> None:
        """Called with the world stopped at ``point``; the engine resumes when
        it returns."""
        ...
