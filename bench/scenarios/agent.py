"""Agent-style multi-turn session: prompt-cache reuse, gezel-trio vs ``mlx_lm.server``.

Modes (``--mode``)
    ``session`` (default): one agent; gezel's requests carry a ``cache_id``.
    ``anonymous``: the same session, no gezel field at all - what every
    standard client (the OpenAI SDK, LangChain, the Agents SDK) sends.
    ``interleaved``: ``--agents`` agents (default 4) that share the system
    prompt and tools but each have their own user request, run turn by turn
    in turn (agent 1's turn n, agent 2's turn n, ...), no ids. Per turn the
    table sums the agents' prompt, cached, prefilled and ``min`` tokens and
    shows the median TTFT.

    ``claude-code`` / ``codex``: the recorded request shapes of the two
    coding agents (``bench.scenarios._agent_shapes``, whose docstring names
    the sources), ``--turns`` requests of each, no gezel field: gezel gets
    them as the agents send them (``/v1/messages`` streamed with a new
    billing header every request, tool rounds, reminders and a
    mid-conversation system message; ``/v1/responses`` streamed with the
    Codex tools array, ``store: false`` and the whole history re-sent),
    ``mlx_lm.server`` the same conversation rendered as chat completions (as
    claude-code-router / LiteLLM and Codex's chat providers send it). Each
    system replays its own replies. No logit bias and no ``ignore_eos``
    (neither API has them), so a reply may end early and the demo models'
    random-weight replies need not re-tokenize as generated; no restart
    turn and no ``min`` column. Per turn: prompt, cached, prefilled tokens,
    TTFT (first streamed delta of generated text, reasoning or a tool call)
    and total time.

``--client claude-code|codex|opencode`` drives the real command-line agent
instead (``bench.scenarios._real_clients``, whose docstring says how): the
installed CLI (``--clients-bin``) runs ``--turns`` turns of one session
against gezel alone on the dense demo model given a 262,144-token window
(Claude Code's first request is ~33,600 tokens), ``--tokens`` the CLI's
output cap where it has one and the server's ``--max-tokens-default``
(Codex names none); ``--server-url`` drives it against a server already
running instead. Per turn: the requests the CLI sent, and of
the turn's own request the prompt and cached tokens, TTFT and whether the
turn completed.

After the last turn before the restart, both servers report the bytes their
prompt cache holds (gezel: ``/v1/cache/stats`` ``totals.bytes``, shared
blocks counted once; ``mlx_lm.server``: the ``nbytes`` of its
``LRUPromptCache``, logged by a small wrapper that starts it,
``bench/_mlx_lm_server.py`` - the one instrumented line is its own cache
statistics, logged exactly instead of in GB with two decimals).

What one session is
    A coding agent's tool loop, replayed the way real clients do it. Turn 1 is
    a system prompt (~300 tokens of instructions), a ``tools`` roster of three
    functions and a user request. Every later turn appends one tool round - the
    previous reply as ``{"role": "assistant", "content": "",
    "reasoning_content": <reply>, "tool_calls": [...]}`` and a short tool result
    (~30-80 tokens) - so the transcript only grows. Turn ``--think-off-turn``
    (default 5) is sent with ``chat_template_kwargs.enable_thinking = false``
    (its reply comes back as ``content`` and is replayed as ``content``), and
    turn ``--user-turn`` (default 8) also appends a new user message after its
    tool round. With the Qwen3-style template of the demo models, a new user
    message makes every earlier assistant turn drop its ``<think>`` block, so
    that turn re-renders the history and no prefix cache can reuse past the
    end of the first user message: it is a large re-prefill by construction,
    for both systems (and a full one for a cache that cannot rewind to there).
    After turn ``--turns`` (default 10) the server is stopped and started again
    on the same ``--persist-dir`` (gezel: SIGTERM, which flushes its prompt
    cache to disk; ``mlx_lm.server`` keeps its cache in memory only and gets
    SIGINT, then SIGKILL after 10 s), and one more tool round is sent: the
    "restart" turn.

Both systems, one after the other (never together), on the demo models of
``--models`` at ``--size``:

``gezel``
    ``python -m gezel_trio serve --max-concurrency 4 --prefill-step-size 512
    --persist-dir D --log-level INFO`` (stderr to a log file); every request
    carries ``ignore_eos: true``, and in ``session`` mode ``cache_id`` (the
    session id).
``mlx_lm.server``
    ``python -m mlx_lm server --decode-concurrency 4 --prompt-concurrency 4
    --prefill-step-size 512 --log-level WARNING``; it has its own automatic
    prompt cache (an LRU of token sequences, no session id) and no
    ``ignore_eos``, so its replies may end early on EOS (generated tokens are
    recorded per turn).

Requests are streaming, greedy (``temperature: 0``), ``max_tokens =
--tokens``, with ``stream_options.include_usage``. Random-weight demo models
emit token sequences that no tokenizer reproduces, which a trained model
doesn't; so, as the repository's cache tests do, every request carries a
``logit_bias`` of +100 on (up to 1024) whole-word tokens whose text
re-encodes to the same single token: replies are words, re-render exactly
when replayed, and EOS is never chosen (``--no-word-bias`` turns this off).
Both servers strip a reply's leading whitespace, while the first generated
token is then a " word" token; the replay puts that one space back, so the
history holds exactly the generated tokens, as it would with a trained model
(whose reply after the ``<think>`` line does not start with a space).
``--replay-as-returned`` replays the stripped text instead, which costs both
systems the previous reply's tokens on every turn.

Per turn and system
    ``prompt``  = ``usage.prompt_tokens`` (``*``: the client-side rendering
    has a different length);
    ``cached``  = ``usage.prompt_tokens_details.cached_tokens`` (both servers
    report it: gezel the tokens its cache seeded the sequence with,
    ``mlx_lm.server`` the length of the nearest cache entry it fetched);
    ``prefill`` = prompt - cached;
    ``TTFT``    = request sent -> first SSE chunk with generated text
    (``content``, ``reasoning_content`` or ``reasoning``);
    ``total``   = request sent -> end of the stream;
    ``gen``     = ``usage.completion_tokens``.
    ``min`` is a client-side reference, not a measurement: the tokens of the
    prompt that follow its longest common prefix with the previous turn's
    prompt + reply (rendered with the model's own tokenizer and template).
    That is what a perfect cache that kept exactly the previous turn must
    still prefill. For gezel the table also shows its cache decision (the
    ``seed ... source=... mode=...`` INFO line its prompt cache logs when it
    admits the request).

Each server gets one short warm-up request (an unrelated one-line prompt,
no ``cache_id``) after it starts and before the first measured turn, so
one-time MLX start-up costs are not charged to turn 1 or to the restart turn
(``--no-warmup`` skips it). Its first token, ``<|im_start|>``, is shared with
every prompt, so either server may report 1 cached token on a cold turn.

Summary ratios per model, all gezel / ``mlx_lm.server`` (below 1: gezel
better): total prefilled tokens over turns 2..N; median TTFT over turns 2..N
("warm" turns) and the median of the per-turn TTFT ratios; the restart
turn's TTFT; prompt-cache bytes.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs
import httpx2 as httpx

from bench import _servers, _sse
from bench._report import ratio
from bench._scenario import Context, Option, Plot, Result, Scenario, Series, Table, table
from bench._servers import Server
from bench.scenarios import _agent_shapes as shapes
from bench.scenarios import _real_clients as real

SYSTEMS = ("gezel", "mlx_lm.server")
SHAPE_MODES = ("claude-code", "codex")
MODELS = ("dense", "hybrid")
SESSION_ID = "agent-session"
_STOP_TIMEOUT_S = 60.0  # gezel: drain + flush to disk
_MLX_STOP_TIMEOUT_S = 10.0  # mlx_lm.server often hangs on SIGINT: then SIGKILL
_MAX_BIAS = 1024  # gezel's MAX_LOGIT_BIAS

# --- the session's text ------------------------------------------------------

SYSTEM_PROMPT = """\
You are Harbor, a careful software engineering agent working inside a git \
repository on behalf of one developer. You can read files, search the code \
and run the test suite through the tools listed below; you cannot see \
anything else.

Rules:
1. Before you change your mind about the cause of a bug, read the code that \
would prove it. Never guess a file's content.
2. Call one tool per step. After each tool result, think briefly about what \
you learned, then either call the next tool or answer.
3. Keep searches narrow: search for a function or class name, not for a \
sentence.
4. When a test fails, read the failing assertion and the code under test \
before proposing a fix.
5. Report what you found in plain words: the file, the line, what is wrong \
and why. Quote at most three lines of code.
6. If the developer asks something new, answer that first, then go back to \
the task.
7. Do not run the full test suite more than once per task; run one test \
module when you can.
8. Never invent a tool result. If a tool fails, say so and try another way.
"""

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a text file of the repository",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}},
                "required": ["path"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search_code",
            "description": "Find lines that match a word",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}},
                "required": ["query"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "run_tests",
            "description": "Run one test module",
            "parameters": {
                "type": "object",
                "properties": {"target": {"type": "string"}},
                "required": ["target"],
            },
        },
    },
]

USER_REQUEST = (
    "The harbour ledger test started failing this morning after the last merge. "
    "Find out why and tell me which line is wrong."
)
FOLLOW_UP_USER = "Wait, before you go on: is the ledger also used by the night report?"
# The other agents of the interleaved mode: same system prompt, own requests.
AGENT_REQUESTS = [
    USER_REQUEST,
    "The night report shows one ship too few since yesterday. Find the cause.",
    "A developer says the ship counter ignores midnight arrivals. Check it and point at the line.",
    "Our release notes claim the ledger counts every arrival. Verify that with the tests.",
    "The harbour dashboard total disagrees with the ledger. Which one is wrong, and where?",
    "Review the last merge to the ledger module and tell me what it broke, if anything.",
]

# (tool name, arguments, result) for tool rounds 1, 2, ...; cycled if more are needed.
TOOL_ROUNDS: list[tuple[str, dict[str, str], str]] = [
    (
        "run_tests",
        {"target": "tests/test_ledger.py"},
        "1 failed, 11 passed. test_ships_counted: assert ledger.count() == 3, "
        "got 2. The ship that came in at midnight is missing.",
    ),
    (
        "search_code",
        {"query": "def count"},
        "ledger.py:41: def count(self) -> int:\nreport.py:12: def count_night(ledger):",
    ),
    (
        "read_file",
        {"path": "ledger.py"},
        "40 class Ledger:\n41     def count(self) -> int:\n"
        "42         return sum(1 for s in self.ships if s.hour < 24 and s.hour > 0)",
    ),
    (
        "search_code",
        {"query": "hour"},
        "ledger.py:42: s.hour < 24 and s.hour > 0\nship.py:8: hour: int  # 0 is midnight",
    ),
    (
        "read_file",
        {"path": "ship.py"},
        "7 class Ship:\n8     hour: int  # 0 is midnight\n9     name: str\n10     cargo: list[str]",
    ),
    (
        "run_tests",
        {"target": "tests/test_ship.py"},
        "4 passed, 0 failed. test_hours: ships can arrive at any hour from 0 to 23; "
        "hour 0 is midnight and is a valid arrival time.",
    ),
    (
        "search_code",
        {"query": "Ledger("},
        "report.py:5: ledger = Ledger(ships)\nharbour.py:20: self.ledger = Ledger([])",
    ),
    (
        "read_file",
        {"path": "report.py"},
        "12 def count_night(ledger):\n13     return ledger.count() - ledger.count_day()\n"
        "14 # the night report uses the same filter",
    ),
    (
        "run_tests",
        {"target": "tests/test_report.py"},
        "1 failed, 3 passed. test_night_ships: expected 1 ship at night, got 0. "
        "The ship at hour 0 is not counted by the ledger.",
    ),
    (
        "read_file",
        {"path": "tests/test_ledger.py"},
        "30 def test_ships_counted():\n31     ledger = Ledger([Ship(0), Ship(5), Ship(23)])\n"
        "32     assert ledger.count() == 3",
    ),
    (
        "search_code",
        {"query": "s.hour > 0"},
        "ledger.py:42 only. The last merge changed s.hour >= 0 into s.hour > 0.",
    ),
]
WARMUP_MESSAGES = [{"role": "user", "content": "Say hello."}]


@attrs.frozen
class TurnSpec:
    turn: int
    thinking: bool
    add_user: bool
    restart: bool = False

    @property
    def label(self) -> str:
        if self.turn == 1:
            return "sys+user"
        parts = ["tool"]
        if self.add_user:
            parts.append("+user")
        if not self.thinking:
            parts.append(" think=off")
        if self.restart:
            parts.insert(0, "RESTART ")
        return "".join(parts)


def turn_plan(turns: int, think_off_turn: int, user_turn: int) -> list[TurnSpec]:
    """Turns 1..turns, then the restart turn (turns + 1)."""
    specs = [
        TurnSpec(t, thinking=t != think_off_turn, add_user=t == user_turn and t > 1)
        for t in range(1, turns + 1)
    ]
    specs.append(TurnSpec(turns + 1, thinking=True, add_user=False, restart=True))
    return specs


def tool_round(n: int, reply: str, thinking: bool) -> list[dict[str, Any]]:
    """Tool round ``n`` (1-based): the previous reply with its tool call, and the
    tool's result. A thinking reply is replayed as ``reasoning_content``, a
    non-thinking one as ``content`` (where each came back from the server)."""
    name, arguments, result = TOOL_ROUNDS[(n - 1) % len(TOOL_ROUNDS)]
    call_id = f"call_{n}"
    call = {
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments)},
    }
    assistant: dict[str, Any] = {"role": "assistant", "tool_calls": [call]}
    if thinking:
        assistant.update(content="", reasoning_content=reply)
    else:
        assistant.update(content=reply)
    return [assistant, {"role": "tool", "tool_call_id": call_id, "content": result}]


def initial_messages(agent: int = 0) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": AGENT_REQUESTS[agent % len(AGENT_REQUESTS)]},
    ]


# --- client-side reference tokenization --------------------------------------


class Reference:
    """The model's own tokenizer and chat template, client-side: the rendered
    prompt of a turn, and the whole-word logit bias."""

    def __init__(self, model_dir: Path) -> None:
        from tokenizers import Tokenizer
        from transformers import AutoTokenizer

        self._hf = AutoTokenizer.from_pretrained(str(model_dir))
        raw = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        ids = []
        for i in range(raw.get_vocab_size()):
            text = raw.decode([i])
            if re.fullmatch(r" [a-z]{3,}", text) and raw.encode(text).ids == [i]:
                ids.append(i)
        self.word_bias: dict[str, float] = {str(i): 100.0 for i in ids[:_MAX_BIAS]}

    def prompt(self, messages: list[dict[str, Any]], thinking: bool) -> list[int]:
        out = self._hf.apply_chat_template(
            messages,
            tools=TOOLS,
            add_generation_prompt=True,
            tokenize=True,
            enable_thinking=thinking,
        )
        ids = out["input_ids"] if hasattr(out, "keys") else out
        return [int(i) for i in ids]

    def encode(self, text: str) -> list[int]:
        return [int(i) for i in self._hf.encode(text, add_special_tokens=False)]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


# --- results ------------------------------------------------------------------


@attrs.define
class TurnResult:
    turn: int
    label: str
    thinking: bool
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_s: float
    total_s: float
    reply: str
    ref_prompt_tokens: int  # client-side rendering of the same messages
    min_prefill: int  # prompt tokens after the common prefix with previous prompt+reply
    cache_log: list[str] = attrs.Factory(list)  # gezel prompt-cache lines
    agent: int = 0

    @property
    def prefilled(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    @property
    def cache_decision(self) -> str:
        """gezel's ``seed`` line, shortened to ``source/mode``."""
        for line in self.cache_log:
            if " seed cache_id=" in line or " seed fallback" in line:
                src = re.search(r"source=(\S+)", line)
                mode = re.search(r"mode=(\S+)", line)
                if src and mode:
                    return f"{src.group(1)}/{mode.group(1)}"
        return "-"


@attrs.define
class SystemRun:
    model: str
    system: str
    turns: list[TurnResult] = attrs.Factory(list)
    stop_exit_codes: list[int | None] = attrs.Factory(list)
    stop_seconds: list[float] = attrs.Factory(list)
    startup_seconds: list[float] = attrs.Factory(list)
    wall_s: float = 0.0

    cache_bytes: int | None = None  # the prompt cache after the last turn before the restart
    error: str | None = None  # a coding-agent shape the server refused (the turns before it stay)

    def turn(self, n: int) -> TurnResult | None:
        """Turn ``n``; with several agents, their sums (TTFT: the median)."""
        ts = [t for t in self.turns if t.turn == n]
        if len(ts) <= 1:
            return ts[0] if ts else None
        return TurnResult(
            turn=n,
            label=ts[0].label,
            thinking=ts[0].thinking,
            prompt_tokens=sum(t.prompt_tokens for t in ts),
            cached_tokens=sum(t.cached_tokens for t in ts),
            completion_tokens=sum(t.completion_tokens for t in ts),
            ttft_s=statistics.median(t.ttft_s for t in ts),
            total_s=statistics.median(t.total_s for t in ts),
            reply="",
            ref_prompt_tokens=sum(t.ref_prompt_tokens for t in ts),
            min_prefill=sum(t.min_prefill for t in ts),
            cache_log=[line for t in ts for line in t.cache_log],
        )


# --- servers --------------------------------------------------------------------


def gezel_flags(persist_dir: Path, args: Any) -> list[str]:
    return [
        "--max-concurrency", str(args.concurrency),
        "--prefill-step-size", str(args.prefill_step_size),
        "--persist-dir", str(persist_dir),
        "--log-level", args.gezel_log_level,
    ]  # fmt: skip


def mlx_flags(args: Any) -> list[str]:
    return [
        "--decode-concurrency", str(args.concurrency),
        "--prompt-concurrency", str(args.concurrency),
        "--prefill-step-size", str(args.prefill_step_size),
        "--log-level", args.mlx_log_level,
    ]  # fmt: skip


@contextmanager
def serve(
    system: str, model_dir: Path, persist_dir: Path, log: Path, args: Any
) -> Iterator[Server]:
    """gezel is stopped with SIGTERM (drain + flush to disk); ``mlx_lm.server``
    with SIGINT, then SIGKILL (its prompt cache lives in memory only) and is
    started through the launcher that logs its cache bytes."""
    if system == "gezel":
        with _servers.gezel_server(
            model_dir,
            log,
            gezel_flags(persist_dir, args),
            stop_signal=signal.SIGTERM,
            stop_timeout=_STOP_TIMEOUT_S,
        ) as srv:
            yield srv
    else:
        with _servers.mlx_server(
            model_dir, log, mlx_flags(args), stop_timeout=_MLX_STOP_TIMEOUT_S, cache_stats=True
        ) as srv:
            yield srv


# --- one request ------------------------------------------------------------------


def stream_chat(
    client: httpx.Client,
    server: Server,
    messages: list[dict[str, Any]],
    *,
    thinking: bool,
    max_tokens: int,
    bias: dict[str, float] | None,
    tools: bool = True,
    session: bool = True,
) -> _sse.StreamLog:
    """One streaming chat request; times are from just before it is sent."""
    body: dict[str, Any] = {
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "chat_template_kwargs": {"enable_thinking": thinking},
    }
    if tools:
        body["tools"] = TOOLS
    if bias:
        body["logit_bias"] = bias
    if server.system == "gezel":
        body["ignore_eos"] = True
        if session:
            body["cache_id"] = SESSION_ID
    try:
        log = _sse.stream(client, server.url, body)
    except RuntimeError as exc:
        raise RuntimeError(f"{server.system}: {exc}") from exc
    if not log.content or log.end is None or log.usage is None:
        raise RuntimeError(f"{server.system}: incomplete stream: {log.usage=} {log.content=}")
    return log


def cached_tokens(server: Server, log: _sse.StreamLog) -> int:
    usage = log.usage or {}
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens", usage.get("cached_tokens"))
    if cached is None:
        raise RuntimeError(f"{server.system}: usage has no cached token count: {usage}")
    return int(cached)


# gezel's log format is "TIME LEVEL LOGGER: MESSAGE"; keep its prompt-cache and
# persistence lines and every warning or error.
_CACHE_LOG = re.compile(r" (WARNING|ERROR) | gezel_trio\.(cache|persist): ")


def _new_log_lines(log: Path, offset: int) -> list[str]:
    try:
        with log.open("rb") as f:
            f.seek(offset)
            data = f.read()
    except OSError:
        return []
    return [ln for ln in data.decode(errors="replace").splitlines() if _CACHE_LOG.search(ln)]


_MLX_CACHE_LINE = re.compile(r"gezel-bench prompt cache: (\d+) sequences, (\d+) bytes")


def cache_bytes(client: httpx.Client, server: Server) -> int | None:
    """The bytes the server's prompt cache holds now."""
    if server.system == "gezel":
        stats = client.get(f"{server.url}/v1/cache/stats").json()
        return int(stats["totals"]["bytes"])
    # mlx_lm.server logs its cache statistics before serving a request: send a
    # one-token probe that shares nothing with the sessions, then read the line.
    probe = [{"role": "user", "content": "Probe."}]
    stream_chat(
        client, server, probe, thinking=False, max_tokens=1, bias=None, tools=False, session=False
    )
    found = _MLX_CACHE_LINE.findall(server.log.read_text(errors="replace"))
    return int(found[-1][1]) if found else None


# --- one session on one system ---------------------------------------------------


@attrs.define
class _SessionState:
    messages: list[dict[str, Any]]
    held: list[int] = attrs.Factory(list)  # previous prompt + reply tokens
    reply: str = ""
    thinking: bool = True


def _run_turn(
    ctx: Context,
    client: httpx.Client,
    server: Server,
    spec: TurnSpec,
    state: _SessionState,
    ref: Reference,
    agent: int = 0,
) -> TurnResult:
    a = ctx.args
    restore_space = not a.no_word_bias and not a.replay_as_returned
    if spec.turn > 1:
        state.messages += tool_round(spec.turn - 1, state.reply, state.thinking)
    if spec.add_user:
        state.messages.append({"role": "user", "content": FOLLOW_UP_USER})
    prompt = ref.prompt(state.messages, spec.thinking)
    shared = min(common_prefix(state.held, prompt), len(prompt) - 1) if state.held else 0
    offset = server.log.stat().st_size if server.system == "gezel" else 0
    log = stream_chat(
        client,
        server,
        state.messages,
        thinking=spec.thinking,
        max_tokens=a.tokens,
        bias=None if a.no_word_bias else ref.word_bias,
        session=a.mode == "session",
    )
    cache_log = _new_log_lines(server.log, offset) if server.system == "gezel" else []
    replay = log.text
    if restore_space and replay and not replay[0].isspace():
        # Both servers strip the reply's leading whitespace, but with the word
        # bias the first generated token is " word": put the space back so the
        # replay re-renders the tokens that were generated, as a trained
        # model's reply (which does not start with a space) would.
        replay = " " + replay
    state.held = prompt + ref.encode(replay)
    state.reply, state.thinking = replay, spec.thinking
    assert log.end is not None
    result = TurnResult(
        turn=spec.turn,
        label=spec.label,
        thinking=spec.thinking,
        prompt_tokens=log.usage_int("prompt_tokens") or 0,
        cached_tokens=cached_tokens(server, log),
        completion_tokens=log.usage_int("completion_tokens") or 0,
        ttft_s=log.content[0] - log.sent,
        total_s=log.end - log.sent,
        reply=log.text,
        ref_prompt_tokens=len(prompt),
        min_prefill=len(prompt) - shared,
        cache_log=cache_log,
        agent=agent,
    )
    who = f"{server.system} turn {spec.turn:>2}" + (f" agent {agent}" if a.agents > 1 else "")
    ctx.progress(
        f"{who} {spec.label:<22} prompt {result.prompt_tokens:>5}"
        f" cached {result.cached_tokens:>5} prefill {result.prefilled:>5}"
        f" TTFT {result.ttft_s:6.2f}s total {result.total_s:6.2f}s gen {result.completion_tokens}"
        + (f"  {result.cache_decision}" if server.system == "gezel" else "")
    )
    return result


def run_session(
    ctx: Context, model: str, model_dir: Path, system: str, specs: list[TurnSpec], ref: Reference
) -> SystemRun:
    a = ctx.args
    run = SystemRun(model=model, system=system)
    persist = ctx.workdir / f"{model}-{system}-persist"  # gezel's --persist-dir
    if system == "gezel":
        persist.mkdir(parents=True, exist_ok=True)
    states = [_SessionState(initial_messages(i)) for i in range(a.agents)]
    t_run = time.monotonic()
    phases = [[s for s in specs if not s.restart], [s for s in specs if s.restart]]
    for phase, phase_specs in enumerate(phases):
        log = ctx.workdir / f"{model}-{system}-{'first' if phase == 0 else 'restart'}.log"
        t0 = time.monotonic()
        with serve(system, model_dir, persist, log, a) as srv:
            run.startup_seconds.append(time.monotonic() - t0)
            with httpx.Client(timeout=_sse.REQUEST_TIMEOUT_S) as client:
                if not a.no_warmup:
                    stream_chat(
                        client,
                        srv,
                        WARMUP_MESSAGES,
                        thinking=False,
                        max_tokens=2,
                        bias=None,
                        tools=False,
                        session=False,
                    )
                for spec in phase_specs:
                    for agent, state in enumerate(states):
                        run.turns.append(_run_turn(ctx, client, srv, spec, state, ref, agent))
                if phase == 0:
                    run.cache_bytes = cache_bytes(client, srv)
        run.stop_exit_codes.append(srv.exit_code)
        run.stop_seconds.append(srv.stop_s)
        if srv.exit_code != 0:
            ctx.progress(
                f"{system}: exit code {srv.exit_code} after stop\n{_servers.tail(log, 15)}"
            )
    run.wall_s = time.monotonic() - t_run
    return run


# --- report -------------------------------------------------------------------------


def summary(runs: dict[str, SystemRun], turns: int) -> dict[str, Any]:
    """The gezel / mlx_lm.server ratios of one model (None where a side is missing)."""
    out: dict[str, Any] = {}
    warm = range(2, turns + 1)
    per: dict[str, dict[str, Any]] = {}
    for system, run in runs.items():
        ws = [t for t in run.turns if t.turn in warm]
        rs = run.turn(turns + 1)
        per[system] = {
            "prefilled_turns_2_n": sum(t.prefilled for t in ws),
            "min_prefill_turns_2_n": sum(t.min_prefill for t in ws),
            "median_ttft_turns_2_n": statistics.median(t.ttft_s for t in ws) if ws else None,
            "restart_ttft": rs.ttft_s if rs else None,
            "restart_cached": rs.cached_tokens if rs else None,
            "restart_prompt": rs.prompt_tokens if rs else None,
            "cache_bytes": run.cache_bytes,
        }
    out["per_system"] = per
    g, m = runs.get("gezel"), runs.get("mlx_lm.server")
    if g is None or m is None:
        return out
    pg, pm = per["gezel"], per["mlx_lm.server"]
    turn_ratios = []
    for n in warm:
        tg, tm = g.turn(n), m.turn(n)
        if tg and tm and tm.ttft_s > 0:
            turn_ratios.append(tg.ttft_s / tm.ttft_s)
    out["ratios"] = {
        "prefilled_turns_2_n": ratio(pg["prefilled_turns_2_n"], pm["prefilled_turns_2_n"]),
        "median_ttft_turns_2_n": ratio(pg["median_ttft_turns_2_n"], pm["median_ttft_turns_2_n"]),
        "median_of_turn_ttft_ratios": statistics.median(turn_ratios) if turn_ratios else None,
        "restart_ttft": ratio(pg["restart_ttft"], pm["restart_ttft"]),
        "cache_bytes": ratio(pg["cache_bytes"], pm["cache_bytes"]),
    }
    return out


_SHORT = {"gezel": "gezel", "mlx_lm.server": "mlx"}


def turn_table(model: str, runs: dict[str, SystemRun]) -> Table:
    systems = [s for s in SYSTEMS if s in runs]
    n_max = max((t.turn for r in runs.values() for t in r.turns), default=0)
    header = ["turn:d", "request", "min:d"]
    for s in systems:
        p = _SHORT[s]
        header += [f"{p} prompt", f"{p} cached:d", f"{p} prefill:d", f"{p} TTFT s:.2f",
                   f"{p} total s:.2f", f"{p} gen:d"]  # fmt: skip
        if s == "gezel":
            header.append("gezel cache")
    rows = []
    for n in range(1, n_max + 1):
        label, floor = "", None
        row: list[Any] = []
        for s in systems:
            t = runs[s].turn(n)
            if t is None:
                row += [None] * (7 if s == "gezel" else 6)
                continue
            label, floor = t.label, t.min_prefill
            mismatch = "*" if t.ref_prompt_tokens != t.prompt_tokens else ""
            row += [f"{t.prompt_tokens}{mismatch}", t.cached_tokens, t.prefilled, t.ttft_s,
                    t.total_s, t.completion_tokens]  # fmt: skip
            if s == "gezel":
                row.append(t.cache_decision)
        rows.append((n, label, floor, *row))
    return table(
        f"{model}: per turn",
        " | ".join(header),
        rows,
        "prefill = prompt - cached; min = prompt tokens after the common prefix with the "
        "previous turn's prompt + reply (client-side rendering); * = the client-side prompt "
        "length differs from the server's; gezel cache = its seed decision (source/mode).",
    )


def summary_table(model: str, runs: dict[str, SystemRun], turns: int) -> Table:
    summ = summary(runs, turns)
    rows = []
    for system in [s for s in SYSTEMS if s in runs]:
        p = summ["per_system"][system]
        run = runs[system]
        codes = ", ".join("killed" if c is None else str(c) for c in run.stop_exit_codes)
        cache = p["cache_bytes"] / 2**20 if p["cache_bytes"] is not None else None
        rows.append(
            (
                system, p["prefilled_turns_2_n"], p["min_prefill_turns_2_n"],
                p["median_ttft_turns_2_n"], f"{p['restart_cached']}/{p['restart_prompt']}",
                p["restart_ttft"], cache, codes,
                ", ".join(f"{x:.1f}" for x in run.stop_seconds),
                ", ".join(f"{x:.1f}" for x in run.startup_seconds),
            )
        )  # fmt: skip
    notes = ["The ratio row is gezel / mlx_lm.server (below 1: gezel better)."]
    r = summ.get("ratios")
    if r:
        rows.append(
            (
                "gezel / mlx_lm.server", r["prefilled_turns_2_n"], None,
                r["median_ttft_turns_2_n"], None, r["restart_ttft"], r["cache_bytes"], "", "", "",
            )
        )  # fmt: skip
        per_turn = r["median_of_turn_ttft_ratios"]
        if per_turn is not None:
            notes.append(f"Median of the per-turn TTFT ratios, turns 2-{turns}: {per_turn:.3f}.")
    return table(
        f"{model}: summary",
        f"system | prefilled turns 2-{turns} | min | median TTFT s turns 2-{turns}:.3f"
        f" | restart cached/prompt | restart TTFT s:.3f | cache MiB after turn {turns}:.3f"
        " | stop exit | stop s | startup s",
        rows,
        *notes,
    )


def plots(results: dict[str, dict[str, SystemRun]]) -> list[Plot]:
    out = []
    for model, runs in results.items():
        prefill: list[Series] = []
        ttft: list[Series] = []
        for system, run in runs.items():
            turns = sorted({t.turn for t in run.turns})
            ts = [run.turn(n) for n in turns]
            prefill.append(Series(system, turns, [t.prefilled if t else None for t in ts]))
            ttft.append(Series(system, turns, [t.ttft_s if t else None for t in ts]))
        if runs:
            ref = next(iter(runs.values()))
            turns = sorted({t.turn for t in ref.turns})
            floor = [t.min_prefill if (t := ref.turn(n)) else None for n in turns]
            prefill.append(Series("min (client-side reference)", turns, floor, ":"))
        last = max((t.turn for r in runs.values() for t in r.turns), default=0)
        xlabel = f"turn ({last}: after the restart)"
        out.append(Plot(f"{model}: prefilled tokens per turn", xlabel, "tokens", tuple(prefill)))
        out.append(Plot(f"{model}: time to first token per turn", xlabel, "TTFT s", tuple(ttft)))
    systems = list(dict.fromkeys(s for runs in results.values() for s in runs))
    out.append(
        Plot(
            "Prompt-cache bytes after the last turn before the restart",
            "model",
            "MiB",
            tuple(
                Series(
                    s,
                    list(results),
                    [
                        (b / 2**20 if (b := runs[s].cache_bytes) is not None else None)
                        if s in runs
                        else None
                        for runs in results.values()
                    ],
                )
                for s in systems
            ),
            kind="bar",
        )
    )
    return out


# --- the coding agents' recorded shapes (--mode claude-code|codex) ----------------


def _sse_events(
    client: httpx.Client, url: str, body: dict[str, Any], headers: dict[str, str]
) -> Iterator[tuple[float, dict[str, Any]]]:
    """POST ``body``, then each SSE ``data:`` payload with its arrival time."""
    with client.stream("POST", url, json=body, headers=headers) as resp:
        if resp.status_code != 200:
            resp.read()
            raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:500]}")
        for line in resp.iter_lines():
            if line.startswith("data:") and line[5:].strip() not in ("", "[DONE]"):
                yield time.perf_counter(), json.loads(line[5:])


@attrs.define
class _Reply:
    sent: float
    first: float | None = None
    end: float = 0.0
    prompt: int = 0
    cached: int = 0
    gen: int = 0
    items: list[dict[str, Any]] = attrs.Factory(list)  # content blocks / output items
    text: str = ""


def _gezel_claude(client: httpx.Client, server: Server, body: dict[str, Any]) -> _Reply:
    """One Claude Code request on ``/v1/messages``, its stream folded into the
    reply's content blocks as Claude Code folds them."""
    blocks: dict[int, dict[str, Any]] = {}
    partial: dict[int, str] = {}
    headers = {**shapes.CC_HTTP_HEADERS, "anthropic-version": "2023-06-01"}
    reply = _Reply(sent=time.perf_counter())
    for now, ev in _sse_events(client, f"{server.url}/v1/messages", body, headers):
        kind = ev.get("type")
        if kind == "error":
            raise RuntimeError(f"gezel: stream error: {ev}")
        if kind == "content_block_start":
            blocks[ev["index"]] = dict(ev["content_block"])
        elif kind == "content_block_delta":
            reply.first = reply.first if reply.first is not None else now
            d, block = ev["delta"], blocks[ev["index"]]
            if d["type"] == "text_delta":
                block["text"] = block.get("text", "") + d["text"]
            elif d["type"] == "thinking_delta":
                block["thinking"] = block.get("thinking", "") + d["thinking"]
            elif d["type"] == "signature_delta":
                block["signature"] = d["signature"]
            elif d["type"] == "input_json_delta":
                partial[ev["index"]] = partial.get(ev["index"], "") + d["partial_json"]
        elif kind == "message_delta":
            u = ev.get("usage") or {}
            reply.cached = int(u.get("cache_read_input_tokens") or 0)
            # Anthropic's arithmetic: the prompt is what was computed, what
            # was written into cache_control pins and what was read.
            written = int(u.get("cache_creation_input_tokens") or 0)
            reply.prompt = int(u.get("input_tokens") or 0) + written + reply.cached
            reply.gen = int(u.get("output_tokens") or 0)
        reply.end = now
    for i, text in partial.items():
        blocks[i]["input"] = json.loads(text or "{}")
    reply.items = [blocks[i] for i in sorted(blocks)]
    reply.text = "".join(str(b.get("text", "")) for b in reply.items)
    return reply


def _gezel_codex(client: httpx.Client, server: Server, body: dict[str, Any]) -> _Reply:
    """One Codex request on ``/v1/responses``: the final response's output
    items and usage; the first ``*.delta`` event is the first token."""
    reply = _Reply(sent=time.perf_counter())
    final: dict[str, Any] | None = None
    for now, ev in _sse_events(client, f"{server.url}/v1/responses", body, {}):
        kind = str(ev.get("type"))
        if kind in ("error", "response.failed"):
            raise RuntimeError(f"gezel: stream error: {ev}")
        if kind.endswith(".delta") and reply.first is None:
            reply.first = now
        if kind in ("response.completed", "response.incomplete"):
            final = ev["response"]
        reply.end = now
    if final is None:
        raise RuntimeError("gezel: the stream ended without a final response")
    u = final.get("usage") or {}
    reply.prompt = int(u.get("input_tokens") or 0)
    reply.cached = int((u.get("input_tokens_details") or {}).get("cached_tokens") or 0)
    reply.gen = int(u.get("output_tokens") or 0)
    reply.items = list(final.get("output") or [])
    reply.text = "".join(
        str(c.get("text", ""))
        for item in reply.items
        if item.get("type") == "message"
        for c in item.get("content") or []
    )
    return reply


def _mlx_chat(
    client: httpx.Client, server: Server, mode: str, body: dict[str, Any], max_tokens: int
) -> _Reply:
    """The same request as chat completions on ``mlx_lm.server``; the reply
    is replayed as text (a text block / an assistant message)."""
    chat = (
        shapes.anthropic_to_chat(body) if mode == "claude-code" else shapes.responses_to_chat(body)
    )
    chat.update(max_tokens=max_tokens, stream=True, stream_options={"include_usage": True})
    log = _sse.stream(client, server.url, chat)
    if log.end is None or log.usage is None:
        raise RuntimeError(f"mlx_lm.server: incomplete stream: {log.usage=}")
    reply = _Reply(sent=log.sent, first=log.first, end=log.end, text=log.text)
    reply.prompt = log.usage_int("prompt_tokens") or 0
    reply.cached = cached_tokens(server, log)
    reply.gen = log.usage_int("completion_tokens") or 0
    if mode == "claude-code":
        reply.items = [{"type": "text", "text": log.text}]
    else:
        content = [{"type": "output_text", "text": log.text}]
        reply.items = [{"type": "message", "role": "assistant", "content": content}]
    return reply


def _shape_label(mode: str, session: Any, step: int) -> str:
    if step == 1:
        return "task"
    if mode == "claude-code":
        last = session.messages[-1]
        if last["role"] == "system":
            return "tool+system"
        blocks = last["content"] if isinstance(last["content"], list) else []
        return "tool" if any(b.get("type") == "tool_result" for b in blocks) else "+user"
    last = session.input[-1]
    return "tool output" if str(last.get("type")).endswith("_output") else "+user"


def run_shape_session(
    ctx: Context, model: str, model_dir: Path, system: str, mode: str
) -> SystemRun:
    """``--turns`` requests of one coding agent's shape on one system."""
    a = ctx.args
    run = SystemRun(model=model, system=system)
    session: Any
    if mode == "claude-code":
        session = shapes.ClaudeCodeSession(
            max_tokens=a.tokens, prev_req=True, system_at=3, follow_up_at=a.user_turn
        )
    else:
        session = shapes.CodexSession(max_output_tokens=a.tokens)
    persist = ctx.workdir / f"{model}-{system}-{mode}-persist"
    persist.mkdir(parents=True, exist_ok=True)
    log = ctx.workdir / f"{model}-{system}-{mode}.log"
    t_run = time.monotonic()
    t0 = time.monotonic()
    with serve(system, model_dir, persist, log, a) as srv:
        run.startup_seconds.append(time.monotonic() - t0)
        with httpx.Client(timeout=_sse.REQUEST_TIMEOUT_S) as client:
            if not a.no_warmup:
                stream_chat(client, srv, WARMUP_MESSAGES, thinking=False, max_tokens=2,
                            bias=None, tools=False, session=False)  # fmt: skip
            for step in range(1, a.turns + 1):
                label = _shape_label(mode, session, step)
                body = session.request()
                offset = srv.log.stat().st_size if system == "gezel" else 0
                try:
                    if system == "gezel":
                        go = _gezel_claude if mode == "claude-code" else _gezel_codex
                        reply = go(client, srv, body)
                    else:
                        reply = _mlx_chat(client, srv, mode, body, a.tokens)
                except RuntimeError as exc:
                    # A refused shape is a result (Codex could not start), not a crash.
                    run.error = f"turn {step}: {exc}"
                    ctx.progress(f"{system} {mode}: {run.error}")
                    break
                session.record(reply.items)
                first = reply.first if reply.first is not None else reply.end
                result = TurnResult(
                    turn=step,
                    label=label,
                    thinking=False,
                    prompt_tokens=reply.prompt,
                    cached_tokens=reply.cached,
                    completion_tokens=reply.gen,
                    ttft_s=first - reply.sent,
                    total_s=reply.end - reply.sent,
                    reply=reply.text,
                    ref_prompt_tokens=reply.prompt,
                    min_prefill=0,
                    cache_log=_new_log_lines(srv.log, offset) if system == "gezel" else [],
                )
                run.turns.append(result)
                ctx.progress(
                    f"{system} {mode} turn {step:>2} {label:<12} prompt {result.prompt_tokens:>5}"
                    f" cached {result.cached_tokens:>5} prefill {result.prefilled:>5}"
                    f" TTFT {result.ttft_s:6.2f}s total {result.total_s:6.2f}s"
                    f" gen {result.completion_tokens}"
                )
            run.cache_bytes = cache_bytes(client, srv)
    run.stop_exit_codes.append(srv.exit_code)
    run.stop_seconds.append(srv.stop_s)
    run.wall_s = time.monotonic() - t_run
    return run


def shape_tables(model: str, mode: str, runs: dict[str, SystemRun], turns: int) -> list[Table]:
    systems = [s for s in SYSTEMS if s in runs]
    header = ["turn:d", "request"]
    for s in systems:
        p = _SHORT[s]
        header += [f"{p} prompt:d", f"{p} cached:d", f"{p} prefill:d", f"{p} TTFT s:.2f",
                   f"{p} total s:.2f", f"{p} gen:d"]  # fmt: skip
    rows = []
    for n in range(1, turns + 1):
        label = ""
        row: list[Any] = []
        for s in systems:
            t = runs[s].turn(n)
            if t is None:
                row += [None] * 6
                continue
            label = t.label
            row += [t.prompt_tokens, t.cached_tokens, t.prefilled, t.ttft_s, t.total_s,
                    t.completion_tokens]  # fmt: skip
        rows.append((n, label, *row))
    per_turn = table(
        f"{model}: {mode}, per turn",
        " | ".join(header),
        rows,
        "prefill = prompt - cached. gezel gets the agent's own request; mlx_lm.server the "
        "same conversation as chat completions, each replaying its own replies.",
    )
    # A system that refused the shape has no figures (and no ratio), not zeros.
    summ = summary({s: r for s, r in runs.items() if r.error is None}, turns)
    srows: list[Any] = []
    for s in systems:
        p = summ["per_system"].get(s, {})
        srows.append((s, p.get("prefilled_turns_2_n"), p.get("median_ttft_turns_2_n")))
    r = summ.get("ratios")
    if r:
        srows.append(("gezel / mlx_lm.server", r["prefilled_turns_2_n"],
                      r["median_ttft_turns_2_n"]))  # fmt: skip
    summary_t = table(
        f"{model}: {mode}, summary",
        f"system | prefilled turns 2-{turns} | median TTFT s turns 2-{turns}:.3f",
        srows,
        "The ratio row is gezel / mlx_lm.server (below 1: gezel better).",
    )
    for s in systems:
        if runs[s].error:
            summary_t = attrs.evolve(
                summary_t, notes=(*summary_t.notes, f"{s} failed at {runs[s].error}")
            )
    return [per_turn, summary_t]


def run_shapes(ctx: Context) -> Result:
    a = ctx.args
    results: dict[str, dict[str, SystemRun]] = {}
    model_dirs: dict[str, Path] = {}
    tables: list[Table] = []
    plot_list: list[Plot] = []
    for model in a.models:
        model_dirs[model] = ctx.demo_model(model)
        results[model] = {}
        for system in a.systems:
            with ctx.phase(f"{model} / {system} / {a.mode}"):
                results[model][system] = run_shape_session(
                    ctx, model, model_dirs[model], system, a.mode
                )
        for sub in ctx.workdir.glob(f"{model}-*-persist"):
            for f in sorted(sub.rglob("*"), reverse=True):
                if f.is_file():
                    f.unlink()
        runs = results[model]
        tables += shape_tables(f"{model} ({model_dirs[model].name})", a.mode, runs, a.turns)
        turns = list(range(1, a.turns + 1))
        prefill, ttft = [], []
        for system, srun in runs.items():
            ts = [srun.turn(n) for n in turns]
            prefill.append(Series(system, turns, [t.prefilled if t else None for t in ts]))
            ttft.append(Series(system, turns, [t.ttft_s if t else None for t in ts]))
        plot_list.append(Plot(f"{model}: {a.mode} prefilled tokens", "turn", "tokens",
                              tuple(prefill)))  # fmt: skip
        plot_list.append(Plot(f"{model}: {a.mode} TTFT", "turn", "TTFT s", tuple(ttft)))
    data = {
        "models": {m: str(d) for m, d in model_dirs.items()},
        "mode": a.mode,
        "turns": a.turns,
        "max_tokens": a.tokens,
        "codex_commit": shapes.CODEX_COMMIT,
        "gezel_flags": gezel_flags(Path("PERSIST_DIR"), ctx.args),
        "mlx_lm_server_flags": mlx_flags(ctx.args),
        "results": {
            model: {
                "summary": summary(runs, a.turns),
                "systems": {
                    system: {
                        **attrs.asdict(srun),
                        "turns": [
                            {**attrs.asdict(t), "prefilled": t.prefilled} for t in srun.turns
                        ],
                    }
                    for system, srun in runs.items()
                },
            }
            for model, runs in results.items()
        },
    }
    return Result(
        data,
        tables,
        plot_list,
        title=f"mode {a.mode}, {a.turns} turns, max_tokens {a.tokens}",
    )


# --- the run ---------------------------------------------------------------------


CLIENT_PROMPTS = (
    "Say hello in one word.",
    "What does calc.py define? One line.",
    "Thanks. Now say goodbye.",
)
CLIENT_WINDOW = 262144


def _long_window(model: Path, dest: Path) -> Path:
    """A copy of the demo model whose window holds a coding agent's prompt
    (the demo models' 32,768 is under Claude Code's first request)."""
    if not dest.exists():
        shutil.copytree(model, dest)
        config = json.loads((dest / "config.json").read_text())
        config["max_position_embeddings"] = CLIENT_WINDOW
        (dest / "config.json").write_text(json.dumps(config))
    return dest


def run_client(ctx: Context) -> Result:
    a = ctx.args
    bin_dir = Path(a.clients_bin)
    if not real.installed(bin_dir, a.client):
        raise ValueError(f"{a.client} is not installed in {bin_dir} (--clients-bin)")
    prompts = [CLIENT_PROMPTS[i % len(CLIENT_PROMPTS)] for i in range(a.turns)]

    def drive(url: str) -> list[real.ClientTurn]:
        workdir = ctx.workdir / a.client
        return real.run_client(
            a.client, bin_dir, url, workdir, prompts, a.tokens, progress=ctx.progress
        )

    model: Path | str
    if a.server_url:
        model = a.server_url
        with ctx.phase(a.client):
            turns = drive(a.server_url)
    else:
        model = _long_window(ctx.demo_model("dense"), ctx.workdir / "dense-long-window")
        log = ctx.workdir / "gezel.log"
        flags = [
            "--log-level", a.gezel_log_level,
            "--max-concurrency", str(a.concurrency),
            # Codex names no max_output_tokens: the default caps its replies.
            "--max-tokens-default", str(a.tokens),
        ]  # fmt: skip
        with ctx.phase(a.client), _servers.gezel_server(model, log, flags) as server:
            turns = drive(server.url)
    rows = [
        (
            t.turn,
            t.requests,
            " ".join(map(str, t.statuses)),
            t.prompt,
            t.cached,
            t.ttft_s,
            t.total_s,
            t.exit_code,
            "yes" if t.completed else "no",
        )
        for t in turns
    ]
    table_ = Table(
        f"{a.client}: one session, {a.turns} turns",
        ("turn", "requests", "statuses", "prompt", "cached", "TTFT s", "CLI s", "exit", "done"),
        rows,
        ("", "", "", "", "", ".1f", ".1f", "", ""),
        notes=(
            "prompt, cached, TTFT: the turn's own request (the CLI sends side requests too)",
            "done: every request answered 200 and the CLI exited 0; a reply cut at the "
            "output cap makes Claude Code and Codex exit 1",
        ),
    )
    data = {"client": a.client, "turns": [attrs.asdict(t) for t in turns], "model": str(model)}
    return Result(data, [table_], [], title=f"real client {a.client}, {a.turns} turns")


def run(ctx: Context) -> Result:
    a = ctx.args
    if a.turns < 2 or a.tokens < 1:
        raise ValueError("--turns >= 2 and --tokens >= 1 are required")
    if a.client is not None:
        return run_client(ctx)
    if a.mode in SHAPE_MODES:
        return run_shapes(ctx)
    agents = a.agents if a.agents is not None else (4 if a.mode == "interleaved" else 1)
    if agents > 1 and a.mode != "interleaved":
        raise ValueError("--agents > 1 needs --mode interleaved")
    ctx.options = {**ctx.options, "agents": agents}
    specs = turn_plan(a.turns, a.think_off_turn, a.user_turn)
    results: dict[str, dict[str, SystemRun]] = {}
    model_dirs: dict[str, Path] = {}
    for model in a.models:
        model_dirs[model] = ctx.demo_model(model)
        ref = Reference(model_dirs[model])
        results[model] = {}
        for system in a.systems:
            with ctx.phase(f"{model} / {system}"):
                results[model][system] = run_session(
                    ctx, model, model_dirs[model], system, specs, ref
                )
        for sub in ctx.workdir.glob(f"{model}-*-persist"):
            # The disk cache files are big and of no use afterwards (--log-dir keeps the logs).
            for f in sorted(sub.rglob("*"), reverse=True):
                if f.is_file():
                    f.unlink()
    data = {
        "models": {m: str(d) for m, d in model_dirs.items()},
        "mode": a.mode,
        "agents": agents,
        "turns": a.turns,
        "max_tokens": a.tokens,
        "think_off_turn": a.think_off_turn,
        "user_turn": a.user_turn,
        "word_bias": not a.no_word_bias,
        "warmup": not a.no_warmup,
        "leading_space_restored": not a.no_word_bias and not a.replay_as_returned,
        "gezel_flags": gezel_flags(Path("PERSIST_DIR"), ctx.args),
        "mlx_lm_server_flags": mlx_flags(ctx.args),
        "results": {
            model: {
                "summary": summary(runs, a.turns),
                "systems": {
                    system: {
                        **attrs.asdict(run),
                        "turns": [{**attrs.asdict(t), "prefilled": t.prefilled} for t in run.turns],
                    }
                    for system, run in runs.items()
                },
            }
            for model, runs in results.items()
        },
    }
    tables = []
    for model, runs in results.items():
        name = f"{model} ({model_dirs[model].name})"
        tables += [turn_table(name, runs), summary_table(name, runs, a.turns)]
    return Result(
        data,
        tables,
        plots(results),
        title=(
            f"mode {a.mode}, {agents} agent(s), {a.turns} turns + restart, max_tokens {a.tokens}, "
            f"thinking off at turn {a.think_off_turn or '-'}, new user message at turn "
            f"{a.user_turn or '-'}, word bias {'off' if a.no_word_bias else 'on'}"
        ),
    )


SCENARIO = Scenario(
    name="agent",
    doc=__doc__ or "",
    run=run,
    options=(
        Option(
            "mode",
            "session",
            "agent mode",
            str,
            None,
            ("session", "anonymous", "interleaved", *SHAPE_MODES),
        ),
        Option("agents", None, "agents of the interleaved mode (default 4)", int),
        Option("client", None, "drive this real CLI instead", str, None, real.CLIENTS),
        Option(
            "clients_bin",
            os.environ.get("GEZEL_CLIENTS_BIN", "node_modules/.bin"),
            "folder of the installed CLIs (claude, codex, opencode)",
        ),
        Option("server_url", None, "--client: drive it against this running server"),
        Option("models", list(MODELS), "demo model kinds", str, "+", MODELS),
        Option("systems", list(SYSTEMS), "systems to run", str, "+", SYSTEMS),
        Option("turns", 10, "turns before the restart (>= 2)", int, quick=6),
        Option("tokens", 16, "max_tokens per turn", int, quick=8),
        Option("think_off_turn", 5, "turn sent with thinking off (0: never)", int, quick=3),
        Option("user_turn", 8, "turn that adds a user message (0: never)", int, quick=5),
        Option("concurrency", 4, "server concurrency", int),
        Option("prefill_step_size", 512, "server prefill step size", int),
        Option("gezel_log_level", "INFO", "gezel's log level (INFO: its cache decisions)"),
        Option("mlx_log_level", "WARNING", "mlx_lm.server's log level"),
        Option("no_word_bias", False, "no whole-word logit bias", kind="flag"),
        Option("replay_as_returned", False, "replay replies as returned (no space)", kind="flag"),
        Option("no_warmup", False, "no warm-up request after a start", kind="flag"),
    ),
)
