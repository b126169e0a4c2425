"""In-process measurements (the raw ``BatchGenerator``, grammar masks, KV
blocks) run in a child process.

The child exits before any server starts, so it never shares the CPU with
one, and the runner's own process never imports MLX. The child imports
``gezel_trio`` first, so MLX binds to the same OpenBLAS as the servers
(``gezel_trio.mlx.blas``). The measured function is a generator of JSON-able
dicts, named ``module:function``; each dict travels as one line of the
child's stdout.

Run as ``python -m bench._worker MODULE:FUNCTION KWARGS_JSON`` (by ``run``).
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parent.parent


def run(target: str, **kwargs: Any) -> list[dict[str, Any]]:
    """Run ``target(**kwargs)`` in a child process; the dicts it yielded."""
    proc = subprocess.run(
        [sys.executable, "-m", "bench._worker", target, json.dumps(kwargs)],
        capture_output=True,
        text=True,
        check=False,
        cwd=_ROOT,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{target} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def main() -> None:
    import gezel_trio  # noqa: F401  # before mlx: the servers' OpenBLAS (see the docstring)

    target, kwargs = sys.argv[1], json.loads(sys.argv[2])
    module, _, function = target.partition(":")
    for row in getattr(importlib.import_module(module), function)(**kwargs):
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
