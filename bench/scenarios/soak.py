"""Soak: concurrent clients misbehaving on every protocol for a long time.

Usage (from the repository root)::

    python -m bench soak [--minutes 30] [--clients 8] [--model DIR] [--stall-timeout 5]

One gezel-trio server on the dense demo model (``--model`` for another), as
it ships (no ``--keep-quantized``), with ``--stall-timeout 5``, a 64 MB
prompt-cache budget and a 4 MB stored-response budget (so both evict all
along), and its stdout never read once it has said it is listening (the
supervisor that stops reading: status lines must not block the server).
Each client loops over a random mix of:

* healthy requests, each checked against a reference taken before the soak
  (greedy, so the text must be the same every time):
  ``healthy`` (a chat stream with a cache id), ``responses`` (a stored
  Responses turn and a second turn chained on it by ``previous_response_id``),
  ``messages`` (an Anthropic Messages stream with a tool declared; text and
  tool-call arguments compared), ``completions`` (``/v1/completions``);
* clients that leave: ``disconnect`` (a stream closed after a few chunks),
  ``cancel`` (a non-streaming request given up by a short read timeout),
  ``stall`` (a stream whose client stops reading, withdrawn by the server
  after ``--stall-timeout``);
* bad requests, each of which must get a 4xx with an error body: ``bad``
  (``BAD_BODIES``: out-of-range numbers, lone surrogates, wrong types, an
  unknown field), ``template_bomb`` (a ``chat_template_override`` that
  builds too much or loops for ever),
  ``big_body`` (a ``/v1/completions`` body of about 8 MB of token ids),
  ``huge_images`` (eight 4000x4000 PNGs in one request).

Reported: requests per kind (with how long each took, median and p99),
failed healthy requests (an error, an error frame, or different text), bad
requests not refused with a 4xx, and at the end, once idle: running/queued
sequences, live request channels, pinned cache entries (all must be 0), the
server's resident memory after warm-up (the first fifth of the run) and at
the end, with the drift; the loaded trend (the mean RSS of the last fifth
of the samples taken under load against their second fifth); the exit code
on SIGTERM and how long the stop took with the stdout pipe full (it must be
within ``--shutdown-timeout`` plus a second). Resident memory and
``/health``'s running/queued/live counts are sampled every 10 s (every
hundredth of the run when that is shorter) for the curves. A run with a
failure, a leak, an unclean or slow exit says ``FAIL`` in its notes and
``"passed": false`` in its JSON.

Not in the default run (30 minutes); ``--quick`` soaks for half a minute with
2 clients.
"""

from __future__ import annotations

import collections
import contextlib
import json
import random
import signal
import socket
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2 as httpx

from bench import _servers
from bench._report import percentile
from bench._scenario import Context, Option, Plot, Result, Scenario, Series, table

PROMPTS = [
    "Tell me about the harbour at dawn.",
    "Describe the ledger of ships.",
    "What do the gulls say?",
]
BAD_BODIES: list[dict[str, Any]] = [
    {"seed": 2**70},
    {"logit_bias": {"999999999": 5}},
    {"logit_bias": {"1000000000000000000000000000000": 5}},
    {"logit_bias": {"²": 5}},
    {"messages": [{"role": "user", "content": "a\ud800b"}]},
    {"tools": [{"type": "function", "function": {"name": 5}}]},
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
    {"temperature": "hot"},
    {"max_tokens": -1},  # (one past the context is cut to fit, as llama.cpp does: not a 4xx)
    {"cache_id": "a\u0000b"},
    {"frobnicate": 1},
]
HEALTHY = ("healthy", "responses", "messages", "completions")
LEAVING = ("disconnect", "cancel", "stall")
REFUSED = ("bad", "template_bomb", "big_body", "huge_images")
KINDS = HEALTHY + LEAVING + REFUSED
# Each client's draw: healthy requests (on every protocol) a little over half of
# the time, clients that leave a fifth, bad requests the rest.
_MIX = [
    *("healthy", "healthy", "responses", "responses", "messages", "messages"),
    *("completions", "completions", "completions"),
    *("disconnect", "disconnect", "cancel", "stall"),
    *("bad", "bad", "template_bomb", "big_body", "huge_images"),
]
SAMPLE_PERIOD_S = 10.0
# The server's flags besides the stall timeout: budgets small enough that the
# prompt cache and the stored responses evict all through the soak.
SERVER_FLAGS = ("--cache-budget-mb", "64", "--responses-budget-mb", "4", "--log-level", "WARNING")
SHUTDOWN_TIMEOUT_S = 3.0
TEMPLATE_BOMBS = (
    "{{ 'x' * 20000000 }}",
    "{% for i in range(100000) %}{{ 'x' * 100 }}{% endfor %}",
    "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}",
)
TOOL = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


def _body(prompt: str, **kw: Any) -> dict[str, Any]:
    return {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 32,
        "temperature": 0,
        "ignore_eos": True,
        "chat_template_kwargs": {"enable_thinking": False},
        **kw,
    }


def _big_body() -> bytes:
    """A /v1/completions body of about 8 MB (4M token ids, far past any context)."""
    ids = ",".join(["1"] * 3_900_000)
    return f'{{"prompt": [{ids}], "max_tokens": 4}}'.encode()


def _huge_images() -> dict[str, Any]:
    """A chat body with eight 4000x4000 PNGs (a few KB each: one colour)."""
    import base64
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (4000, 4000), (200, 30, 30)).save(buf, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    parts: list[dict[str, Any]] = [{"type": "text", "text": "What do these show?"}]
    parts += [{"type": "image_url", "image_url": {"url": url}}] * 8
    return {"messages": [{"role": "user", "content": parts}], "max_tokens": 8}


def _responses_chain(client: httpx.Client, prompt: str) -> tuple[str, str | None]:
    """Two stored Responses turns, the second chained by previous_response_id:
    both output texts (joined), or what went wrong."""
    texts = []
    previous = None
    for text in (prompt, "Go on."):
        body: dict[str, Any] = {"input": text, "max_output_tokens": 24, "temperature": 0}
        if previous is not None:
            body["previous_response_id"] = previous
        r = client.post("/v1/responses", json=body)
        if r.status_code != 200:
            return "", f"status {r.status_code}: {r.text[:200]}"
        got = r.json()
        if got.get("status") not in ("completed", "incomplete"):
            return "", f"response status {got.get('status')}: {json.dumps(got)[:200]}"
        previous = got["id"]
        texts.append(
            "".join(
                part.get("text", "")
                for item in got.get("output", [])
                if item.get("type") == "message"
                for part in item.get("content", [])
            )
        )
    return " | ".join(texts), None


def _messages_stream(client: httpx.Client, prompt: str) -> tuple[str, str | None]:
    """An Anthropic Messages stream with a tool declared: its text and tool
    input deltas (joined), or the first error event."""
    body = {
        "model": "soak",
        "max_tokens": 32,
        "temperature": 0,
        "stream": True,
        "tools": [TOOL],
        "messages": [{"role": "user", "content": prompt}],
    }
    parts: list[str] = []
    stopped = False
    headers = {"anthropic-version": "2023-06-01"}
    with client.stream("POST", "/v1/messages", json=body, headers=headers) as r:
        if r.status_code != 200:
            return "", f"status {r.status_code}: {r.read()[:200]!r}"
        for event in _events(r):
            kind = event.get("type")
            if kind == "error":
                return "", json.dumps(event)[:300]
            if kind == "content_block_start" and event["content_block"]["type"] == "tool_use":
                parts.append(f"<{event['content_block']['name']}>")
            elif kind == "content_block_delta":
                delta = event["delta"]
                parts.append(delta.get("text") or delta.get("partial_json") or "")
            elif kind == "message_stop":
                stopped = True
    return "".join(parts), None if stopped else "no message_stop"


def _completion(client: httpx.Client, prompt: str) -> tuple[str, str | None]:
    body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    r = client.post("/v1/completions", json=body)
    if r.status_code != 200:
        return "", f"status {r.status_code}: {r.text[:200]}"
    return r.json()["choices"][0]["text"], None


def _chat_stream(client: httpx.Client, prompt: str) -> tuple[str, str | None]:
    i = PROMPTS.index(prompt)
    return _stream_text(client, _body(prompt, cache_id=f"soak-{i}"))


# How each healthy kind is asked, and its reference taken.
_ASK = {
    "healthy": _chat_stream,
    "responses": _responses_chain,
    "messages": _messages_stream,
    "completions": _completion,
}


def _events(r: httpx.Response) -> Iterator[dict[str, Any]]:
    """The JSON objects of a server-sent event stream's ``data:`` lines."""
    for line in r.iter_lines():
        if line.startswith("data: {"):
            yield json.loads(line[6:])


def _stream_text(client: httpx.Client, body: dict[str, Any]) -> tuple[str, str | None]:
    """The streamed content and the first error frame, if any."""
    parts: list[str] = []
    error = None
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        if r.status_code != 200:
            return "", f"status {r.status_code}: {r.read()[:200]!r}"
        for event in _events(r):
            if "error" in event:
                error = json.dumps(event["error"])[:300]
                continue
            for choice in event.get("choices") or []:
                parts.append(choice.get("delta", {}).get("content") or "")
    return "".join(parts), error


class Soak:
    def __init__(
        self, url: str, references: dict[tuple[str, str], str], stall_timeout: float
    ) -> None:
        self.url = url
        self.references = references
        self.big_raw = _big_body()
        self.images_body = _huge_images()
        self.stall_timeout = stall_timeout
        self.counts: collections.Counter[str] = collections.Counter()
        self.failed: collections.Counter[str] = collections.Counter()
        self.failures: list[str] = []
        self.seconds: dict[str, list[float]] = {k: [] for k in KINDS}
        self.lock = threading.Lock()

    def note(self, kind: str, failure: str | None = None, seconds: float | None = None) -> None:
        with self.lock:
            self.counts[kind] += 1
            if seconds is not None:
                self.seconds[kind].append(round(seconds, 3))
            if failure is not None:
                self.failed[kind] += 1
                self.failures.append(f"{kind}: {failure}")

    def snapshot(self) -> tuple[dict[str, int], dict[str, int]]:
        with self.lock:
            return dict(self.counts), dict(self.failed)

    def client_loop(self, seed: int, until: float) -> None:
        rng = random.Random(seed)
        client = httpx.Client(base_url=self.url, timeout=120)
        while time.monotonic() < until:
            kind = rng.choice(_MIX)
            t0 = time.monotonic()
            try:
                failure = getattr(self, kind)(client, rng)
            except Exception as exc:
                failure = f"{type(exc).__name__}: {exc}"
            self.note(kind, failure, time.monotonic() - t0)
        client.close()

    # Each kind returns what went wrong, or None.

    def _checked(self, kind: str, client: httpx.Client, rng: random.Random) -> str | None:
        prompt = rng.choice(PROMPTS)
        text, error = _ASK[kind](client, prompt)
        if error is not None:
            return error
        if text != self.references[kind, prompt]:
            return f"text differs: {text[:80]!r} (reference {self.references[kind, prompt][:80]!r})"
        return None

    def healthy(self, client: httpx.Client, rng: random.Random) -> str | None:
        return self._checked("healthy", client, rng)

    def responses(self, client: httpx.Client, rng: random.Random) -> str | None:
        return self._checked("responses", client, rng)

    def messages(self, client: httpx.Client, rng: random.Random) -> str | None:
        return self._checked("messages", client, rng)

    def completions(self, client: httpx.Client, rng: random.Random) -> str | None:
        return self._checked("completions", client, rng)

    def disconnect(self, client: httpx.Client, rng: random.Random) -> str | None:
        body = _body(rng.choice(PROMPTS), max_tokens=400, stream=True)
        with client.stream("POST", "/v1/chat/completions", json=body) as r:
            for n, _ in enumerate(r.iter_lines()):
                if n >= rng.randrange(2, 30):
                    break
        return None

    def cancel(self, client: httpx.Client, rng: random.Random) -> str | None:
        body = _body(rng.choice(PROMPTS), max_tokens=400)
        with contextlib.suppress(httpx.TimeoutException):
            client.post("/v1/chat/completions", json=body, timeout=rng.uniform(0.05, 0.5))
        return None

    def bad(self, client: httpx.Client, rng: random.Random) -> str | None:
        body = {**_body(rng.choice(PROMPTS)), **rng.choice(BAD_BODIES)}
        return _refused(
            client, "/v1/chat/completions", json.dumps(body).encode("utf-8", "surrogatepass")
        )

    def template_bomb(self, client: httpx.Client, rng: random.Random) -> str | None:
        body = _body(rng.choice(PROMPTS), chat_template_override=rng.choice(TEMPLATE_BOMBS))
        return _refused(client, "/v1/chat/completions", json.dumps(body).encode())

    def big_body(self, client: httpx.Client, rng: random.Random) -> str | None:
        return _refused(client, "/v1/completions", self.big_raw)

    def huge_images(self, client: httpx.Client, rng: random.Random) -> str | None:
        return _refused(client, "/v1/chat/completions", json.dumps(self.images_body).encode())

    def stall(self, client: httpx.Client, rng: random.Random) -> str | None:
        """A raw socket with a tiny receive window that stops reading."""
        host, port = self.url.removeprefix("http://").rsplit(":", 1)
        payload = json.dumps(_body(rng.choice(PROMPTS), max_tokens=20_000, stream=True)).encode()
        with socket.create_connection((host, int(port))) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                b"Content-Type: application/json\r\n"
                + f"Content-Length: {len(payload)}\r\n\r\n".encode()
                + payload
            )
            sock.recv(1024)
            time.sleep(self.stall_timeout + rng.uniform(1, 4))  # stop reading
        return None


def _refused(client: httpx.Client, path: str, raw: bytes) -> str | None:
    """None if posting ``raw`` to ``path`` gets a 4xx with an error body."""
    r = client.post(path, content=raw, headers={"Content-Type": "application/json"})
    try:
        ok = 400 <= r.status_code < 500 and "error" in r.json()
    except ValueError:
        ok = False
    return None if ok else f"status {r.status_code}: {r.text[:200]}"


def _unread_bytes(server: _servers.Server) -> int:
    """How many bytes wait unread in the server's stdout pipe (Linux FIONREAD)."""
    import array
    import fcntl
    import termios

    if server.proc.stdout is None:
        return 0
    buf = array.array("i", [0])
    fcntl.ioctl(server.proc.stdout.fileno(), termios.FIONREAD, buf)
    return buf[0]


def _health(client: httpx.Client) -> dict[str, Any]:
    try:
        got: dict[str, Any] = client.get("/health").json()
    except Exception as exc:  # a sample, not a verdict: recorded as such
        return {"error": f"{type(exc).__name__}: {exc}"}
    return got


def run(ctx: Context) -> Result:
    a = ctx.args
    if a.minutes <= 0 or a.clients < 1:
        raise ValueError("--minutes > 0 and --clients >= 1 required")
    model_dir: Path = a.model if a.model is not None else ctx.demo_model("dense")
    flags = [
        "--stall-timeout", str(a.stall_timeout),
        "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S),
        *SERVER_FLAGS,
    ]  # fmt: skip
    period = min(SAMPLE_PERIOD_S, max(1.0, a.minutes * 60 / 100))
    samples: list[dict[str, Any]] = []
    with _servers.gezel_server(
        model_dir,
        ctx.workdir / "gezel.log",
        flags,
        stop_signal=signal.SIGTERM,
        stored_weights=False,
        read_stdout=False,
    ) as server:
        with ctx.phase("references"), httpx.Client(base_url=server.url, timeout=300) as c:
            refs: dict[tuple[str, str], str] = {}
            for kind, ask in _ASK.items():
                for p in PROMPTS:
                    text, error = ask(c, p)
                    if error is not None:
                        raise RuntimeError(f"reference for {kind} {p!r}: {error}")
                    refs[kind, p] = text
        soak = Soak(server.url, refs, a.stall_timeout)
        pid = server.proc.pid
        with ctx.phase("soak"), httpx.Client(base_url=server.url, timeout=30) as probe:
            start = time.monotonic()
            until = start + a.minutes * 60
            threads = [
                threading.Thread(target=soak.client_loop, args=(i, until), daemon=True)
                for i in range(a.clients)
            ]
            for t in threads:
                t.start()

            def sample() -> None:
                counts, failed = soak.snapshot()
                health = _health(probe)
                samples.append(
                    {
                        "seconds": round(time.monotonic() - start, 1),
                        "rss_kb": _servers.rss_kb(pid),
                        "running": health.get("running"),
                        "queued": health.get("queued"),
                        "live": health.get("live"),
                        "requests": counts,
                        "failed": failed,
                    }
                )

            next_report = start + 60
            while any(t.is_alive() for t in threads):
                sample()
                if time.monotonic() >= next_report:
                    next_report += 60
                    counts, failed = soak.snapshot()
                    ctx.progress(
                        f"{(time.monotonic() - start) / 60:.0f} min: {sum(counts.values())} "
                        f"requests, {sum(failed.values())} failed"
                    )
                time.sleep(period)  # the sampling period
            for t in threads:
                t.join()
        with ctx.phase("idle check"), httpx.Client(base_url=server.url, timeout=60) as c:
            deadline = time.monotonic() + 60
            health = c.get("/health").json()
            while (health["running"] or health["queued"] or health["live"]) and (
                time.monotonic() < deadline
            ):
                time.sleep(0.5)  # bounded wait for withdrawn streams to leave
                health = c.get("/health").json()
            unread = _unread_bytes(server)
            pinned = [e["cache_id"] for e in c.get("/v1/cache/stats").json()["data"] if e["pinned"]]
            samples.append(
                {
                    "seconds": round(time.monotonic() - start, 1),
                    "rss_kb": _servers.rss_kb(pid),
                    "running": health["running"],
                    "queued": health["queued"],
                    "live": health["live"],
                    "requests": dict(soak.counts),
                    "failed": dict(soak.failed),
                }
            )
    return _result(ctx, model_dir, soak, samples, health, pinned, server, unread)


def _result(
    ctx: Context,
    model_dir: Path,
    soak: Soak,
    samples: list[dict[str, Any]],
    health: dict[str, Any],
    pinned: list[str],
    server: _servers.Server,
    unread: int,
) -> Result:
    a = ctx.args
    exit_code = server.exit_code
    stop_ok = server.stop_s <= SHUTDOWN_TIMEOUT_S + 1
    warm = [s["rss_kb"] for s in samples if s["seconds"] >= a.minutes * 60 / 5]
    if not warm:
        warm = [samples[0]["rss_kb"], samples[-1]["rss_kb"]]
    after_warmup, at_end = warm[0], warm[-1]
    drift = (at_end - after_warmup) / after_warmup * 100 if after_warmup else 0.0
    # Under load RSS saws up and down with what is running (an 8 MB body, a
    # batch of images): single samples are noisy, so the trend is the mean of
    # the loaded samples' last fifth against their second fifth.
    loaded = [s["rss_kb"] for s in samples[:-1]]
    fifth = max(1, len(loaded) // 5)
    early = statistics.mean(loaded[fifth : 2 * fifth] or loaded[:1])
    late = statistics.mean(loaded[-fifth:] or loaded[-1:])
    trend = (late - early) / early * 100 if early else 0.0
    leaked = bool(health["running"] or health["queued"] or health["live"] or pinned)
    passed = not soak.failures and not leaked and exit_code == 0 and stop_ok
    data: dict[str, Any] = {
        "model": str(model_dir),
        "minutes": a.minutes,
        "clients": a.clients,
        "requests": dict(soak.counts),
        "failed": dict(soak.failed),
        "failed_healthy": sum(soak.failed[k] for k in HEALTHY),
        "stop_s": round(server.stop_s, 2),
        "stdout_unread_bytes": unread,
        "failures": soak.failures[:30],
        "failure_count": len(soak.failures),
        "leaks": {
            "running": health["running"],
            "queued": health["queued"],
            "live_channels": health["live"],
            "pinned": pinned,
        },
        "rss_kb": {
            "after_warmup": after_warmup,
            "end": at_end,
            "drift_pct": round(drift, 2),
            "loaded_second_fifth_mean": round(early),
            "loaded_last_fifth_mean": round(late),
            "loaded_trend_pct": round(trend, 2),
            "loaded_min": min(loaded, default=0),
            "loaded_max": max(loaded, default=0),
        },
        "exit_code": exit_code,
        "passed": passed,
        "samples": samples,
        "seconds_by_kind": soak.seconds,  # every request's duration, in order of completion
    }
    kind_rows = []
    for k in KINDS:
        secs = sorted(soak.seconds[k])
        kind_rows.append(
            (
                k,
                soak.counts[k],
                soak.failed[k],
                statistics.median(secs) if secs else None,
                percentile(secs, 99),
            )
        )
    tables = [
        table(
            "Requests by kind",
            "kind | requests:d | failed:d | median s:.2f | p99 s:.2f",
            kind_rows,
            "Seconds: the client's whole request (a stall includes its deliberate "
            f"{a.stall_timeout:g} s + 1-4 s of not reading).",
        ),
        table(
            "At the end, once idle",
            "running:d | queued:d | live channels:d | pinned:d | RSS after warm-up MiB:.0f"
            " | RSS at end MiB:.0f | drift %:.2f | loaded trend %:.2f | exit code | stop s:.2f",
            [
                (
                    health["running"],
                    health["queued"],
                    health["live"],
                    len(pinned),
                    after_warmup / 1024,
                    at_end / 1024,
                    drift,
                    trend,
                    "killed" if exit_code is None else str(exit_code),
                    server.stop_s,
                )
            ],
        ),
    ]
    notes = [
        ("PASS" if passed else "FAIL")
        + f": {len(soak.failures)} failed requests, leaks: {'yes' if leaked else 'none'}, "
        f"exit code {exit_code}, stopped in {server.stop_s:.2f} s with its stdout unread "
        f"(bound {SHUTDOWN_TIMEOUT_S + 1:g} s; {unread} bytes unread in its stdout pipe "
        "at the end)."
    ]
    notes += [f"failure: {f[:300]}" for f in soak.failures[:10]]
    minutes = [s["seconds"] / 60 for s in samples]
    plots = [
        Plot(
            "Request outcomes by kind",
            "",
            "requests",
            (
                Series("ok", list(KINDS), [soak.counts[k] - soak.failed[k] for k in KINDS]),
                Series("failed", list(KINDS), [soak.failed[k] for k in KINDS]),
            ),
            kind="bar",
        ),
        Plot(
            "Requests completed (cumulative; dashed: failed)",
            "minutes",
            "requests",
            tuple(
                Series(k, minutes, [s["requests"].get(k, 0) for s in samples], group=k)
                for k in KINDS
                if soak.counts[k]
            )
            + tuple(
                Series(f"{k} failed", minutes, [s["failed"].get(k, 0) for s in samples], "--", k)
                for k in KINDS
                if soak.failed[k]
            ),
        ),
        Plot(
            "Server resident memory",
            "minutes",
            "RSS MiB",
            (Series("gezel-trio", minutes, [s["rss_kb"] / 1024 for s in samples]),),
        ),
        Plot(
            "Sequences and channels in the server (/health)",
            "minutes",
            "count",
            tuple(
                Series(key, minutes, [s.get(key) for s in samples], style)
                for key, style in (("live", "-"), ("running", "--"), ("queued", ":"))
            ),
        ),
    ]
    title = f"{a.clients} clients for {a.minutes:g} min on {model_dir.name}"
    return Result(data, tables, plots, notes, title=title)


SCENARIO = Scenario(
    name="soak",
    doc=__doc__ or "",
    run=run,
    options=(
        Option("minutes", 30.0, "how long the clients misbehave", float, quick=0.5),
        Option("clients", 8, "concurrent clients", int, quick=2),
        Option("stall_timeout", 5.0, "the server's --stall-timeout (s)", float),
        Option("model", None, "a model directory (default: the dense demo model)", Path),
    ),
    in_default_run=False,
)
