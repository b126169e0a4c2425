"""The add-ons a flag attaches where an engine is composed (``server``, and
the package facade's ``open_engine`` and ``run_engine``). The host loop
knows only their contracts (``host.block_events``); an add-on's libraries
are an extra, imported here only when its flag is given.
"""

from __future__ import annotations

from functools import partial

from .core.config import EngineConfig
from .core.errors import GezelError
from .host.block_events import BlockEventsFactory
from .host.loop import HostRunner, in_thread

__all__ = ["MissingExtra", "host_runner", "kv_events_publisher"]


class MissingExtra(GezelError):
    """A flag asks for an add-on whose libraries (an extra) are not installed."""


def kv_events_publisher(config: EngineConfig) -> BlockEventsFactory | None:
    """The KV-event publisher ``--kv-events`` asks for (``host.kv_events``),
    made on the host thread; ``None`` without the flag. Its libraries
    (pyzmq, msgspec, cbor2) are the ``kv-events`` extra, imported only here:
    an engine without the flag loads none of them. Raises ``MissingExtra``
    when they are not installed."""
    endpoint = config.kv_events.endpoint
    if endpoint is None:
        return None
    try:
        from .host.kv_events import KvEvents
    except ImportError as exc:
        raise MissingExtra(
            f"--kv-events needs the kv-events extra: pip install 'gezel-trio[kv-events]' ({exc})"
        ) from exc
    replay, topic = config.kv_events.replay, config.kv_events.topic
    return lambda block_size: KvEvents(endpoint, block_size=block_size, replay=replay, topic=topic)


def host_runner(config: EngineConfig) -> HostRunner:
    """The host loop on its thread (``in_thread``) with the add-ons
    ``config`` asks for attached; raises ``MissingExtra`` as above."""
    blocks = kv_events_publisher(config)
    return in_thread if blocks is None else partial(in_thread, blocks=blocks)
