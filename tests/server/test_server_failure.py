"""When the engine itself stops working, the process says so and exits.

The server runs in a subprocess over the scripted backend (pure Python, so
it runs on the real host thread), made to fail: a request in flight gets
the failure, ``/health`` answers 503 with the reason, and the process exits
non-zero within seconds - never a hang, never a silent death. Also here:
``--exit-with-parent``'s polling path (macOS has no parent-death signal),
run on Linux, and the 500 envelope for a bug in a route.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx2 as httpx
import pytest

from gezel_trio import EngineConfig, open_engine
from gezel_trio.http.app import HttpSettings, create_app
from tests.support.process import orphan_exits
from tests.support.seed import LEAF, TAGGED

pytestmark = pytest.mark.slow

SCRIPT = """
import sys
from gezel_trio.core.config import EngineConfig
from gezel_trio.server import ServerConfig, main_serve
from gezel_trio.testing import ScriptedBackend

kind = sys.argv[1]
backend = ScriptedBackend(crash_at=4) if kind == "crash" else ScriptedBackend(fail_at=[1, 2, 3])
config = ServerConfig(engine=EngineConfig.from_flags(max_step_failures=3), port=0, dead_linger=2.0)
sys.exit(main_serve(config, backend_factory=lambda _: backend))
"""


def _start(kind: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, kind],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("gezel-trio listening on "):
            return proc, line.split()[-1]
    proc.kill()
    raise AssertionError(f"the server exited with {proc.wait()} before listening")


BODY = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 40}


@pytest.mark.parametrize("kind", ["crash", "steps"])
def test_a_failed_engine_answers_503_with_the_reason_then_exits_non_zero(kind: str) -> None:
    proc, url = _start(kind)
    try:
        with httpx.Client(base_url=url, timeout=30) as client:
            for _ in range(3 if kind == "steps" else 1):
                r = client.post("/v1/chat/completions", json=BODY)
                assert r.status_code == 500
                assert r.json()["error"]["code"] == "engine_failure"
            health = client.get("/health")
            assert health.status_code == 503
            reason = health.json()["reasons"][0]
            assert ("host thread died" if kind == "crash" else "consecutive") in reason
            started = time.monotonic()
        assert proc.wait(timeout=30) == 1
        assert time.monotonic() - started < 15, "the process lingered"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        assert proc.stdout is not None
        assert proc.stderr is not None
        stdout = proc.stdout.read().splitlines()
        stderr = proc.stderr.read()
        proc.stdout.close()
        proc.stderr.close()
    assert "EngineFailure" in stderr or "engine" in stderr
    # The seed's supervisor reads a bare leaf line as the engine's death:
    # the death prints one, a failed step the engine survived is tagged.
    bare = [i for i, line in enumerate(stdout) if LEAF.match(line)]
    tagged = [i for i, line in enumerate(stdout) if TAGGED.match(line)]
    assert bare, stdout
    assert LEAF.match(stdout[-1])
    if kind == "steps":
        assert any(line.startswith("[batch] a model step failed") for line in stdout)
        assert max(tagged) < min(bare)


PARENT = """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], stdout=subprocess.PIPE,
                         text=True)
for line in child.stdout:
    if line.startswith("gezel-trio listening on "):
        print(child.pid, flush=True)
        break
sys.stdin.read()  # until killed
"""

POLLED_CHILD = """
import os, sys
from pathlib import Path
from gezel_trio.core.config import EngineConfig
from gezel_trio.server import ServerConfig, main_serve
config = ServerConfig(engine=EngineConfig.from_flags(model=Path(sys.argv[1])), port=0,
                      watch_parent=os.getppid())
sys.exit(main_serve(config))
"""


def test_exit_with_parent_polling_drains_when_the_parent_dies(dense_model: Path) -> None:
    """The macOS path (poll ``getppid``), exercised on Linux."""
    parent = [sys.executable, "-c", PARENT, POLLED_CHILD, str(dense_model)]
    assert orphan_exits(parent, 60), "the server outlived its parent"


async def test_a_bug_in_a_route_is_a_500_envelope(dense_model: Path) -> None:
    async with open_engine(EngineConfig(model=dense_model)) as engine:
        app = create_app(engine, HttpSettings())

        @app.route("/boom")
        async def boom() -> str:
            raise RuntimeError("a bug")

        r = await app.test_client().get("/boom")
        assert r.status_code == 500
        assert r.content_type == "application/json"
        body = await r.get_json()
        assert body["error"]["message"] == "internal error: RuntimeError"
