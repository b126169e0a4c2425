"""The systems under test and the models they load: the one place that
starts and stops a server.

``gezel_server`` runs ``gezel-trio serve`` (ready when it prints its
``gezel-trio listening on URL`` line on stdout); ``mlx_server`` runs
``mlx_lm server`` (ready when ``/health`` answers; bounded polling, since it
announces nothing). Both always stop their process, with a graceful signal
first and SIGKILL after a timeout, and show the server's log tail when
something fails while it is up.

Every system measured runs on the same BLAS and the same weights, so a ratio
measures the servers: gezel-trio binds MLX to OpenBLAS when it is imported
(``gezel_trio.tuning.blas``), so ``mlx_lm server`` is started through a ``python
-c`` stub that imports that module before mlx, and in-process workers
(``bench._worker``) import ``gezel_trio`` first; and gezel-trio, which on the
CPU holds quantized and half-precision weights as float32, is started with
``--keep-quantized`` unless a scenario asks for its default
(``float32_copy`` gives every system float32 weights instead).
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import httpx2 as httpx

HOST = "127.0.0.1"
STARTUP_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 20.0
_LISTENING = "gezel-trio listening on "
# `python -c` code that binds MLX to OpenBLAS as gezel-trio does, then runs
# `python -m mlx_lm` with the arguments that follow ...
_PRELOADED_MLX_LM = (
    "import gezel_trio.tuning.blas, runpy, sys; sys.argv[0] = 'mlx_lm'; "
    "runpy.run_module('mlx_lm', run_name='__main__', alter_sys=True)"
)
# ... or the script named by the first argument, with the rest.
_PRELOADED_SCRIPT = (
    "import gezel_trio.tuning.blas, runpy, sys; sys.argv = sys.argv[1:]; "
    "runpy.run_path(sys.argv[0], run_name='__main__')"
)
# mlx_lm.server as the decode and scheduler scenarios run it, besides
# --model/--host/--port and the concurrency flags (mlx_decode_flags).
_MLX_DECODE_FLAGS = (
    "--temp", "0.0",
    "--chat-template-args", '{"enable_thinking": false}',
    "--log-level", "WARNING",
)  # fmt: skip


@attrs.define
class Server:
    """A started server; ``exit_code`` (None: it had to be killed) and
    ``stop_s`` are filled in when it has been stopped."""

    system: str
    url: str
    log: Path
    proc: subprocess.Popen[Any]
    exit_code: int | None = None
    stop_s: float = 0.0


def mlx_decode_flags(concurrency: int) -> list[str]:
    """``mlx_lm server`` flags that match ``gezel-trio --max-concurrency N``."""
    return [
        "--decode-concurrency", str(concurrency),
        "--prompt-concurrency", str(concurrency),
        *_MLX_DECODE_FLAGS,
    ]  # fmt: skip


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        port: int = s.getsockname()[1]
        return port


def stop(
    proc: subprocess.Popen[Any],
    sig: signal.Signals = signal.SIGINT,
    timeout: float = STOP_TIMEOUT_S,
) -> int | None:
    """``sig`` (a graceful drain), then SIGKILL if it hangs; the exit code
    (None: it had to be killed)."""
    if proc.poll() is not None:
        return proc.returncode
    proc.send_signal(sig)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return None


def cpu_seconds(pid: int, thread: int | None = None) -> float:
    """User plus system CPU seconds process ``pid`` has used, all its threads
    or only ``thread`` (a thread id; the main thread's is ``pid``) (Linux
    ``/proc``; 0 where unknown)."""
    path = f"/proc/{pid}/stat" if thread is None else f"/proc/{pid}/task/{thread}/stat"
    try:
        stat = Path(path).read_text()
    except OSError:
        return 0.0
    # The fields after the command name, which may hold spaces: utime, stime
    # are the 14th and 15th of the line.
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_kb(pid: int) -> int:
    """A process's resident memory in kB (Linux ``/proc``; 0 where unknown)."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return 0
    for line in lines:
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def _fill_pipe(proc: subprocess.Popen[Any]) -> None:
    """Shrink ``proc``'s stdout pipe to one page and fill it, so its very next
    write finds the pipe full (Linux: the write end, opened again through
    /proc, takes filler lines nobody reads)."""
    import fcntl

    assert proc.stdout is not None
    fcntl.fcntl(proc.stdout.fileno(), 1031, 4096)  # F_SETPIPE_SZ
    fd = os.open(f"/proc/{proc.pid}/fd/1", os.O_WRONLY | os.O_NONBLOCK)
    try:
        while True:
            os.write(fd, b"filler: the supervisor stopped reading\n")
    except BlockingIOError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def _log_on_error(name: str, log: Path) -> Iterator[None]:
    """On an error while a server is up, show its log tail (the log may be
    deleted with the run's temporary directory)."""
    try:
        yield
    except Exception:
        print(f"--- {name} log tail ({log}) ---\n{tail(log)}", file=sys.stderr)
        raise


@contextlib.contextmanager
def _stopping(
    proc: subprocess.Popen[Any], box: list[Server], sig: signal.Signals, timeout: float
) -> Iterator[None]:
    """Always stop ``proc``; record the exit code and stop time on the server
    in ``box`` if one was yielded."""
    try:
        yield
    finally:
        t0 = time.monotonic()
        code = stop(proc, sig, timeout)
        for server in box:
            server.exit_code, server.stop_s = code, time.monotonic() - t0


@contextlib.contextmanager
def gezel_server(
    model_dir: Path,
    log: Path,
    flags: Sequence[str],
    *,
    label: str = "gezel",
    stop_signal: signal.Signals = signal.SIGINT,
    stop_timeout: float = STOP_TIMEOUT_S,
    stored_weights: bool = True,
    read_stdout: bool = True,
    stalls: Path | None = None,
) -> Iterator[Server]:
    """Start ``gezel-trio serve`` with ``flags`` on a free port, its stderr in
    ``log``; yield once it says it is listening; always stop it with
    ``stop_signal`` (SIGKILL after ``stop_timeout``). ``label`` is the
    server's ``system`` name. ``stored_weights``: ``--keep-quantized``, the
    weights the other systems load (see the module docstring).
    ``read_stdout=False``: once listening, its stdout is never read again (a
    supervisor that stopped reading: the pipe fills and stays full).
    ``stalls``: run it through ``bench/_gezel_stalls.py``, which records the
    Trio thread's stalls in that file."""
    launcher = (
        [str(Path(__file__).with_name("_gezel_stalls.py")), str(stalls)]
        if stalls is not None
        else ["-m", "gezel_trio"]
    )
    cmd = [
        sys.executable, *launcher, "serve",
        "--model", str(model_dir),
        "--host", HOST,
        "--port", "0",
        *(["--keep-quantized"] if stored_weights else []),
        *flags,
    ]  # fmt: skip
    with log.open("w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
            if not read_stdout and _LISTENING in line:
                _fill_pipe(proc)
                return  # the pipe stays open, unread
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    box: list[Server] = []
    with _stopping(proc, box, stop_signal, stop_timeout):
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"gezel-trio not ready after {STARTUP_TIMEOUT_S}s")
            try:
                line = lines.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                raise RuntimeError(f"gezel-trio exited early:\n{tail(log)}")
            if _LISTENING in line:
                break
        box.append(Server(label, line.split(_LISTENING, 1)[1].strip(), log, proc))
        with _log_on_error(label, log):
            yield box[0]


@contextlib.contextmanager
def mlx_server(
    model_dir: Path,
    log: Path,
    flags: Sequence[str],
    *,
    stop_timeout: float = STOP_TIMEOUT_S,
    cache_stats: bool = False,
) -> Iterator[Server]:
    """Start ``mlx_lm server`` with ``flags`` on a free port, its output in
    ``log``, on gezel-trio's BLAS; yield once ``/health`` answers (bounded
    polling); always stop it (SIGINT, then SIGKILL after ``stop_timeout``).
    ``cache_stats`` starts it through ``bench/_mlx_lm_server.py``, which logs
    its prompt cache's bytes."""
    port = free_port()
    launcher = (
        ["-c", _PRELOADED_SCRIPT, str(Path(__file__).with_name("_mlx_lm_server.py"))]
        if cache_stats
        else ["-c", _PRELOADED_MLX_LM, "server"]
    )
    cmd = [
        sys.executable, *launcher,
        "--model", str(model_dir),
        "--host", HOST,
        "--port", str(port),
        *flags,
    ]  # fmt: skip
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://{HOST}:{port}"
    box: list[Server] = []
    with _stopping(proc, box, signal.SIGINT, stop_timeout):
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        with httpx.Client(timeout=2.0) as client:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"mlx_lm.server exited early:\n{tail(log)}")
                with contextlib.suppress(httpx.TransportError):
                    status = client.get(f"{url}/health").status_code
                    if status == 200:
                        break
                    # 503: its generation thread (which loads the model) died.
                    raise RuntimeError(f"mlx_lm.server unhealthy ({status}):\n{tail(log)}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"mlx_lm.server not ready after {STARTUP_TIMEOUT_S}s")
                time.sleep(0.2)  # polling interval, not a readiness guess
        box.append(Server("mlx_lm.server", url, log, proc))
        with _log_on_error("mlx_lm.server", log):
            yield box[0]


@contextlib.contextmanager
def mlx_vlm_server(
    model_dir: Path, log: Path, flags: Sequence[str], *, stop_timeout: float = STOP_TIMEOUT_S
) -> Iterator[Server]:
    """Start ``mlx_vlm.server`` (through ``bench/_mlx_vlm_server.py``, on
    gezel-trio's BLAS) with ``flags`` on a free port, preloading ``model_dir``;
    yield once ``/health`` answers (bounded polling); always stop it."""
    port = free_port()
    cmd = [
        sys.executable, "-c", _PRELOADED_SCRIPT,
        str(Path(__file__).with_name("_mlx_vlm_server.py")),
        "--model", str(model_dir),
        "--host", HOST,
        "--port", str(port),
        *flags,
    ]  # fmt: skip
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://{HOST}:{port}"
    box: list[Server] = []
    with _stopping(proc, box, signal.SIGINT, stop_timeout):
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        with httpx.Client(timeout=2.0) as client:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"mlx_vlm.server exited early:\n{tail(log)}")
                with contextlib.suppress(httpx.TransportError):
                    if client.get(f"{url}/health").status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"mlx_vlm.server not ready after {STARTUP_TIMEOUT_S}s")
                time.sleep(0.2)  # polling interval, not a readiness guess
        box.append(Server("mlx_vlm.server", url, log, proc))
        with _log_on_error("mlx_vlm.server", log):
            yield box[0]


# --- models ------------------------------------------------------------------


def _gezel_cli(*args: str) -> Path:
    """Run ``python -m gezel_trio ARGS`` and return the directory it prints last."""
    proc = subprocess.run(
        [sys.executable, "-m", "gezel_trio", *args], capture_output=True, text=True, check=True
    )
    return Path(proc.stdout.strip().splitlines()[-1])


def demo_model(kind: str, size: str) -> Path:
    """A random-weight demo model (``gezel-trio demo-model``; built on first use)."""
    return _gezel_cli("demo-model", "--kind", kind, "--size", size)


def default_model() -> Path:
    """The model ``gezel-trio serve`` serves by default (SmolLM2, fetched and
    converted on first use)."""
    return _gezel_cli("prepare-model")


_FLOAT32_COPY = """
import json, shutil, sys
from pathlib import Path
import gezel_trio
import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.utils import load
from gezel_trio.mlx.loading import hold_float32
src, dest = Path(sys.argv[1]), Path(sys.argv[2])
model, _ = load(str(src))
hold_float32(model)
mx.save_safetensors(str(dest / "model.safetensors"), dict(tree_flatten(model.parameters())))
config = json.loads((src / "config.json").read_text())
config.pop("quantization", None)
config.pop("quantization_config", None)
config["torch_dtype"] = "float32"
(dest / "config.json").write_text(json.dumps(config, indent=2))
for f in src.iterdir():
    if f.suffix in (".json", ".jinja", ".txt") and not (dest / f.name).exists():
        shutil.copy(f, dest / f.name)
"""


def default_model_float32() -> Path:
    """The default model's float32 copy, beside the converted weights."""
    quantized = default_model()
    return float32_copy(quantized, quantized.parents[2] / "bench-float32")


def float32_model(model_dir: Path | None) -> Path:
    """``model_dir``'s float32 copy beside it, or the default model's."""
    if model_dir is None:
        return default_model_float32()
    return float32_copy(model_dir, model_dir.parent / "bench-float32")


def float32_copy(model_dir: Path, root: Path) -> Path:
    """``model_dir`` with float32 weights, in ``root`` (reused when there):
    what gezel-trio computes with on the CPU, for every system to load."""
    dest = root / f"{model_dir.name}-float32"
    if not (dest / "model.safetensors").is_file():
        dest.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-c", _FLOAT32_COPY, str(model_dir), str(dest)], check=True)
    return dest
