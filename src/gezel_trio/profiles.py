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
    # The seed always ran its parent-death watchdog: the app never passes a flag for it.
    "exit_with_parent": "on",
    # The client SIGKILLs 3 s after SIGTERM: dirty entries go to disk as they are saved.
    "write_behind": "on",
}

PROFILES: dict[str, dict[str, object]] = {STANDARD: {}, SEED: SEED_DEFAULTS}
