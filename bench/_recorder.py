"""A recording proxy: what a real client sends, kept request by request.

``python -m bench._recorder --listen PORT --upstream URL --out DIR`` listens
on ``127.0.0.1:PORT``, forwards every request to ``URL`` unchanged and
streams the answer back as it arrives; each request's method, path, headers
(``authorization``/``x-api-key`` values replaced by ``<redacted>``) and JSON
body is written to ``DIR/NNN.json`` in arrival order, with the status and,
for a JSON answer, its body (a streamed answer keeps its ``usage``-bearing
event lines only). The coding agents run against it (``bench agent
--client``, and the fixtures under ``tests/fixtures/clients/``).

Standard library only (a thread per connection): it is a test tool for one
client at a time, never a server.
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import re
import threading
import time
import urllib.parse
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

__all__ = ["Recorder", "handler", "main", "scrub"]

_SECRET_HEADERS = {"authorization", "x-api-key", "api-key", "proxy-authorization"}
# A streamed piece of generated output, whichever protocol: a non-empty
# text, thinking, JSON or delta string, or a tool call.
_DELTA = re.compile(
    rb'"(?:text|thinking|partial_json|content|reasoning_content|reasoning|delta)":"[^"]'
    rb'|"tool_calls":\[\{'
)
_HOP = {"connection", "keep-alive", "transfer-encoding", "host", "content-length"}


class Recorder:
    """Where the records go and the running count."""

    def __init__(self, upstream: str, out: Path) -> None:
        self.upstream = urllib.parse.urlsplit(upstream)
        self.out = out
        out.mkdir(parents=True, exist_ok=True)
        self._count = itertools.count(len(list(out.glob("*.json"))) + 1)
        self._lock = threading.Lock()

    def next_path(self) -> Path:
        with self._lock:
            return self.out / f"{next(self._count):03d}.json"


def handler(recorder: Recorder) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            return

        def _forward(self) -> None:
            t0 = time.monotonic()
            length = int(self.headers.get("content-length") or 0)
            raw = self.rfile.read(length) if length else b""
            record: dict[str, Any] = {
                "method": self.command,
                "path": self.path,
                "headers": {
                    k.lower(): ("<redacted>" if k.lower() in _SECRET_HEADERS else v)
                    for k, v in self.headers.items()
                },
            }
            try:
                record["body"] = json.loads(raw) if raw else None
            except ValueError:
                record["body_text"] = raw.decode("utf-8", "replace")
            # Written before forwarding, so a request the client gave up on is kept too.
            path = recorder.next_path()
            path.write_text(json.dumps(record, indent=1, ensure_ascii=False))
            up = recorder.upstream
            conn = http.client.HTTPConnection(
                up.hostname or "127.0.0.1", up.port or 80, timeout=3600
            )
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
            headers["content-length"] = str(len(raw))
            conn.request(self.command, up.path.rstrip("/") + self.path, body=raw, headers=headers)
            resp = conn.getresponse()
            self.send_response(resp.status)
            for k, v in resp.getheaders():
                if k.lower() not in _HOP:
                    self.send_header(k, v)
            self.send_header("transfer-encoding", "chunked")
            self.end_headers()
            kept: list[bytes] = []
            first_delta: float | None = None
            while True:
                chunk = resp.read1(65536)
                if not chunk:
                    break
                if first_delta is None and _DELTA.search(chunk):
                    first_delta = time.monotonic() - t0
                kept.append(chunk)
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
            conn.close()
            record["status"] = resp.status
            total = time.monotonic() - t0
            # A JSON answer's first token reaches the client with the rest of it.
            record["timing"] = {"first_delta_s": first_delta or total, "total_s": total}
            text = b"".join(kept).decode("utf-8", "replace")
            if "json" in (resp.getheader("content-type") or ""):
                try:
                    record["response"] = json.loads(text)
                except ValueError:
                    record["response_text"] = text[:4000]
            else:
                record["response_events"] = [
                    line for line in text.splitlines() if '"usage"' in line or "error" in line
                ]
            path.write_text(json.dumps(record, indent=1, ensure_ascii=False))

        do_GET = do_POST = do_PUT = do_DELETE = _forward

    return Handler


def scrub(value: Any, replacements: dict[str, str]) -> Any:
    """``value`` (a record) with every string's ``replacements`` applied
    (longest first: the scratch folder's path before its parent's)."""
    if isinstance(value, str):
        for old in sorted(replacements, key=len, reverse=True):
            value = value.replace(old, replacements[old])
        return value
    if isinstance(value, list):
        return [scrub(v, replacements) for v in value]
    if isinstance(value, dict):
        return {scrub(k, replacements): scrub(v, replacements) for k, v in value.items()}
    return value


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench._recorder")
    parser.add_argument("--listen", type=int, required=True)
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    server = ThreadingHTTPServer(
        ("127.0.0.1", args.listen), handler(Recorder(args.upstream, args.out))
    )
    print(f"recording on http://127.0.0.1:{args.listen}", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
