"""Shared helpers of the bench scripts.

Starting and stopping the servers under test (gezel-trio, which prints a
``gezel-trio listening on URL`` line on stdout once it serves, and
``mlx_lm server``, which is polled on ``/health``), showing a server's log
tail on errors, streaming SSE chat completions, the decode-throughput
aggregate of one concurrent round, load-average reporting and writing a JSON
report. Import it as ``bench._common``: every script puts the repository root
on ``sys.path`` when it is run as ``python bench/X.py``.

Every system measured runs on the same BLAS and the same weights, so a ratio
measures the servers: gezel-trio binds MLX to OpenBLAS when it is imported
(``gezel_trio.blas``), so ``mlx_lm server`` is started through
``PRELOADED_PYTHON`` (which imports that module before mlx) and in-process
``raw`` workers import ``gezel_trio`` first; and gezel-trio, which on the CPU
holds quantized and half-precision weights as float32, is started with
``--keep-quantized`` unless a script asks for its default
(``float32_copy`` gives every system float32 weights instead).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx2 as httpx

HOST = "127.0.0.1"
# `python -c` code that binds MLX to OpenBLAS as gezel-trio does, then runs
# `python -m mlx_lm` with the arguments that follow ...
PRELOADED_MLX_LM = (
    "import gezel_trio.blas, runpy, sys; sys.argv[0] = 'mlx_lm'; "
    "runpy.run_module('mlx_lm', run_name='__main__', alter_sys=True)"
)
# ... or the script named by the first argument, with the rest.
PRELOADED_SCRIPT = (
    "import gezel_trio.blas, runpy, sys; sys.argv = sys.argv[1:]; "
    "runpy.run_path(sys.argv[0], run_name='__main__')"
)
STARTUP_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 20.0
_LISTENING = "gezel-trio listening on "
_T = TypeVar("_T")


# --- throughput metric -------------------------------------------------------


@dataclass
class StreamTiming:
    """One stream (sequence) of one measurement, times in perf_counter seconds."""

    first: float
    last: float
    tokens: int
    server_tps: float | None = None  # gezel's own usage.generation_tps
    tokens_at_first: int | None = None  # usage.output_tokens on the first chunk (gezel)


@dataclass
class Measurement:
    system: str
    streams: int
    tokens_per_stream: int
    tok_s: float
    window_s: float
    spread_s: float
    per_stream_tokens: list[int]
    server_tps: list[float] = field(default_factory=list)
    tokens_at_first: list[int] = field(default_factory=list)

    @property
    def short(self) -> bool:
        """A stream ended before max_tokens (e.g. on EOS)."""
        return any(n != self.tokens_per_stream for n in self.per_stream_tokens)


def aggregate(system: str, max_tokens: int, timings: Sequence[StreamTiming]) -> Measurement:
    """``sum(n_i - 1) / (max_i last_i - min_i first_i)`` over one concurrent round."""
    start = min(t.first for t in timings)
    end = max(t.last for t in timings)
    window = end - start
    counted = sum(t.tokens - 1 for t in timings)
    return Measurement(
        system=system,
        streams=len(timings),
        tokens_per_stream=max_tokens,
        tok_s=counted / window if window > 0 else float("nan"),
        window_s=window,
        spread_s=max(t.first for t in timings) - start,
        per_stream_tokens=[t.tokens for t in timings],
        server_tps=[t.server_tps for t in timings if t.server_tps is not None],
        tokens_at_first=[t.tokens_at_first for t in timings if t.tokens_at_first is not None],
    )


# --- servers -----------------------------------------------------------------


@dataclass
class Server:
    """A started server; ``exit_code`` (None: it had to be killed) and
    ``stop_s`` are filled in when it has been stopped."""

    system: str
    url: str
    log: Path
    proc: subprocess.Popen[Any]
    exit_code: int | None = None
    stop_s: float = 0.0


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


def tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


@contextlib.contextmanager
def log_on_error(name: str, log: Path, *, full_path: bool = False) -> Iterator[None]:
    """On an error while a server is up, show its log tail (the log may be
    deleted with the run's temporary directory); the log is named by its file
    name, or by its whole path with ``full_path``."""
    try:
        yield
    except Exception:
        shown = log if full_path else log.name
        print(f"--- {name} log tail ({shown}) ---\n{tail(log)}", file=sys.stderr)
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
    label: str = "gezel-trio",
    stop_signal: signal.Signals = signal.SIGINT,
    stop_timeout: float = STOP_TIMEOUT_S,
    full_log_path: bool = False,
    stored_weights: bool = True,
) -> Iterator[Server]:
    """Start ``gezel-trio serve`` with ``flags`` on a free port, its stderr in
    ``log``; yield once it says it is listening (the line it prints on
    stdout); always stop it with ``stop_signal`` (SIGKILL after
    ``stop_timeout``). ``label`` names it in the log tail shown on errors.
    ``stored_weights``: ``--keep-quantized``, the weights the other systems
    load (see the module docstring)."""
    cmd = [
        sys.executable, "-m", "gezel_trio", "serve",
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
        box.append(Server("gezel", line.split(_LISTENING, 1)[1].strip(), log, proc))
        with log_on_error(label, log, full_path=full_log_path):
            yield box[0]


@contextlib.contextmanager
def mlx_server(
    model_dir: Path,
    log: Path,
    flags: Sequence[str],
    *,
    stop_timeout: float = STOP_TIMEOUT_S,
    full_log_path: bool = False,
    cache_stats: bool = False,
) -> Iterator[Server]:
    """Start ``mlx_lm server`` with ``flags`` on a free port, its output in
    ``log``, on gezel-trio's BLAS; yield once ``/health`` answers (bounded
    polling); always stop it (SIGINT, then SIGKILL after ``stop_timeout``).
    ``cache_stats`` starts it through ``bench/_mlx_lm_server.py``, which logs
    its prompt cache's bytes."""
    port = free_port()
    launcher = (
        ["-c", PRELOADED_SCRIPT, str(Path(__file__).with_name("_mlx_lm_server.py"))]
        if cache_stats
        else ["-c", PRELOADED_MLX_LM, "server"]
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
        with log_on_error("mlx_lm.server", log, full_path=full_log_path):
            yield box[0]


def prepare_default_model() -> Path:
    """The model ``gezel-trio serve`` serves by default (SmolLM2, fetched and
    converted on first use)."""
    proc = subprocess.run(
        [sys.executable, "-m", "gezel_trio", "prepare-model"],
        capture_output=True,
        text=True,
        check=True,
    )
    return Path(proc.stdout.strip().splitlines()[-1])


_FLOAT32_COPY = """
import json, shutil, sys
from pathlib import Path
import gezel_trio
import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.utils import load
from gezel_trio.mlx_loading import hold_float32
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


def float32_copy(model_dir: Path, root: Path) -> Path:
    """``model_dir`` with float32 weights, in ``root`` (reused when there):
    what gezel-trio computes with on the CPU, for every system to load."""
    dest = root / f"{model_dir.name}-float32"
    if not (dest / "model.safetensors").is_file():
        dest.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-c", _FLOAT32_COPY, str(model_dir), str(dest)], check=True)
    return dest


def build_default_model() -> Path:
    """The bench dense demo model (built on first use)."""
    proc = subprocess.run(
        [sys.executable, "-m", "gezel_trio", "demo-model", "--kind", "dense", "--size", "bench"],
        capture_output=True,
        text=True,
        check=True,
    )
    return Path(proc.stdout.strip().splitlines()[-1])


# --- requests ----------------------------------------------------------------


def sse_chunks(
    client: httpx.Client, url: str, body: dict[str, Any]
) -> Iterator[tuple[float, dict[str, Any]]]:
    """POST a streaming chat completion; yield ``(perf_counter time, chunk)``
    for each SSE data chunk up to ``[DONE]``; raise on an HTTP or stream error."""
    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            resp.read()
            raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:500]}")
        for line in resp.iter_lines():
            if not line.startswith("data:"):
                continue  # blank separators and ': keep-alive' comments
            data = line[5:].strip()
            if data == "[DONE]":
                break
            now = time.perf_counter()
            obj: dict[str, Any] = json.loads(data)
            if "error" in obj:
                raise RuntimeError(f"stream error: {obj['error']}")
            yield now, obj


def released_together(n: int, one: Callable[[threading.Barrier], _T], what: str) -> list[_T]:
    """Run ``one(barrier)`` in ``n`` threads that release their requests
    together at ``barrier``; their results, or a RuntimeError naming ``what``
    if one of them failed (the barrier is aborted so the others do not wait)."""
    barrier = threading.Barrier(n)
    results: list[tuple[_T] | BaseException | None] = [None] * n

    def worker(i: int) -> None:
        try:
            results[i] = (one(barrier),)
        except Exception as exc:  # reported below, in the caller's thread
            barrier.abort()
            results[i] = exc

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    got: list[_T] = []
    for r in results:
        if not isinstance(r, tuple):
            raise RuntimeError(f"{what}: a stream failed: {r!r}")
        got.append(r[0])
    return got


# --- reporting ---------------------------------------------------------------


def loadavg() -> tuple[float, float, float]:
    """The 1, 5 and 15 minute load averages."""
    return os.getloadavg()


def fmt_load(load: Sequence[float], sep: str = " ") -> str:
    return sep.join(f"{x:.2f}" for x in load)


def print_load_1min(before: float, after: float) -> None:
    """The report lines on the 1-minute load average around a run."""
    print(f"1-min load average: {before:.2f} before, {after:.2f} after (this run keeps")
    print("  about 1 core busy; much more than that means something else shared the CPUs)")


def write_json(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
