"""The real coding-agent command lines, driven turn by turn against gezel.

``python -m bench agent --client claude-code|codex|opencode`` runs the
installed CLI (``--clients-bin``, the ``node_modules/.bin`` folder that
``npm install --prefix DIR @anthropic-ai/claude-code @openai/codex
opencode-ai`` makes) non-interactively in a scratch git repository, one
process per turn, each later turn continuing the session (``claude -p
--continue``, ``codex exec resume --last``, ``opencode run --continue``).
Between the CLI and the server stands the recording proxy
(``bench._recorder``), which keeps every request and times its answer.
Every setting that would reach another host is off (docs/clients/).

Per turn: the requests the CLI sent (a CLI sends side requests too: a
title; Claude Code retries a reply cut at its output cap), and of the
turn's own request (the first that declares the most tools) the prompt
tokens, the tokens read from the cache, TTFT (request sent by the CLI ->
first streamed piece of output, or the whole answer when it is not
streamed) and whether the turn completed (the CLI exited 0 and every
request was answered 200).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import attrs

from bench import _recorder, _servers

__all__ = ["CLIENTS", "ClientTurn", "client_command", "client_env", "run_client", "usage_of"]

CLIENTS = ("claude-code", "codex", "opencode")
MODEL = "gezel"
_TURN_TIMEOUT_S = 3600.0  # a 33k-token cold prefill on two loaded cores takes minutes


@attrs.frozen
class ClientTurn:
    turn: int
    requests: int
    prompt: int | None
    cached: int | None
    ttft_s: float | None
    total_s: float
    completed: bool
    statuses: tuple[int, ...]
    exit_code: int


def client_env(client: str, home: Path, base_url: str, max_tokens: int) -> dict[str, str]:
    """The environment (and the config files under ``home``) that points
    ``client`` at ``base_url`` with nothing else reachable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "OPENAI_"))}
    env["HOME"] = str(home)
    if client == "claude-code":
        env |= {
            "ANTHROPIC_BASE_URL": base_url,
            "ANTHROPIC_AUTH_TOKEN": "unused",
            "ANTHROPIC_MODEL": MODEL,
            "ANTHROPIC_DEFAULT_HAIKU_MODEL": MODEL,
            "ANTHROPIC_SMALL_FAST_MODEL": MODEL,
            "DISABLE_TELEMETRY": "1",
            "DISABLE_AUTOUPDATER": "1",
            "DISABLE_ERROR_REPORTING": "1",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(max_tokens),
            # A cold 33k-token prompt prefills for minutes on a CPU: the
            # default 5-minute stream watchdog would retry it from scratch.
            "API_TIMEOUT_MS": "3600000",
            "CLAUDE_STREAM_IDLE_TIMEOUT_MS": "3600000",
            "CLAUDE_BYTE_STREAM_IDLE_TIMEOUT_MS": "3600000",
        }
    elif client == "codex":
        codex_home = home / ".codex"
        codex_home.mkdir(parents=True, exist_ok=True)
        (codex_home / "config.toml").write_text(codex_config(base_url))
        env["CODEX_HOME"] = str(codex_home)
    elif client == "opencode":
        config = home / ".config" / "opencode"
        config.mkdir(parents=True, exist_ok=True)
        (config / "opencode.json").write_text(json.dumps(opencode_config(base_url, max_tokens)))
        env |= {
            "XDG_CONFIG_HOME": str(home / ".config"),
            "XDG_DATA_HOME": str(home / ".local" / "share"),
            "XDG_CACHE_HOME": str(home / ".cache"),
            "XDG_STATE_HOME": str(home / ".local" / "state"),
            "OPENCODE_DISABLE_AUTOUPDATE": "1",
            "OPENCODE_DISABLE_MODELS_FETCH": "1",
            "OPENCODE_DISABLE_SHARE": "1",
            "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
            "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1",
            "OPENCODE_DISABLE_CLAUDE_CODE": "1",
        }
    else:
        raise ValueError(f"unknown client {client!r}: one of {', '.join(CLIENTS)}")
    return env


def codex_config(base_url: str) -> str:
    """Codex's ``config.toml``: a Responses provider with no key, no update
    check, no analytics; its default features (the sub-agent tools come as a
    ``namespace`` tool)."""
    return f"""\
model = "{MODEL}"
model_provider = "gezel"
model_context_window = 262144
check_for_update_on_startup = false
approval_policy = "never"
sandbox_mode = "read-only"

[analytics]
enabled = false

[feedback]
enabled = false

[model_providers.gezel]
name = "gezel-trio"
base_url = "{base_url}/v1"
wire_api = "responses"
request_max_retries = 0
stream_max_retries = 0
stream_idle_timeout_ms = 3600000
"""


def opencode_config(base_url: str, max_tokens: int) -> dict[str, Any]:
    """opencode's ``opencode.json``: one OpenAI-compatible provider."""
    return {
        "$schema": "https://opencode.ai/config.json",
        "autoupdate": False,
        "share": "disabled",
        "model": f"gezel/{MODEL}",
        "small_model": f"gezel/{MODEL}",
        "provider": {
            "gezel": {
                "npm": "@ai-sdk/openai-compatible",
                "name": "gezel-trio",
                "options": {"baseURL": f"{base_url}/v1", "apiKey": "unused"},
                "models": {
                    MODEL: {"name": MODEL, "limit": {"context": 262144, "output": max_tokens}}
                },
            }
        },
    }


def client_command(client: str, bin_dir: Path, turn: int, prompt: str) -> list[str]:
    """The command line of turn ``turn`` (1-based) with the user's ``prompt``."""
    if client == "claude-code":
        more = ["--continue"] if turn > 1 else []
        return [str(bin_dir / "claude"), "-p", prompt, "--output-format", "json", *more]
    if client == "codex":
        head = ["exec", "resume", "--last"] if turn > 1 else ["exec"]
        return [str(bin_dir / "codex"), *head, "--skip-git-repo-check", prompt]
    if client == "opencode":
        more = ["--continue"] if turn > 1 else []
        return [str(bin_dir / "opencode"), "run", "--format", "json", *more, prompt]
    raise ValueError(f"unknown client {client!r}")


def usage_of(record: Mapping[str, Any]) -> tuple[int | None, int | None]:
    """(prompt tokens, tokens read from the cache) of a recorded answer, in
    whichever protocol it came: a JSON body or the usage-bearing events."""
    bodies: list[Any] = []
    if isinstance(record.get("response"), dict):
        bodies.append(record["response"])
    for line in record.get("response_events") or []:
        if line.startswith("data:"):
            try:
                bodies.append(json.loads(line[5:]))
            except ValueError:
                continue
    prompt = cached = None
    for body in bodies:
        usage = (
            body.get("usage")
            or (body.get("message") or {}).get("usage")
            or (body.get("response") or {}).get("usage")
        )
        if not isinstance(usage, dict):
            continue
        if "prompt_tokens" in usage:  # chat completions
            prompt = usage["prompt_tokens"]
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        elif "input_tokens_details" in usage:  # responses
            prompt = usage["input_tokens"]
            cached = usage["input_tokens_details"].get("cached_tokens", 0)
        elif "input_tokens" in usage:  # messages: the three parts sum to the prompt
            read = usage.get("cache_read_input_tokens") or 0
            written = usage.get("cache_creation_input_tokens") or 0
            prompt, cached = usage["input_tokens"] + read + written, read
    return prompt, cached


@contextmanager
def recording(upstream: str, out: Path) -> Iterator[str]:
    """The recording proxy in a thread of this process: its URL."""
    server = ThreadingHTTPServer(
        (_servers.HOST, 0), _recorder.handler(_recorder.Recorder(upstream, out))
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://{_servers.HOST}:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def scratch_repo(path: Path) -> Path:
    """A small git repository for the agent to work in."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "calc.py").write_text("def add(a, b):\n    return a + b\n")
    git = ["git", "-c", "user.email=bench@example.com", "-c", "user.name=bench"]
    subprocess.run([*git, "init", "-q"], cwd=path, check=True)
    subprocess.run([*git, "add", "-A"], cwd=path, check=True)
    subprocess.run([*git, "commit", "-qm", "start"], cwd=path, check=True)
    return path


def run_client(
    client: str,
    bin_dir: Path,
    server_url: str,
    workdir: Path,
    prompts: list[str],
    max_tokens: int,
    progress: Any = print,
) -> list[ClientTurn]:
    """Drive ``client`` through ``prompts`` (one turn each) against
    ``server_url``; the records stay under ``workdir/records``."""
    records = workdir / "records"
    repo = scratch_repo(workdir / "repo")
    home = workdir / "home"
    home.mkdir(parents=True, exist_ok=True)
    turns: list[ClientTurn] = []
    with recording(server_url, records) as proxy:
        env = client_env(client, home, proxy, max_tokens)
        for n, prompt in enumerate(prompts, start=1):
            before = set(records.glob("*.json"))
            t0 = time.monotonic()
            proc = subprocess.run(
                client_command(client, bin_dir, n, prompt),
                cwd=repo,
                env=env,
                capture_output=True,
                text=True,
                timeout=_TURN_TIMEOUT_S,
                stdin=subprocess.DEVNULL,
            )
            total = time.monotonic() - t0
            (workdir / f"turn-{n}.out").write_text(proc.stdout + "\n--- stderr\n" + proc.stderr)
            new = [json.loads(p.read_text()) for p in sorted(set(records.glob("*.json")) - before)]
            turns.append(_turn(n, new, total, proc.returncode))
            progress(f"{client} turn {n}: {turns[-1]}")
    return turns


def _tools(record: Mapping[str, Any]) -> int:
    return len((record.get("body") or {}).get("tools") or [])


def _turn(n: int, records: list[dict[str, Any]], total: float, exit_code: int) -> ClientTurn:
    # The turn's own request is the first that declares the most tools: a
    # title request declares none, and the retries a CLI sends after a reply
    # cut at its output cap come after it.
    main = max(records, key=_tools, default=None)
    statuses = tuple(int(r.get("status") or 0) for r in records)
    prompt = cached = ttft = None
    if main is not None:
        prompt, cached = usage_of(main)
        ttft = (main.get("timing") or {}).get("first_delta_s")
    completed = exit_code == 0 and bool(statuses) and all(s == 200 for s in statuses)
    return ClientTurn(
        n, len(records), prompt, cached, ttft, round(total, 2), completed, statuses, exit_code
    )


def installed(bin_dir: Path, client: str) -> bool:
    name = {"claude-code": "claude", "codex": "codex", "opencode": "opencode"}[client]
    return (bin_dir / name).exists() or shutil.which(name) is not None
