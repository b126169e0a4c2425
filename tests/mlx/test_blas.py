"""MLX on OpenBLAS: each check runs in a fresh interpreter, since
the binding is decided once per process, when the first library that needs
``cblas_sgemm`` is loaded."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    not (sys.platform.startswith("linux") and platform.machine() == "x86_64"),
    reason="the OpenBLAS preload is for the mlx[cpu] wheel on Linux x86-64",
)

# A 512x512 float32 matmul after a warm-up; prints the GFLOP/s of the
# fastest of 5 (the slower ones are the other tests' share of the cores).
_MATMUL = """
import time
import mlx.core as mx
a = mx.random.normal((512, 512)); b = mx.random.normal((512, 512)); mx.eval(a, b, a @ b)
best = float("inf")
for _ in range(5):
    t = time.perf_counter(); mx.eval(a @ b); best = min(best, time.perf_counter() - t)
print(2 * 512**3 / best / 1e9)
"""


def _python(
    code: str, *, preload: bool = True, warnings_as_errors: bool = False, threads: str | None = None
) -> str:
    unset = ("GEZEL_TRIO_PRELOAD_BLAS", "OPENBLAS_NUM_THREADS")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    if not preload:
        env["GEZEL_TRIO_PRELOAD_BLAS"] = "0"
    if threads is not None:
        env["OPENBLAS_NUM_THREADS"] = threads
    flags = ["-W", "error::RuntimeWarning"] if warnings_as_errors else []
    out = subprocess.run(
        [sys.executable, *flags, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    return out.stdout + out.stderr


def test_importing_gezel_trio_first_binds_mlx_to_openblas_on_the_usable_cores() -> None:
    code = (
        "import gezel_trio.tuning.blas as b, mlx.core, ctypes; print(b.describe()); "
        "print('threads', ctypes.CDLL(None).openblas_get_num_threads())"
    )
    said = _python(code)
    cores = len(os.sched_getaffinity(0))
    threads = "1 thread" if cores == 1 else f"{cores} threads (the usable cores)"
    assert f"OpenBLAS (ngsolve-openblas, preloaded, {threads})" in said
    assert "cblas_sgemm from libopenblas" in said
    assert f"threads {cores}" in said  # what OpenBLAS itself says


def test_the_thread_count_is_the_environments_when_it_names_one() -> None:
    code = (
        "import gezel_trio.tuning.blas as b, mlx.core, ctypes; print(b.describe()); "
        "print('threads', ctypes.CDLL(None).openblas_get_num_threads())"
    )
    said = _python(code, threads="1")
    assert "OpenBLAS (ngsolve-openblas, preloaded, 1 threads (OPENBLAS_NUM_THREADS))" in said
    assert "threads 1" in said


def test_the_preload_makes_mlx_matmuls_many_times_faster() -> None:
    # One OpenBLAS thread, as the reference BLAS has: two threads' call is
    # as slow as the one whose core another test's process took.
    fast = float(_python("import gezel_trio\n" + _MATMUL, threads="1").split()[-1])
    slow = float(_python("import gezel_trio\n" + _MATMUL, preload=False).split()[-1])
    # About 25x measured on 2 shared cores; 3x leaves room for a busy machine.
    assert fast > 3 * slow, (fast, slow)


def test_the_environment_switch_turns_the_preload_off() -> None:
    said = _python("import gezel_trio.tuning.blas as b; print(b.describe())", preload=False)
    assert "preload off: GEZEL_TRIO_PRELOAD_BLAS=0" in said
    assert "libopenblas" not in said


def test_an_embedder_that_imported_mlx_first_is_warned() -> None:
    said = _python("import mlx.core\nimport gezel_trio", warnings_as_errors=True)
    assert "RuntimeWarning: mlx was imported before gezel_trio" in said
    assert "import gezel_trio first" in said


def test_the_platform_tuning_off_decided_before_mlx_loads_keeps_mlxs_own_blas() -> None:
    # As the CLI decides for --platform-tuning off, before anything imports mlx.
    code = (
        "import gezel_trio.tuning.blas as b; b.preload(False); import mlx.core; print(b.describe())"
    )
    said = _python(code)
    assert "MLX's own (platform tuning off)" in said
    assert "libopenblas" not in said
