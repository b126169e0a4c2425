"""The scenarios: one module each, each defining ``SCENARIO``.

A module added here is a scenario, with no list to edit: ``load`` finds every
module of this package. Importing a scenario module must stay cheap (no MLX,
no model): ``--list`` and the tests import them all.
"""

from __future__ import annotations

import importlib
import pkgutil

from bench._scenario import Scenario

# The order of a bare `python -m bench` (and of --list): cheap ones first; any
# other module follows in name order.
_ORDER = (
    "decode",
    "cache_blocks",
    "host_cache",
    "toolcall_parsing",
    "grammar",
    "scheduler",
    "agent",
    "vision",
    "fuzz",
    "soak",
)


def load() -> dict[str, Scenario]:
    """Every scenario, by name, in run order."""
    found: dict[str, Scenario] = {}
    for info in pkgutil.iter_modules(__path__):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        scenario = getattr(module, "SCENARIO", None)
        if not isinstance(scenario, Scenario):
            raise TypeError(f"{module.__name__} defines no SCENARIO")
        if scenario.name != info.name:
            raise ValueError(f"{module.__name__}: SCENARIO is named {scenario.name!r}")
        found[scenario.name] = scenario
    rank = {name: i for i, name in enumerate(_ORDER)}
    return dict(sorted(found.items(), key=lambda kv: (rank.get(kv[0], len(rank)), kv[0])))
