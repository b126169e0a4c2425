"""Which BLAS MLX's CPU kernels run on, decided before anything imports MLX.

The ``mlx[cpu]`` wheel for Linux links Netlib's reference BLAS
(``mlx_cpu.libs/libblas-*.so.3.*``): a 1024x1024 float32 matmul runs at
about 5 GFLOP/s there against 140 with OpenBLAS on the same 2 cores. A
library loaded into the global symbol scope *before* ``libmlx.so`` wins the
dynamic linker's lookup of ``cblas_sgemm`` and the LAPACK routines, so
preloading OpenBLAS with ``RTLD_GLOBAL`` makes MLX use it.

The OpenBLAS comes from the ``ngsolve-openblas`` wheel (a dependency on Linux
x86-64 only): plain, unprefixed symbols and a ``DYNAMIC_ARCH`` build that
picks its kernels for the CPU at run time. ``cmeel-openblas`` 0.3.31 was
tried first; it is built for Skylake-X only and dies with an illegal
instruction on an AVX2 CPU. ``scipy-openblas32`` prefixes its symbols
(``scipy_cblas_sgemm``), so MLX cannot bind to it.

OpenBLAS needs ``libgfortran.so.5``. When the system has none, the copy that
MLX's own wheel bundles is used: auditwheel renamed its soname
(``libgfortran-<hash>.so.5.0.0``), so the dynamic linker would not match it
to OpenBLAS's ``NEEDED`` entry; a copy with the soname restored is loaded
from an anonymous memory file (``memfd_create``), so nothing is written to
disk.

``preload()`` decides once per process, just before the first import of
``mlx``: importing ``gezel_trio`` sets that up (``preload_before_mlx``), so
a program that imports ``gezel_trio`` and then ``mlx`` gets OpenBLAS, and
the CLI, which decides first with ``preload(tuned=...)`` from
``--platform-tuning``, is still in time. It does nothing:

* off Linux (macOS MLX uses Accelerate and Metal);
* with ``tuned=False`` (``--platform-tuning off``);
* when ``GEZEL_TRIO_PRELOAD_BLAS=0`` (the environment's switch);
* when MLX's wheel does not ship the reference BLAS (a build against
  another BLAS needs no help);
* when ``mlx`` is already imported: too late to change the binding, so it
  warns the embedding program to import ``gezel_trio`` first.

Only ``ctypes``, ``os`` and ``importlib.metadata`` are used: importing this
module must never import MLX. ``describe()`` says, for the startup log line,
which library provides ``cblas_sgemm`` to libraries loaded from then on.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import importlib.abc
import importlib.machinery
import importlib.metadata
import json
import logging
import os
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Final

__all__ = [
    "ENV_SWITCH",
    "describe",
    "preload",
    "preload_before_mlx",
    "set_threads",
    "thread_count",
]

ENV_SWITCH: Final = "GEZEL_TRIO_PRELOAD_BLAS"
_OPENBLAS_DIST: Final = "ngsolve-openblas"
_GFORTRAN_SONAME: Final = "libgfortran.so.5"
_OFF: Final = "MLX's own (platform tuning off)"

log = logging.getLogger("gezel_trio.tuning")

# What preload() did, for describe(); set once, at import time.
_outcome: list[str] = []
# The OpenBLAS preload() bound and the thread count it chose, when this
# process may change that count (``tuning.step_threads``): not when
# ``OPENBLAS_NUM_THREADS`` chose it.
_control: list[tuple[ctypes.CDLL, int]] = []


def _wheel_file(dist: str, parent: str, prefix: str) -> Path | None:
    """A shared library that the installed distribution ``dist`` ships in ``parent``."""
    try:
        files = importlib.metadata.files(dist) or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in files:
        if f.parent.name == parent and f.name.startswith(prefix) and ".so" in f.name:
            path = Path(str(f.locate()))
            if path.is_file():
                return path
    return None


def preload(tuned: bool = True) -> str:
    """Bind MLX to OpenBLAS when that helps, is still possible and
    ``tuned``; says what was done. The first call decides for the process
    (a library once loaded stays): a later one that asks for the plain
    path gets a warning in the log when OpenBLAS is bound already."""
    if not _outcome:
        _outcome.append(_decide(tuned))
    elif not tuned and _outcome[0].startswith("OpenBLAS"):
        log.warning("platform tuning off, but MLX was bound to OpenBLAS when it first loaded")
    return _outcome[0]


class _BeforeMlx(importlib.abc.MetaPathFinder):
    """Runs ``preload()`` when ``mlx`` is about to be imported, then leaves
    ``sys.meta_path``; it finds nothing itself."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname == "mlx" or fullname.startswith("mlx."):
            with contextlib.suppress(ValueError):
                sys.meta_path.remove(self)
            preload()
        return None


def preload_before_mlx() -> None:
    """Have ``preload()`` run just before the first import of ``mlx``, by
    whoever imports it; now, when ``mlx`` is imported already (too late:
    it warns). ``gezel_trio/__init__.py`` calls it first thing."""
    if "mlx.core" in sys.modules:
        preload()
    elif not _outcome:
        sys.meta_path.insert(0, _BeforeMlx())


def _decide(tuned: bool) -> str:
    if not sys.platform.startswith("linux"):
        return "MLX's own (not Linux)"
    if not tuned:
        return _OFF
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "no", "off"):
        return f"MLX's reference BLAS (preload off: {ENV_SWITCH}=0)"
    if _wheel_file("mlx-cpu", "mlx_cpu.libs", "libblas") is None:
        return "MLX's own (its wheel ships no reference BLAS)"
    if "mlx.core" in sys.modules:
        warnings.warn(
            "mlx was imported before gezel_trio, so MLX stays bound to the reference "
            "BLAS its wheel ships (about 30x slower matmuls on CPU); import gezel_trio first",
            RuntimeWarning,
            stacklevel=5,  # _decide, preload, preload_before_mlx, the package, its importer
        )
        return "MLX's reference BLAS (mlx was imported before gezel_trio)"
    library = _wheel_file(_OPENBLAS_DIST, "ngsolve_openblas", "libopenblas")
    if library is None:
        return f"MLX's reference BLAS ({_OPENBLAS_DIST} is not installed for this platform)"
    try:
        _load_gfortran()
        openblas = ctypes.CDLL(str(library), mode=os.RTLD_GLOBAL)
    except OSError as exc:
        return f"MLX's reference BLAS (OpenBLAS did not load: {exc})"
    threads = _threads(openblas)
    return f"OpenBLAS ({_OPENBLAS_DIST}, preloaded, {threads})"


def _threads(openblas: ctypes.CDLL) -> str:
    """As many OpenBLAS threads as this process may use cores, unless the
    environment says otherwise.

    Measured on 2 cores (2026-12-03, float32 weights, through HTTP, paired
    rounds): SmolLM2-135M decodes at 10.0-11.3 tokens/s on one stream with
    2 threads against 7.9-8.2 with 1, and 48.6 against 35.3 at 8 streams;
    the dense bench demo model was within the noise either way, a
    1,947-token prefill 11% faster, and ``/health`` during it no slower (p99
    16.4 against 16.3 ms). OpenBLAS's workers spin while they wait, so
    processes that share the cores with each other (the test suite's
    servers) want one thread each: ``OPENBLAS_NUM_THREADS`` (read by OpenBLAS
    itself) chooses the count.
    """
    if "OPENBLAS_NUM_THREADS" in os.environ:
        return f"{os.environ['OPENBLAS_NUM_THREADS']} threads (OPENBLAS_NUM_THREADS)"
    cores = len(os.sched_getaffinity(0))
    # Ranks of one mlx.launch group on this machine share its cores.
    sharing = _ranks_here()
    threads = max(1, cores // sharing)
    try:
        openblas.openblas_set_num_threads(threads)
    except AttributeError:
        return "its default threads"
    _control.append((openblas, threads))
    why = "the usable cores" if sharing == 1 else f"the usable cores over {sharing} local ranks"
    return "1 thread" if threads == 1 else f"{threads} threads ({why})"


def thread_count() -> int | None:
    """The OpenBLAS thread count ``preload`` chose, when this process may
    change it per call (``set_threads``); ``None`` otherwise (no OpenBLAS
    preloaded, or ``OPENBLAS_NUM_THREADS`` set)."""
    return _control[0][1] if _control else None


def set_threads(n: int) -> None:
    """Run OpenBLAS's next calls on ``n`` threads (at most the count
    ``preload`` chose; its pool keeps that many). Call it between BLAS
    calls, from the thread that makes them."""
    if not _control:
        raise RuntimeError("OpenBLAS's thread count is not this process's to change")
    openblas, most = _control[0]
    openblas.openblas_set_num_threads(max(1, min(n, most)))


def _ranks_here() -> int:
    """How many ranks of this process's ``mlx.launch`` ring group run on
    its machine (its hostfile lists each rank's address; ``MLX_RANK`` is
    this one's): 1 outside a group or where the file says nothing."""
    path, rank = os.environ.get("MLX_HOSTFILE"), os.environ.get("MLX_RANK")
    if not path or rank is None:
        return 1
    try:
        with open(path) as f:
            nodes = json.load(f)
        hosts = [[str(a).rpartition(":")[0] for a in node] for node in nodes]
        mine = set(hosts[int(rank)])
    except (OSError, ValueError, IndexError, TypeError):
        return 1
    return max(1, sum(1 for node in hosts if mine & set(node)))


def _load_gfortran() -> None:
    """Make ``libgfortran.so.5`` resolvable for OpenBLAS (see the module docstring)."""
    try:
        ctypes.CDLL(_GFORTRAN_SONAME, mode=os.RTLD_GLOBAL)
        return
    except OSError:
        pass
    bundled = _wheel_file("mlx-cpu", "mlx_cpu.libs", "libgfortran")
    if bundled is None:
        raise OSError(f"no {_GFORTRAN_SONAME} on the system or in MLX's wheel")
    # Its own dependency (libquadmath-<hash>) keeps the renamed soname that
    # libgfortran's NEEDED entry asks for: loading it by path satisfies that.
    quadmath = _wheel_file("mlx-cpu", "mlx_cpu.libs", "libquadmath")
    if quadmath is not None:
        ctypes.CDLL(str(quadmath), mode=os.RTLD_GLOBAL)
    old = bundled.name.encode() + b"\0"
    data = bundled.read_bytes()
    if data.count(old) != 1:
        raise OSError(f"cannot find the soname of {bundled.name} to restore")
    new = _GFORTRAN_SONAME.encode().ljust(len(old), b"\0")
    fd = os.memfd_create(_GFORTRAN_SONAME)
    try:
        os.write(fd, data.replace(old, new))
        # The library stays mapped after the descriptor is closed.
        ctypes.CDLL(f"/proc/self/fd/{fd}", mode=os.RTLD_GLOBAL)
    finally:
        os.close(fd)


class _DlInfo(ctypes.Structure):
    _fields_ = (
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    )


def _cblas_provider() -> str | None:
    """The file of the library that now provides ``cblas_sgemm`` globally."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        address = ctypes.cast(ctypes.CDLL(None).cblas_sgemm, ctypes.c_void_p)
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except (AttributeError, OSError):
        return None
    info = _DlInfo()
    if not libc.dladdr(address, ctypes.byref(info)):
        return None
    fname: bytes | None = info.dli_fname
    return os.path.basename(fname.decode(errors="replace")) if fname else None


def describe() -> str:
    """One phrase for the startup log: the decision, and who provides ``cblas_sgemm``."""
    outcome = preload()
    provider = _cblas_provider()
    return f"{outcome}, cblas_sgemm from {provider}" if provider else outcome
