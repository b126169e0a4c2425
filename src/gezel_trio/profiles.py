"""Profiles: named sets of ``serve`` flag defaults.

A profile changes only defaults: every setting it touches keeps its own
flag, and a flag given on the command line wins over the profile. The
profile in force is printed at start (stderr) and shown in ``--help``.

``standard`` is gezel-trio's own behaviour. ``seed`` is the seed sidecar's
(``gezel_mlx_server.py``) wherever ours differs and the seed's client, the
gezel app's MLX provider, depends on it; a seed launch (the installed
``gezel_mlx_server.py``, or ``gezel-trio`` with no subcommand) selects it by
itself. docs/migrating-from-the-seed.md lists each entry with its reason,
and each seed behaviour the profile deliberately does not follow.
"""

from __future__ import annotations

__all__ = ["PROFILES", "SEED", "SEED_DEFAULTS", "STANDARD"]

STANDARD = "standard"
SEED = "seed"

# Flag destination -> the value that flag would parse to. One entry per
# seed behaviour, each with the reason the seed's client needs it.
SEED_DEFAULTS: dict[str, object] = {
    # The seed's prefill chunk. The client passes --prefill-step-size only
    # when its user overrides it and otherwise relies on this default.
    "prefill_step_size": 2048,
    # The client's cache adapter reads /v1/cache/stats only as an array
    # (Array.isArray) of the seed's entries; an object is 0 sessions to it.
    "cache_stats_format": "array",
    # The seed sampled greedily when a request named no temperature, and
    # the client sends one only where a catalog model's tuning declares it.
    "default_temperature": 0.0,
    # The seed's memory policy: buffer cache 1/16 of what is wired (256 MB-4 GB), the ceiling wired.
    "mlx_memory_policy": "bounded",
    # The seed sent <think>...</think> inside content; its client reads only content and splits it.
    "reasoning_format": "none",
    # The seed left past tool calls out of Hermes/Qwen prompts: its suite 8/11 with, 5/11 without.
    "drop_past_tool_calls": "on",
    # The seed stopped at </tool_call> for models declaring a tool_call_parser (~450 calls a turn).
    "stop_at_tool_call_end": "on",
    # The seed always ran its parent-death watchdog: the app never passes a flag for it.
    "exit_with_parent": "on",
    # The client SIGKILLs 3 s after SIGTERM: dirty entries go to disk as they are saved.
    "write_behind": "on",
}

PROFILES: dict[str, dict[str, object]] = {STANDARD: {}, SEED: SEED_DEFAULTS}
