"""In-process measurements (the raw ``BatchGenerator``, grammar masks, KV
blocks) run in a child process.

The child exits before any server starts, so it never shares the CPU with
one, and the runner's own process never imports MLX. The child imports
``gezel_trio`` first, so MLX binds to the same OpenBLAS as the servers
(``gezel_trio.tuning.blas``). The measured function is a generator of JSON-able
dicts, named ``module:function``; each dict travels as one line of the
child's stdout.

Run as ``python -m bench._worker MODULE:FUNCTION KWARGS_JSON`` (by ``run``).

``Session`` keeps such a child alive between measurements, so they can be
interleaved with a server's (``bench decode``): its function is also given
``requests``, an iterator of the JSON requests ``Session.ask`` writes to the
child's stdin, and yields one dict per request. Waiting for a request, the
child is idle and takes no CPU from what is measured meanwhile.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import tempfile
from collections.abc import Iterator
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


class Session:
    """``target(requests=..., **kwargs)`` in a child process that stays up:
    ``ask`` sends one request and returns the dict it yielded for it. A
    context manager; leaving it ends the child (its stdin closed)."""

    def __init__(self, target: str, **kwargs: Any) -> None:
        self._target = target
        # Its stderr goes to a file: a pipe nobody reads until the end could fill.
        self._err = tempfile.TemporaryFile("w+")  # noqa: SIM115  # closed by __exit__
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "bench._worker", target, json.dumps(kwargs), "--session"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._err,
            text=True,
            cwd=_ROOT,
        )

    def ask(self, request: dict[str, Any]) -> dict[str, Any]:
        proc = self._proc
        assert proc.stdin is not None
        assert proc.stdout is not None
        proc.stdin.write(json.dumps(request) + "\n")
        proc.stdin.flush()
        for line in proc.stdout:
            if line.startswith("{"):
                row: dict[str, Any] = json.loads(line)
                return row
        code = proc.wait()
        self._err.seek(0)
        raise RuntimeError(f"{self._target} ended ({code}):\n{self._err.read()[-4000:]}")

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        proc = self._proc
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
        self._err.close()


def _requests() -> Iterator[dict[str, Any]]:
    for line in sys.stdin:
        if line.strip():
            yield json.loads(line)


def main() -> None:
    import gezel_trio  # noqa: F401  # before mlx: the servers' OpenBLAS (see the docstring)

    target, kwargs = sys.argv[1], json.loads(sys.argv[2])
    if sys.argv[3:] == ["--session"]:
        kwargs["requests"] = _requests()
    module, _, function = target.partition(":")
    for row in getattr(importlib.import_module(module), function)(**kwargs):
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
