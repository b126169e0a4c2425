"""Soak: 8 concurrent clients misbehaving for a long time (issue 9).

Usage (from the repository root)::

    python bench/soak.py [--minutes 30] [--clients 8] [--model DIR] [--json OUT]

One gezel-trio server on the ``bench`` dense demo model (``--model`` for
another), ``--stall-timeout 5``. Each client loops over a random mix of:

* ``healthy``: a greedy stream (one of a few prompts with a cache id) that
  must finish with the same text as that prompt's reference, taken before
  the soak starts;
* ``disconnect``: a stream closed after a few chunks;
* ``cancel``: a non-streaming request whose client gives up (a short read
  timeout);
* ``stall``: a stream whose client stops reading (a tiny receive window)
  until the server withdraws it after ``--stall-timeout``;
* ``bad``: a request from issue 9's table or another malformed body, which
  must get a 4xx.

Reported: requests per kind, failed healthy requests (an error, an error
frame, or different text), bad requests not refused with a 4xx, and at the
end, once idle: running/queued sequences, live request channels, pinned
cache entries (all must be 0), the server's resident memory after warm-up
(the first fifth of the run) and at the end, with the drift, and the exit
code on SIGTERM.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import contextlib

import httpx2 as httpx

from bench._common import build_default_model, gezel_server, write_json

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
    {"max_tokens": 10**12},
    {"cache_id": "a\u0000b"},
    {"frobnicate": 1},
]


def _body(prompt: str, **kw: Any) -> dict[str, Any]:
    return {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 32,
        "temperature": 0,
        "ignore_eos": True,
        "chat_template_kwargs": {"enable_thinking": False},
        **kw,
    }


def _stream_text(client: httpx.Client, body: dict[str, Any]) -> tuple[str, str | None]:
    """The streamed content and the first error frame, if any."""
    parts: list[str] = []
    error = None
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        if r.status_code != 200:
            return "", f"status {r.status_code}: {r.read()[:200]!r}"
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                error = json.dumps(event["error"])[:300]
                continue
            for choice in event.get("choices") or []:
                parts.append(choice.get("delta", {}).get("content") or "")
    return "".join(parts), error


class Soak:
    def __init__(self, url: str, references: dict[str, str], stall_timeout: float) -> None:
        self.url = url
        self.references = references
        self.stall_timeout = stall_timeout
        self.counts: collections.Counter[str] = collections.Counter()
        self.failures: list[str] = []
        self.lock = threading.Lock()

    def note(self, kind: str, failure: str | None = None) -> None:
        with self.lock:
            self.counts[kind] += 1
            if failure is not None:
                self.failures.append(f"{kind}: {failure}")

    def client_loop(self, seed: int, until: float) -> None:
        rng = random.Random(seed)
        client = httpx.Client(base_url=self.url, timeout=120)
        kinds = ["healthy"] * 4 + ["disconnect", "cancel", "bad", "bad", "stall"]
        while time.monotonic() < until:
            kind = rng.choice(kinds)
            try:
                getattr(self, kind)(client, rng)
            except Exception as exc:
                self.note(kind, f"{type(exc).__name__}: {exc}")
        client.close()

    def healthy(self, client: httpx.Client, rng: random.Random) -> None:
        i = rng.randrange(len(PROMPTS))
        text, error = _stream_text(client, _body(PROMPTS[i], cache_id=f"soak-{i}"))
        if error is not None:
            self.note("healthy", error)
        elif text != self.references[PROMPTS[i]]:
            self.note("healthy", f"text differs: {text[:80]!r}")
        else:
            self.note("healthy")

    def disconnect(self, client: httpx.Client, rng: random.Random) -> None:
        body = _body(rng.choice(PROMPTS), max_tokens=400, stream=True)
        with client.stream("POST", "/v1/chat/completions", json=body) as r:
            for n, _ in enumerate(r.iter_lines()):
                if n >= rng.randrange(2, 30):
                    break
        self.note("disconnect")

    def cancel(self, client: httpx.Client, rng: random.Random) -> None:
        body = _body(rng.choice(PROMPTS), max_tokens=400)
        with contextlib.suppress(httpx.TimeoutException):
            client.post("/v1/chat/completions", json=body, timeout=rng.uniform(0.05, 0.5))
        self.note("cancel")

    def bad(self, client: httpx.Client, rng: random.Random) -> None:
        body = {**_body(rng.choice(PROMPTS)), **rng.choice(BAD_BODIES)}
        raw = json.dumps(body).encode("utf-8", "surrogatepass")
        r = client.post(
            "/v1/chat/completions", content=raw, headers={"Content-Type": "application/json"}
        )
        ok = 400 <= r.status_code < 500 and "error" in r.json()
        self.note("bad", None if ok else f"status {r.status_code}: {r.text[:200]}")

    def stall(self, client: httpx.Client, rng: random.Random) -> None:
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
        self.note("stall")


def _rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--stall-timeout", type=float, default=5.0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    model = args.model or build_default_model()
    flags = ["--stall-timeout", str(args.stall_timeout), "--log-level", "WARNING"]
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "server.log"
        with gezel_server(model, log, flags) as server:
            with httpx.Client(base_url=server.url, timeout=300) as c:
                refs = {p: _stream_text(c, _body(p))[0] for p in PROMPTS}
            soak = Soak(server.url, refs, args.stall_timeout)
            pid = server.proc.pid
            start = time.monotonic()
            until = start + args.minutes * 60
            threads = [
                threading.Thread(target=soak.client_loop, args=(i, until), daemon=True)
                for i in range(args.clients)
            ]
            for t in threads:
                t.start()
            samples: list[tuple[float, int]] = []
            while any(t.is_alive() for t in threads):
                samples.append((time.monotonic() - start, _rss_kb(pid)))
                time.sleep(10)  # RSS sampling period
            for t in threads:
                t.join()
            with httpx.Client(base_url=server.url, timeout=60) as c:
                deadline = time.monotonic() + 60
                health = c.get("/health").json()
                while (health["running"] or health["queued"] or health["live"]) and (
                    time.monotonic() < deadline
                ):
                    time.sleep(0.5)  # bounded wait for withdrawn streams to leave
                    health = c.get("/health").json()
                pinned = [
                    e["cache_id"] for e in c.get("/v1/cache/stats").json()["data"] if e["pinned"]
                ]
            samples.append((time.monotonic() - start, _rss_kb(pid)))
        exit_code = server.exit_code
    warm = [rss for t, rss in samples if t >= args.minutes * 60 / 5]
    after_warmup, at_end = (warm[0], warm[-1]) if warm else (samples[0][1], samples[-1][1])
    drift = (at_end - after_warmup) / after_warmup * 100 if after_warmup else 0.0
    healthy_failed = [f for f in soak.failures if f.startswith("healthy")]
    report = {
        "minutes": args.minutes,
        "clients": args.clients,
        "requests": dict(soak.counts),
        "failed_healthy": len(healthy_failed),
        "failures": soak.failures[:30],
        "leaks": {
            "running": health["running"],
            "queued": health["queued"],
            "live_channels": health["live"],
            "pinned": pinned,
        },
        "rss_kb": {"after_warmup": after_warmup, "end": at_end, "drift_pct": round(drift, 2)},
        "exit_code": exit_code,
    }
    print(json.dumps(report, indent=2))
    if args.json:
        write_json(args.json, report)
    leaked = health["running"] or health["queued"] or health["live"] or pinned
    return 1 if soak.failures or leaked or exit_code != 0 else 0


if __name__ == "__main__":
    sys.exit(main())
