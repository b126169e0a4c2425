"""What a process loads. ``--kv-events`` is an add-on the server attaches:
its libraries (pyzmq, msgspec, cbor2: the ``kv-events`` extra) are
imported only when the flag is given, and a server asked for it without
them says which extra to install. The testing module and its demo-model
builders load no MLX until a model is built.

Each case runs in a fresh interpreter, whose ``sys.modules`` is then that
start's alone.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ADD_ON_MODULES = ("cbor2", "msgspec", "zmq")

# Starts the server as a library (``serve``) on the model in argv[1], with
# argv[2:] as its --kv-events address when given, and prints which of the
# add-on's modules were loaded once it listened (on stderr: the server's
# own lines go to stdout from their writer task).
_START = """
import sys
import trio
from gezel_trio.core.config import EngineConfig
from gezel_trio.server import ServerConfig, serve

async def main():
    engine = EngineConfig.from_flags(model=sys.argv[1], kv_events=(sys.argv[2:] or [None])[0])
    async with trio.open_nursery() as nursery:
        await nursery.start(serve, ServerConfig(engine=engine, port=0))
        loaded = sorted(m for m in {modules!r} if m in sys.modules)
        print("loaded:", loaded, file=sys.stderr)
        nursery.cancel_scope.cancel()

trio.run(main)
"""

# The same through the package facade, the other place an engine is composed.
_FACADE = """
import sys
import trio
from gezel_trio import EngineConfig, open_engine

async def main():
    config = EngineConfig.from_flags(model=sys.argv[1], kv_events=(sys.argv[2:] or [None])[0])
    async with open_engine(config):
        loaded = sorted(m for m in {modules!r} if m in sys.modules)
        print("loaded:", loaded, file=sys.stderr)

trio.run(main)
"""

# The command with the add-on's modules not importable, as where the extra
# is not installed.
_WITHOUT_EXTRA = """
import sys
from importlib.abc import MetaPathFinder

class NotInstalled(MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {modules!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None

sys.meta_path.insert(0, NotInstalled())
from gezel_trio.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _run(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", script.format(modules=ADD_ON_MODULES), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("script", [_START, _FACADE], ids=["serve", "open_engine"])
@pytest.mark.parametrize(
    ("flag", "loaded"),
    [((), []), (("tcp://127.0.0.1:*",), list(ADD_ON_MODULES))],
    ids=["without-the-flag", "with-the-flag"],
)
def test_the_kv_event_libraries_load_only_with_the_flag(
    dense_model: Path, script: str, flag: tuple[str, ...], loaded: list[str]
) -> None:
    out = _run(script, str(dense_model), *flag)
    assert out.returncode == 0, out.stderr
    assert f"loaded: {loaded!r}" in out.stderr.splitlines()


def test_the_flag_without_the_extra_is_one_line_naming_it(dense_model: Path) -> None:
    out = _run(
        _WITHOUT_EXTRA,
        "serve",
        "--model",
        str(dense_model),
        "--port",
        "0",
        "--kv-events",
        "tcp://127.0.0.1:*",
    )
    assert out.returncode == 2, out.stderr
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("gezel-trio: --kv-events needs the kv-events extra"), lines
    assert "gezel-trio[kv-events]" in lines[0]


def test_the_extra_declares_the_libraries_and_the_tests_install_it() -> None:
    import tomllib

    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text("utf-8"))
    project = pyproject["project"]
    extras = project["optional-dependencies"]

    def names(requirements: list[str]) -> set[str]:
        return {r.split(">")[0].split("=")[0].split("[")[0].strip() for r in requirements}

    assert names(extras["kv-events"]) == {"pyzmq", "msgspec", "cbor2"}
    assert not names(project["dependencies"]) & {"pyzmq", "msgspec", "cbor2"}
    assert "gezel-trio[kv-events]" in extras["test"]


def test_the_testing_module_and_its_demo_models_import_no_mlx() -> None:
    script = (
        "import sys, gezel_trio.testing, gezel_trio.testing.demo_models\n"
        "print(sorted(m for m in ('mlx', 'mlx_lm', 'mlx_vlm') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["[]"]
