"""The seed's client, ported: what the gezel app's MLX provider does to the
server it spawns, in Python, for ``tests/server/test_seed_client.py``.

The client is the gezel monorepo's ``packages/service/src`` (TypeScript):
``providers/mlx/{build-provider,provider,stdout-parser,reasoning-stream,
cache-adapter,tool-call-stripper}.ts``, ``providers/native/supervisor.ts``,
``providers/openai-compatible/sse.ts``, ``cache/controller.ts`` and
``model-profile/{tool-grammar,tuning}.ts``. Each piece below names the file
and function whose *behaviour* it follows: the same command line, the same
regular expressions over the same (prefixed) lines, the same request body,
the same fields read from the stream and from ``/v1/cache/stats``, the same
stop. It is a behaviour port, not a translation: where the client does
something the tests never reach (UI fan-out, salvage of mangled tool
markup, ramble detection), it is left out and said so.

Everything is synchronous and thread-based, as the client is callback-based:
the supervisor's stdout/stderr readers are threads, an HTTP turn is a
blocking ``httpx`` stream. Nothing here sleeps to wait for a state except
where the client itself polls (its ``/health`` readiness probe, every
500 ms), and that wait wakes early when the child exits.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import signal
import subprocess
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx2 as httpx

import gezel_trio

# build-provider.ts `pythonServerPath`: the app spawns the .py file that sits
# in its bundle where the seed's gezel_mlx_server.py was; ours is installed
# inside the package.
SEED_SERVER_SCRIPT = Path(gezel_trio.__file__).parent / "_seed" / "gezel_mlx_server.py"

# ---------------------------------------------------------------------------
# Launch: build-provider.ts `buildMlxProvider` -> `resolveLaunch`


@dataclass(frozen=True)
class Launch:
    """The inputs of build-provider.ts's ``resolveLaunch`` args list."""

    model_dir: Path
    port: int
    cache_budget_mb: int
    persist_dir: Path
    model_fingerprint: str
    max_concurrency: int
    gpu_memory_limit_mb: int
    disk_cache_budget_mb: int = 8192  # `config.mlxDiskCacheBudgetMb ?? 8192`
    prefill_step_size: int | None = None  # only when the user overrides it
    wired_limit_mb: int | None = None  # only when the geometry was readable
    stream_tool_calls: bool = False  # GEZEL_MLX_STREAM_TOOL_CALLS=1
    kv_bits: int = 0  # `config.mlxKvBits ?? 0`


def launch_args(launch: Launch) -> list[str]:
    """build-provider.ts ``resolveLaunch().args``, in its order, flags it adds
    only on a condition added on that condition."""
    args = [
        str(SEED_SERVER_SCRIPT),
        *("--model", str(launch.model_dir)),
        *("--host", "127.0.0.1"),
        *("--port", str(launch.port)),
        *("--cache-budget-mb", str(launch.cache_budget_mb)),
        *("--persist-dir", str(launch.persist_dir)),
        *("--model-fingerprint", launch.model_fingerprint),
        *("--disk-cache-budget-mb", str(launch.disk_cache_budget_mb)),
    ]
    if launch.prefill_step_size:
        args += ["--prefill-step-size", str(launch.prefill_step_size)]
    args += ["--max-concurrency", str(launch.max_concurrency)]
    if launch.stream_tool_calls:
        args += ["--stream-tool-calls"]
    args += ["--gpu-memory-limit-mb", str(max(0, launch.gpu_memory_limit_mb))]
    if launch.wired_limit_mb is not None:
        args += ["--wired-limit-mb", str(max(1, launch.wired_limit_mb))]
    if launch.kv_bits > 0:
        args += ["--kv-bits", str(launch.kv_bits), "--kv-quant-scheme", "uniform"]
    return args


# build-provider.ts `resolveLaunch().env`: the engine must work off-disk.
LAUNCH_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
}


def model_fingerprint(
    model_dir: Path, catalog_id: str = "", catalog_version: str = "", installed_at: str = ""
) -> str:
    """build-provider.ts ``modelFingerprint``: sha256 of ``id::version::
    installedAt::modelDir``, 24 hex digits (the catalog id falls back to the
    model directory)."""
    text = "::".join([catalog_id or str(model_dir), catalog_version, installed_at, str(model_dir)])
    return hashlib.sha256(text.encode()).hexdigest()[:24]


# ---------------------------------------------------------------------------
# stdout-parser.ts


@dataclass(frozen=True)
class Phase:
    """An ``EnginePhaseEvent`` as ``classifyMlxStartupLine`` returns it."""

    phase: str  # starting | prefill | loading_model | ready
    detail: str | None = None
    progress: float | None = None


_PREFILL = re.compile(
    r"^(?:\[[^\]]+\]\s+)?Prefill:\s*(\d+)%[^|]*\|[^|]*\|\s*(\d+)/(\d+)\s*\[[^,\]]*"
    r"(?:,\s*([\d.]+)tok/s)?",
    re.IGNORECASE,
)
_CACHE_HIT = re.compile(r"\[cache\] hit cache_id=\S+ prior_tokens=(\d+)")
_CACHE_WARMED = re.compile(r"\[cache\] warmed cache_id=\S+ tokens=(\d+)")


def _thousands(n: int) -> str:
    return f"{n:,}"  # `toLocaleString('en-US')`


def classify_startup_line(line: str) -> Phase | None:
    """stdout-parser.ts ``classifyMlxStartupLine``: substring tests, in its
    order (the first that matches wins)."""
    if re.search(r"started server process|waiting for application startup", line, re.I):
        return Phase("starting", "Mac AI server starting")
    m = _PREFILL.match(line)
    if m:
        pct, cur, total = int(m[1]), int(m[2]), int(m[3])
        parts = [f"{_thousands(cur)} / {_thousands(total)} tokens"]
        tps = float(m[4]) if m[4] else None
        if tps is not None and tps > 0:
            parts.append(f"{tps:.0f} tok/s" if tps >= 10 else f"{tps:.1f} tok/s")
        return Phase("prefill", " · ".join(parts), max(0.0, min(1.0, pct / 100)))
    if re.search(r"loading model|loading weights|loading tokenizer|fetching", line.lower()):
        return Phase("loading_model", "Loading weights")
    if re.search(r"model loaded|uvicorn running on|application startup complete", line, re.I):
        return Phase("ready")
    m = _CACHE_HIT.search(line)
    if m:
        return Phase("ready", f"Cache hit · reusing {_thousands(int(m[1]))} tokens")
    m = _CACHE_WARMED.search(line)
    if m:
        return Phase("ready", f"Cache warmed · {_thousands(int(m[1]))} tokens ready")
    return None


@dataclass(frozen=True)
class FatalError:
    """An ``MlxFatalError`` (the hint text left out)."""

    category: str
    message: str


_REQUIRES_BACKEND = re.compile(
    r"^(?:\[(?:mlx|mlx_v?lm\.server)\]\s+)?(\S+) requires the (\S+) library but it was not found"
)
_LEAF = re.compile(r"^(?:\[(?:mlx|mlx_v?lm\.server)\]\s+)?([A-Z][A-Za-z]+Error):\s+(.*)$")


def classify_fatal_line(line: str) -> FatalError | None:
    """stdout-parser.ts ``classifyMlxFatalErrorLine``: a leaf exception line
    (``[mlx] ValueError: ...``) or transformers' "requires the X library"."""
    m = _REQUIRES_BACKEND.match(line)
    if m:
        return FatalError(
            "missing-dependency",
            f"ImportError: {m[1]} requires the {m[2]} library but it was not found",
        )
    m = _LEAF.match(line)
    if not m:
        return None
    cls, message = m[1], m[2].strip()
    if not message:
        if cls in ("ImportError", "ModuleNotFoundError"):
            return FatalError("missing-dependency", f"{cls} (no detail emitted)")
        return None
    text = f"{cls}: {message}"
    if cls == "ValueError" and re.search(r"Received \d+ parameters not in model", message, re.I):
        return FatalError("model-arch-mismatch", text)
    if cls == "ValueError" and re.search(r"Missing \d+ parameters?", message, re.I):
        return FatalError("model-arch-unsupported", text)
    if cls in ("ImportError", "ModuleNotFoundError"):
        return FatalError("missing-dependency", text)
    if cls == "MemoryError" or re.search(r"out of memory|mps backend out of memory", message, re.I):
        return FatalError("out-of-memory", text)
    if re.search(r"tokenizer|chat.?template", message, re.I):
        return FatalError("tokenizer-mismatch", text)
    return FatalError("other", text)


# ---------------------------------------------------------------------------
# supervisor.ts `NativeEngineSupervisor` (with the provider's `onRawLine`)

LOG_PREFIX = "[mlx]"
READY_POLL_S = 0.5  # `waitForReady`: one `/health` probe every 500 ms
KILL_AFTER_S = 3.0  # `killGracefully`: SIGKILL 3 s after SIGTERM


class LineSplitter:
    """supervisor.ts ``chunkReader``: a chunk is split on CR, CRLF and LF
    (tqdm repaints with a bare CR); a partial last line waits for the next
    chunk or the exit."""

    def __init__(self, emit: Callable[[str], None]) -> None:
        self._emit = emit
        self._pending = ""

    def feed(self, chunk: str) -> None:
        lines = re.split(r"\r\n?|\n", self._pending + chunk)
        self._pending = lines.pop()
        for line in lines:
            self._emit_line(line)

    def flush(self) -> None:
        if self._pending:
            self._emit_line(self._pending)
        self._pending = ""

    def _emit_line(self, line: str) -> None:
        if line:  # `emitLine`: empty lines are dropped
            self._emit(f"{LOG_PREFIX} {line}")


@dataclass(frozen=True)
class Stopped:
    """How ``Supervisor.stop`` ended: whether SIGKILL was needed, and when."""

    killed: bool
    seconds: float
    returncode: int


def wait_for_ready(
    base_url: str,
    gone: Callable[[], str | None],
    exited: threading.Event,
    timeout: float,
) -> None:
    """supervisor.ts ``waitForReady``: ``GET /health`` every 500 ms until it
    answers 2xx; ``gone`` names a reason to give up (an exit, a fatal line),
    and ``exited`` ends a pause early."""
    deadline = time.monotonic() + timeout
    last_error = "not probed"
    with httpx.Client(timeout=5.0) as probe:
        while time.monotonic() < deadline:
            reason = gone()
            if reason is not None:
                raise RuntimeError(reason)
            try:
                if probe.get(f"{base_url}/health").is_success:
                    return
                last_error = "/health not ok"
            except httpx.TransportError as exc:
                last_error = repr(exc)
            # The client's own 500 ms poll; an exit ends the wait early.
            exited.wait(READY_POLL_S)
    raise RuntimeError(f"did not become ready within {timeout}s: {last_error}")


class Supervisor:
    """supervisor.ts, the parts that touch the child: spawn, every stdout and
    stderr line (prefixed ``[mlx] ``) to ``on_raw_line``, readiness by
    ``GET /health``, stop by SIGTERM then SIGKILL after 3 s."""

    def __init__(
        self,
        python: str,
        launch: Launch,
        on_raw_line: Callable[[str], None],
        *,
        startup_timeout: float = 300.0,  # build-provider.ts `mlxStartupTimeoutMs`
        extra_env: Mapping[str, str] | None = None,
    ) -> None:
        self.launch = launch
        self.base_url = f"http://127.0.0.1:{launch.port}"
        self._python = python
        self._on_raw_line = on_raw_line
        self._startup_timeout = startup_timeout
        self._extra_env = dict(extra_env or {})
        self.proc: subprocess.Popen[bytes] | None = None
        self.lines: list[str] = []
        self._lines_changed = threading.Condition()
        self._readers: list[threading.Thread] = []
        self._aborted: str | None = None
        self._exited = threading.Event()

    # -- spawn and lines

    def start(self) -> None:
        """``startFresh``: spawn, then ``waitForReady``. Raises if the child
        exits or a fatal line aborts the start, or on the startup timeout."""
        env = {**os.environ, **LAUNCH_ENV, **self._extra_env}
        self.proc = subprocess.Popen(
            [self._python, *launch_args(self.launch)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
        )
        self._exited.clear()
        self._readers = [
            threading.Thread(target=self._read, args=(stream,), daemon=True)
            for stream in (self.proc.stdout, self.proc.stderr)
        ]
        for reader in self._readers:
            reader.start()
        threading.Thread(target=self._watch_exit, args=(self.proc,), daemon=True).start()
        self._wait_for_ready()

    def _read(self, stream: Any) -> None:
        splitter = LineSplitter(self._emit_line)
        while chunk := stream.read1(65536):
            splitter.feed(chunk.decode("utf-8", "replace"))
        splitter.flush()

    def _watch_exit(self, proc: subprocess.Popen[bytes]) -> None:
        proc.wait()
        self._exited.set()

    def _emit_line(self, line: str) -> None:
        # Classified before it is recorded, so a test that saw the line also
        # sees what the provider made of it.
        try:
            self._on_raw_line(line)
        except Exception as exc:  # "Never let a bad classifier take down the supervisor."
            line += f" (onRawLine threw: {exc})"
        with self._lines_changed:
            self.lines.append(line)
            self._lines_changed.notify_all()

    def abort_startup(self, reason: str) -> None:
        """``abortStartup``: the provider saw a fatal line."""
        self._aborted = reason

    def _wait_for_ready(self) -> None:
        def gone() -> str | None:
            if self._aborted is not None:
                return self._aborted
            if self._exited.is_set():
                return (
                    f"child exited with {self.returncode()} before becoming ready:\n" + self.text()
                )
            return None

        wait_for_ready(self.base_url, gone, self._exited, self._startup_timeout)

    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def text(self) -> str:
        with self._lines_changed:
            return "\n".join(self.lines)

    def wait_for_line(
        self, match: Callable[[str], object], start: int = 0, timeout: float = 15.0
    ) -> str:
        """The first line from index ``start`` that ``match``es (test helper:
        the client reads lines through callbacks, a test waits on them). The
        lines a test waits for are printed by the time the reply that follows
        them ends; the bound only covers the reader thread's lag."""
        deadline = time.monotonic() + timeout
        with self._lines_changed:
            seen = start
            while True:
                for line in self.lines[seen:]:
                    if match(line):
                        return line
                seen = len(self.lines)
                left = deadline - time.monotonic()
                if left <= 0 or (
                    self._exited.is_set() and not any(r.is_alive() for r in self._readers)
                ):
                    raise AssertionError(
                        f"no such line; the child said:\n{chr(10).join(self.lines)}"
                    )
                self._lines_changed.wait(min(left, 1.0))

    # -- stop

    def stop(self) -> Stopped:
        """``killGracefully``: SIGTERM; SIGKILL if the child is still there
        3 s later; wait for the exit."""
        assert self.proc is not None
        proc = self.proc
        started = time.monotonic()
        if proc.poll() is not None:
            return Stopped(False, 0.0, proc.returncode)
        killed = threading.Event()

        def kill() -> None:
            if proc.poll() is None:
                killed.set()
                proc.kill()

        timer = threading.Timer(KILL_AFTER_S, kill)
        timer.daemon = True
        proc.send_signal(signal.SIGTERM)
        timer.start()
        try:
            returncode = proc.wait()
        finally:
            timer.cancel()
        seconds = time.monotonic() - started
        for reader in self._readers:
            reader.join(timeout=10)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
        return Stopped(killed.is_set(), seconds, returncode)


# ---------------------------------------------------------------------------
# provider.ts `MlxProvider.onStdoutLine` and the session's watchdog hook


@dataclass
class Provider:
    """provider.ts ``MlxProvider``: the stdout classifier's consumer. A fatal
    line marks the engine broken and stops the supervisor; a phase is
    published to every active session (consecutive duplicates of a startup
    phase dropped), which re-arms each session's idle watchdog."""

    supervisor: Supervisor | None = None
    fatal: FatalError | None = None
    published: list[Phase] = field(default_factory=list)
    last_startup_phase: Phase | None = None
    watchdog_resets: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def on_stdout_line(self, line: str) -> None:
        """``onStdoutLine``."""
        fatal = classify_fatal_line(line)
        if fatal is not None:
            self._handle_fatal(fatal)
            return
        phase = classify_startup_line(line)
        if phase is None:
            return
        with self.lock:
            if phase.phase == "starting":
                self.fatal = None
            last = self.last_startup_phase
            if last is not None and (last.phase, last.detail) == (phase.phase, phase.detail):
                return
            self.last_startup_phase = None if phase.phase == "ready" else phase
            self.published.append(phase)
            # `publishEnginePhase` -> `currentTurnIdleReset`: any engine
            # phase is evidence the child is alive, pre-first-byte included.
            self.watchdog_resets += 1

    def _handle_fatal(self, fatal: FatalError) -> None:
        """``handleFatalError``: first seen wins; abort a start in progress
        (stopping the child is the caller's: it would join these readers)."""
        with self.lock:
            if self.fatal is not None:
                return
            self.fatal = fatal
        if self.supervisor is not None:
            self.supervisor.abort_startup(f"[mlx] engine failed to start: {fatal.message}")


# provider.ts `computePreFirstByteBudgetMs`: the pre-first-byte watchdog.
def pre_first_byte_budget_s(approx_prompt_tokens: int) -> float:
    over = max(0, approx_prompt_tokens - 8_000)
    return min(900.0, 300.0 + over / 1000 * 12.0)


# ---------------------------------------------------------------------------
# reasoning-stream.ts

_CLOSE_MARKERS = ("</think>", "</reasoning>", "[/THINK]", "<|end|>")
_OPEN_MARKERS = ("<think>", "<reasoning>", "[think]")
_OPEN = re.compile(r"<think>|<reasoning>|\[THINK\]", re.I)
_CLOSE = re.compile(r"</think>|</reasoning>|\[/THINK\]", re.I)


def template_text_opens_reasoning(template: str) -> bool:
    """``templateTextOpensReasoning``: in the text after the last
    ``add_generation_prompt``, the last reasoning opener is not followed by
    a closer."""
    branch = template.rfind("add_generation_prompt")
    if branch == -1:
        return False
    tail = template[branch:]
    ends = [m.end() for m in _OPEN.finditer(tail)]
    if not ends:
        return False
    return _CLOSE.search(tail[ends[-1] :]) is None


def template_opens_reasoning(model_dir: Path) -> bool:
    """``templateOpensReasoning``: ``chat_template.jinja``, else
    ``tokenizer_config.json``'s ``chat_template`` string, else false. Read
    once per provider build (build-provider.ts ``opensReasoning``)."""
    try:
        template = (model_dir / "chat_template.jinja").read_text("utf-8")
    except OSError:
        try:
            config = json.loads((model_dir / "tokenizer_config.json").read_text("utf-8"))
        except (OSError, ValueError):
            return False
        template = config.get("chat_template")
        if not isinstance(template, str):
            return False
    return template_text_opens_reasoning(template)


@dataclass(frozen=True)
class Split:
    visible: str
    reasoning: str


class StreamingReasoningSplit:
    """``StreamingReasoningSplit``: content deltas in, the app's two live
    channels out. Starts inside reasoning when the template opens it; holds
    back only a tail that could still grow into a marker; an unclosed block
    stays reasoning at the end."""

    def __init__(self, *, opens_in_reasoning: bool, enabled: bool = True) -> None:
        self._enabled = enabled
        self._inside = enabled and opens_in_reasoning
        self._buffer = ""

    def push(self, chunk: str) -> Split:
        if not self._enabled:
            return Split(chunk, "")
        self._buffer += chunk
        return self._drain(final=False)

    def flush(self) -> Split:
        if not self._enabled:
            return Split("", "")
        return self._drain(final=True)

    def _drain(self, *, final: bool) -> Split:
        visible, reasoning = "", ""
        while self._buffer:
            if self._inside:
                close = self._first_close()
                if close is None:
                    break
                index, marker = close
                reasoning += self._buffer[:index]
                self._buffer = self._buffer[index + len(marker) :]
                self._inside = False
                continue
            m = _OPEN.search(self._buffer)
            if m is None:
                break
            visible += self._buffer[: m.start()]
            self._buffer = self._buffer[m.end() :]
            self._inside = True
        if final:
            if self._inside:
                reasoning += self._buffer
            else:
                visible += self._buffer
            self._buffer = ""
            return Split(visible, reasoning)
        safe = len(self._buffer) - self._hold_back()
        if safe > 0:
            released, self._buffer = self._buffer[:safe], self._buffer[safe:]
            if self._inside:
                reasoning += released
            else:
                visible += released
        return Split(visible, reasoning)

    def _first_close(self) -> tuple[int, str] | None:
        lower = self._buffer.lower()
        found = [(lower.find(m.lower()), m) for m in _CLOSE_MARKERS]
        hits = [(i, m) for i, m in found if i != -1]
        return min(hits, key=lambda h: h[0]) if hits else None

    def _hold_back(self) -> int:
        longest = max(len(m) for m in _CLOSE_MARKERS)
        candidates = [m.lower() for m in _CLOSE_MARKERS] if self._inside else list(_OPEN_MARKERS)
        for length in range(min(longest - 1, len(self._buffer)), 0, -1):
            tail = self._buffer[-length:].lower()
            if any(c.startswith(tail) for c in candidates):
                return length
        return 0


# ---------------------------------------------------------------------------
# tool-call-stripper.ts `LeakyToolCallStripper` (Gemma's leaked markers)

_GEMMA_OPENS = ("<|tool_call|>", "<|tool_call>")
_GEMMA_CLOSE = re.compile(r"</?tool_call\|?>")


class LeakyToolCallStripper:
    """Content passes this before the reasoning split: spans between a
    Gemma ``<|tool_call|>`` opener and a close marker are cut out (kept as
    bodies); a tail that could be an opener is held back."""

    def __init__(self) -> None:
        self._buffer = ""
        self._inside = False
        self._body = ""
        self.bodies: list[str] = []

    def push(self, chunk: str) -> str:
        self._buffer += chunk
        return self._drain()

    def flush(self) -> str:
        if self._inside:
            if self._body or self._buffer:
                self.bodies.append((self._body + self._buffer).strip())
            self._buffer, self._body, self._inside = "", "", False
            return ""
        out, self._buffer = self._buffer, ""
        return out

    def _drain(self) -> str:
        emitted = ""
        while self._buffer:
            if self._inside:
                m = _GEMMA_CLOSE.search(self._buffer)
                if m is not None:
                    self.bodies.append((self._body + self._buffer[: m.start()]).strip())
                    self._body, self._buffer, self._inside = "", self._buffer[m.end() :], False
                    continue
                safe = max(0, len(self._buffer) - 13)
                self._body += self._buffer[:safe]
                self._buffer = self._buffer[safe:]
                return emitted
            opens = [(self._buffer.find(v), v) for v in _GEMMA_OPENS]
            hits = [(i, v) for i, v in opens if i >= 0]
            if hits:
                index, variant = min(hits, key=lambda h: h[0])
                emitted += self._buffer[:index]
                self._buffer = self._buffer[index + len(variant) :]
                self._inside = True
                continue
            longest = max(len(v) for v in _GEMMA_OPENS)
            hold = len(self._buffer)
            for i in range(max(0, len(self._buffer) - longest), len(self._buffer)):
                if any(v.startswith(self._buffer[i:]) for v in _GEMMA_OPENS):
                    hold = i
                    break
            emitted += self._buffer[:hold]
            self._buffer = self._buffer[hold:]
            return emitted
        return emitted


# ---------------------------------------------------------------------------
# model-profile/tool-grammar.ts and tuning.ts


def family_tool_grammar_hint(family: str | None) -> dict[str, str] | None:
    """``familyToToolGrammarHint``: the ``tool_grammar`` field per family."""
    if family in ("qwen", "qwq", "nemotron"):
        return {"format": "hermes", "mode": "name-and-params"}
    if family == "gemma":
        return {"format": "gemma", "mode": "name-only"}
    if family == "glm":
        return {"format": "glm", "mode": "name-only"}
    return None


def _template_kwarg(name: str) -> Callable[[dict[str, Any], Any], None]:
    def write(body: dict[str, Any], value: Any) -> None:
        existing = body.get("chat_template_kwargs")
        if isinstance(existing, dict):
            existing[name] = value
        else:
            body["chat_template_kwargs"] = {name: value}

    return write


def _template_kwargs(body: dict[str, Any], value: Any) -> None:
    if isinstance(value, dict):
        for name, kwarg in value.items():
            _template_kwarg(name)(body, kwarg)


def _response_format(body: dict[str, Any], value: Any) -> None:
    if value == "json_object":
        body["response_format"] = {"type": "json_object"}


# tuning.ts `MLX_TUNING_MAP`, keyed by the resolved tuning's dotted path; the
# paths the map drops (`null`) are absent. Order is the map's order.
MLX_TUNING_MAP: dict[str, str | Callable[[dict[str, Any], Any], None]] = {
    "sampling.temperature": "temperature",
    "sampling.topP": "top_p",
    "sampling.topK": "top_k",
    "sampling.minP": "min_p",
    "sampling.maxTokens": "max_tokens",
    "sampling.seed": "seed",
    "sampling.repetitionPenalty": "repetition_penalty",
    "sampling.repetitionContext": "repetition_context_size",
    "reasoning.thinkingBudget": "max_thinking_tokens",
    "reasoning.enableThinking": _template_kwarg("enable_thinking"),
    "reasoning.templateKwargs": _template_kwargs,
    "output.responseFormat": _response_format,
    "toolChoice": "tool_choice",
}


def apply_tuning(body: dict[str, Any], tuning: Mapping[str, Any]) -> None:
    """tuning.ts ``applyTuning`` with ``MLX_TUNING_MAP``: each set path of
    the resolved tuning (``{"sampling": {"maxTokens": 64}, ...}``) written to
    the body as the map says."""
    for path, target in MLX_TUNING_MAP.items():
        value: Any = tuning
        for part in path.split("."):
            value = value.get(part) if isinstance(value, Mapping) else None
        if value is None:
            continue
        if callable(target):
            target(body, value)
        else:
            body[target] = value


@dataclass(frozen=True)
class Profile:
    """The parts of a model profile the request builder reads."""

    family: str | None = None
    mlx_grammar: bool = False  # behavior `tools.mlx-grammar`
    template_fix: str | None = None  # behavior `tools.mlx-template-fix` config
    reasoning_format: str | None = None  # `style.reasoningFormat` ('none' disables the split)


def build_turn_body(
    model: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    tuning: Mapping[str, Any] | None = None,
    profile: Profile = Profile(),
    extras: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """provider.ts ``MlxSession.sendAndWaitInner``'s body for the first
    iteration of a turn: ``model`` is the model directory (build-provider.ts
    ``defaultModel: modelDir``), ``stream: true``, ``max_tokens: 16384``
    unless the catalog tuning says otherwise, no sampling field the tuning
    does not set; the grammar hint and template fix by profile; ``tools``
    when there are any; the cache adapter's extras last."""
    body: dict[str, Any] = {
        "model": model,
        "messages": [dict(m) for m in messages],
        "stream": True,
        "max_tokens": 16_384,
    }
    if tuning:
        apply_tuning(body, tuning)
    if tools and profile.mlx_grammar:
        hint = family_tool_grammar_hint(profile.family)
        if hint is not None:
            body["tool_grammar"] = hint
    if profile.template_fix:
        body["chat_template_override"] = profile.template_fix
    if tools:
        body["tools"] = [dict(t) for t in tools]
    if extras:
        body.update(extras)
    return body


# ---------------------------------------------------------------------------
# openai-compatible/sse.ts `readSseEvents`

DONE = "[DONE]"


def read_sse_events(chunks: Iterable[bytes]) -> Iterator[Any]:
    """Events are split on a blank line (LF or CRLF); only ``data:`` lines
    count; ``[DONE]`` comes through as the string; malformed JSON is
    skipped."""
    buffer = ""
    for raw in chunks:
        buffer += raw.decode("utf-8", "replace")
        while True:
            lf, crlf = buffer.find("\n\n"), buffer.find("\r\n\r\n")
            if lf == -1 and crlf == -1:
                break
            if lf == -1 or (crlf != -1 and crlf < lf):
                event, buffer = buffer[:crlf], buffer[crlf + 4 :]
            else:
                event, buffer = buffer[:lf], buffer[lf + 2 :]
            for line in re.split(r"\r?\n", event):
                if not line.startswith("data:"):
                    continue
                payload = line[5:].lstrip()
                if payload == DONE:
                    yield DONE
                elif payload:
                    try:
                        yield json.loads(payload)
                    except ValueError:
                        continue


# ---------------------------------------------------------------------------
# provider.ts: one streamed turn as the app sees it


@dataclass
class Turn:
    """What one streamed iteration gave the app: its two live channels
    (``emitDelta`` / ``emitReasoningDelta``), the raw content it kept, the
    structured tool calls (``MlxToolCallAccumulator.finalize``), the last
    usage it read, the finish reason and whether ``[DONE]`` came."""

    status: int
    visible: str = ""
    reasoning: str = ""
    raw_content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    usage: dict[str, int] | None = None
    finish_reason: str | None = None
    done: bool = False
    error_body: str = ""
    stripped_bodies: list[str] = field(default_factory=list)


def run_turn(
    client: httpx.Client,
    base_url: str,
    body: Mapping[str, Any],
    *,
    opens_in_reasoning: bool,
    profile: Profile = Profile(),
    on_event: Callable[[dict[str, Any]], None] | None = None,
) -> Turn:
    """provider.ts's SSE loop: ``delta.content`` through the leaked-marker
    stripper, then the reasoning split; ``delta.tool_calls`` into the
    accumulator; ``usage`` read as ``input_tokens ?? prompt_tokens``,
    ``output_tokens ?? completion_tokens`` and top-level ``cached_tokens``
    (kept only when both counts are there); ``finish_reason`` as it comes.
    Every other field of a chunk (``reasoning_content`` among them) is never
    read. A non-2xx answer is the turn's error."""
    with client.stream(
        "POST",
        f"{base_url}/v1/chat/completions",
        json=dict(body),
        headers={"Content-Type": "application/json"},
    ) as r:
        turn = Turn(status=r.status_code)
        if not r.is_success:
            turn.error_body = r.read().decode("utf-8", "replace")
            return turn
        stripper = LeakyToolCallStripper()
        split = StreamingReasoningSplit(
            opens_in_reasoning=opens_in_reasoning, enabled=profile.reasoning_format != "none"
        )
        calls: dict[int, dict[str, str]] = {}

        def show(part: Split) -> None:
            turn.visible += part.visible
            turn.reasoning += part.reasoning

        for event in read_sse_events(r.iter_bytes()):
            if event == DONE:
                turn.done = True
                break
            if not isinstance(event, dict):
                continue
            if on_event is not None:  # a test's hook: the app fans events out here
                on_event(event)
            choices = event.get("choices") or []
            choice = choices[0] if choices else {}
            delta = choice.get("delta") or {}
            content = delta.get("content")
            if content:
                safe = stripper.push(content)
                if safe:
                    turn.raw_content += safe
                    show(split.push(safe))
            for tc in delta.get("tool_calls") or []:
                entry = calls.setdefault(tc["index"], {"id": "", "name": "", "arguments": ""})
                fn = tc.get("function") or {}
                if tc.get("id"):
                    entry["id"] = tc["id"]
                if fn.get("name"):
                    entry["name"] = fn["name"]
                if fn.get("arguments"):
                    entry["arguments"] += fn["arguments"]
            usage = event.get("usage")
            if usage:
                prompt = usage.get("input_tokens", usage.get("prompt_tokens"))
                completion = usage.get("output_tokens", usage.get("completion_tokens"))
                if prompt is not None and completion is not None:
                    turn.usage = {"prompt_tokens": prompt, "completion_tokens": completion}
                    if usage.get("cached_tokens") is not None:
                        turn.usage["cached_tokens"] = usage["cached_tokens"]
            if choice.get("finish_reason"):
                turn.finish_reason = choice["finish_reason"]
        tail = stripper.flush()
        if tail:
            turn.raw_content += tail
            show(split.push(tail))
        show(split.flush())
        turn.stripped_bodies = list(stripper.bodies)
        turn.tool_calls = [
            {
                "id": v["id"],
                "type": "function",
                "function": {"name": v["name"], "arguments": v["arguments"]},
            }
            for _, v in sorted(calls.items())
        ]
        return turn


# ---------------------------------------------------------------------------
# cache-adapter.ts `MlxCacheAdapter`

ESTIMATED_BYTES_PER_TOKEN = 100 * 1024


@dataclass(frozen=True)
class CacheUsage:
    """An ``EngineCacheUsage``."""

    session_id: str
    token_count: int
    est_bytes: int
    last_used_at: int  # epoch ms


def gezel_prefix_id(system_prompt: str, tools: Sequence[Mapping[str, Any]] | None = None) -> str:
    """``gezelPrefixId``: the prompt, plus the tool roster's names and
    parameter names when there are tools, hashed to 16 hex digits."""
    h = hashlib.sha256(system_prompt.encode())
    if tools:
        sig = "|".join(
            sorted(
                f"{(t.get('function') or {}).get('name', '?')}:"
                + ",".join(
                    sorted(
                        ((t.get("function") or {}).get("parameters") or {}).get("properties", {})
                    )
                )
                for t in tools
            )
        )
        h.update(b"\x00tools\x00")
        h.update(sig.encode())
    return f"prefix-{h.hexdigest()[:16]}"


class CacheAdapter:
    """``MlxCacheAdapter`` (the layered-prefix mode left out): request extras,
    ``DELETE /v1/cache/{id}``, ``GET /v1/cache/stats`` read as an array,
    ``POST /v1/cache/warm``, ``POST /admin/flush``. Every call is best-effort
    as the client's are: a transport failure or a non-2xx answer reads as
    nothing."""

    provider_name = "mlx"

    def __init__(self, client: httpx.Client, resolve_base_url: Callable[[], str | None]) -> None:
        self._client = client
        self._resolve = resolve_base_url
        self._session_prefix: dict[str, str] = {}
        self._warmed_prefixes: set[str] = set()

    def set_session_prefix(
        self, session_id: str, system_prompt: str, tools: Sequence[Mapping[str, Any]] | None = None
    ) -> str:
        prefix = gezel_prefix_id(system_prompt, tools)
        self._session_prefix[session_id] = prefix
        return prefix

    def prepare_for_send(self, session_id: str, system_prompt: str | None) -> None:
        """``prepareForSend`` (GEZEL_MLX_STABLE_PREFIX unset: the warm goes
        without tools): register the session's prefix and warm it once,
        persisted."""
        if not system_prompt:
            return
        prefix = self.set_session_prefix(session_id, system_prompt)
        self.warm_prefix(prefix, system_prompt)

    def build_request_extras(self, session_id: str) -> dict[str, Any]:
        extras: dict[str, Any] = {"cache_id": session_id}
        prefix = self._session_prefix.get(session_id)
        if prefix:
            extras["prefix_cache_id"] = prefix
        return extras

    def evict(self, session_ids: Sequence[str]) -> None:
        base = self._resolve()
        if not base:
            return
        for sid in session_ids:
            self._session_prefix.pop(sid, None)
        for sid in session_ids:
            with contextlib.suppress(httpx.TransportError):
                self._client.delete(f"{base}/v1/cache/{urllib.parse.quote(sid, safe='')}")

    def report_usage(self) -> list[CacheUsage]:
        base = self._resolve()
        if not base:
            return []
        try:
            res = self._client.get(f"{base}/v1/cache/stats")
        except httpx.TransportError:
            return []
        if not res.is_success:
            return []
        try:
            payload = res.json()
        except ValueError:
            return []
        if not isinstance(payload, list):  # `Array.isArray(payload)`
            return []
        usage = []
        for entry in payload:
            if not isinstance(entry, dict):
                continue
            cache_id, tokens = entry.get("cache_id"), entry.get("token_count")
            # `typeof tokenCount !== 'number'`; a JSON bool is not a number there.
            if not isinstance(cache_id, str) or not _is_number(tokens):
                continue
            est, last = entry.get("est_bytes"), entry.get("last_used_ts")
            usage.append(
                CacheUsage(
                    session_id=cache_id,
                    token_count=tokens,
                    est_bytes=est if _is_number(est) else tokens * ESTIMATED_BYTES_PER_TOKEN,
                    last_used_at=round(last * 1000)
                    if _is_number(last)
                    else int(time.time() * 1000),
                )
            )
        return usage

    def warm(self, session_id: str, messages: Sequence[Mapping[str, Any]]) -> None:
        base = self._resolve()
        if not base:
            return
        body = {
            "cache_id": session_id,
            "messages": [{"role": m["role"], "content": m.get("content") or ""} for m in messages],
        }
        with contextlib.suppress(httpx.TransportError):
            self._client.post(f"{base}/v1/cache/warm", json=body)

    def flush_all(self) -> None:
        """``flushAll``: the supervisor's idle-freeze hook."""
        base = self._resolve()
        if not base:
            return
        with contextlib.suppress(httpx.TransportError):
            self._client.post(f"{base}/admin/flush")

    def warm_prefix(self, prefix_id: str, system_prompt: str) -> None:
        """``warmPrefix``: once per process per prefix; the warmed entry is
        persisted so sessions after a restart find it."""
        if prefix_id in self._warmed_prefixes:
            return
        base = self._resolve()
        if not base:
            return
        body = {
            "cache_id": prefix_id,
            "messages": [{"role": "system", "content": system_prompt}],
            "persist": True,
        }
        try:
            self._client.post(f"{base}/v1/cache/warm", json=body)
        except httpx.TransportError:
            return
        self._warmed_prefixes.add(prefix_id)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


# ---------------------------------------------------------------------------
# cache/controller.ts `SessionCacheController`

DEFAULT_BUDGET_BYTES = 4 * 1024**3


@dataclass
class _Entry:
    session_id: str
    token_count: int
    bytes: int
    last_used_at: int
    priority: str = "normal"


@dataclass
class _ProviderState:
    adapter: CacheAdapter
    budget_bytes: int
    entries: dict[str, _Entry] = field(default_factory=dict)
    hits: int = 0
    misses: int = 0


class SessionCacheController:
    """The controller's bookkeeping: ``recordTurn`` estimates, then every
    5 s ``reconcileProvider`` *replaces* the entries with the adapter's
    ``reportUsage`` (so an engine that reports nothing empties it), then
    evicts least recently used past the budget down to 80 % of it."""

    def __init__(self) -> None:
        self._providers: dict[str, _ProviderState] = {}

    def register_adapter(
        self, adapter: CacheAdapter, budget_bytes: int = DEFAULT_BUDGET_BYTES
    ) -> None:
        self._providers[adapter.provider_name] = _ProviderState(adapter, budget_bytes)

    def record_turn(
        self, provider: str, session_id: str, approx_prompt_tokens: int, *, was_hit: bool = False
    ) -> None:
        state = self._providers[provider]
        old = state.entries.get(session_id)
        state.entries[session_id] = _Entry(
            session_id,
            approx_prompt_tokens,
            approx_prompt_tokens * ESTIMATED_BYTES_PER_TOKEN,
            int(time.time() * 1000),
            old.priority if old else "normal",
        )
        if was_hit:
            state.hits += 1
        else:
            state.misses += 1
        self._enforce_budget(provider)

    def reconcile_provider(self, provider: str) -> None:
        state = self._providers[provider]
        usage = state.adapter.report_usage()
        priorities = {sid: e.priority for sid, e in state.entries.items()}
        state.entries = {
            u.session_id: _Entry(
                u.session_id,
                u.token_count,
                u.est_bytes,
                u.last_used_at,
                priorities.get(u.session_id, "normal"),
            )
            for u in usage
        }
        self._enforce_budget(provider)

    def invalidate(self, session_id: str) -> None:
        for state in self._providers.values():
            if state.entries.pop(session_id, None) is not None:
                state.adapter.evict([session_id])

    def sessions(self, provider: str) -> dict[str, _Entry]:
        """``getStats(provider).sessions``, by session id."""
        return dict(self._providers[provider].entries)

    def _enforce_budget(self, provider: str) -> None:
        state = self._providers[provider]
        total = sum(e.bytes for e in state.entries.values())
        if total < state.budget_bytes:
            return
        target = state.budget_bytes * 0.8
        order = sorted(state.entries.values(), key=lambda e: (e.priority == "low", e.last_used_at))
        evict = []
        for entry in order:
            if total < target:
                break
            evict.append(entry.session_id)
            total -= entry.bytes
        for sid in evict:
            del state.entries[sid]
        if evict:
            state.adapter.evict(evict)
