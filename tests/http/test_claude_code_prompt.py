"""Claude Code's prompt as it really arrives, through the ``anthropic`` SDK
on the shared servers of both demo models and the default model: its
billing line (a per-request hash) is dropped before rendering, so the next
turn reads the whole previous prompt from the cache, less at most one
64-token block."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

import httpx2 as httpx
import pytest

from tests.support.process import Server

if TYPE_CHECKING:
    pass

BLOCK = 64
NO_THINK = {"thinking": {"type": "disabled"}}
# A few hundred words of standing instructions, as a coding agent's system
# prompt has (Claude Code's is 15-30k tokens).
RULES = [
    f"- Rule {i}: read the file before editing it, keep changes small, and run "
    f"the tests of module {i} after each change."
    for i in range(40)
]
GUIDANCE = "\n".join(RULES)
# The default model prefills about 60 tokens a second on a loaded 2-core
# runner: a dozen rules (about 600 tokens, still past one 512-token prefill
# step) instead of forty (1,500 tokens, 25 s).
SHORT_GUIDANCE = "\n".join(RULES[:12])
TOOLS: list[Any] = [
    {
        "name": "Read",
        "description": "Read a file from the local filesystem.",
        "input_schema": {
            "type": "object",
            "properties": {"file_path": {"type": "string"}},
            "required": ["file_path"],
        },
    },
    {
        "name": "Bash",
        "description": "Run a shell command.",
        "input_schema": {
            "type": "object",
            "properties": {"command": {"type": "string"}},
            "required": ["command"],
        },
    },
]


def header(turn: int, prev: bool) -> str:
    line = f"x-anthropic-billing-header: cc_version=2.1.37.a{turn:02x}; cc_entrypoint=cli; "
    line += f"cch={(turn * 0x3A7F1) % 0xFFFFF:05x};"
    if prev:
        line += f" cc_prev_req=req_011C{turn:08d};"
    return line


def system(turn: int, prev: bool, guidance: str = GUIDANCE) -> list[dict[str, Any]]:
    """Claude Code's system blocks: the billing line is a block of its own
    (``cch``) or, in the newer variant, the second line of the first."""
    intro = "You are Claude Code, Anthropic's official CLI for Claude."
    if prev:
        first = {"type": "text", "text": f"{intro}\n{header(turn, prev)}"}
        return [first, {"type": "text", "text": guidance}]
    return [
        {"type": "text", "text": header(turn, prev)},
        {"type": "text", "text": intro},
        {"type": "text", "text": guidance, "cache_control": {"type": "ephemeral"}},
    ]


def _turns(
    server: Server, prev: bool, reminder: bool = False, guidance: str = GUIDANCE
) -> list[tuple[int, int]]:
    """Three turns; each turn's (prompt tokens, tokens read from the cache).
    ``reminder``: a ``system``-role message before each later user turn."""
    import anthropic

    client = anthropic.Anthropic(
        base_url=server.url, api_key="unused", max_retries=0, _strict_response_validation=True
    )
    messages: list[dict[str, Any]] = []
    out = []
    asks = ["List the files in src.", "Now read the README.", "Summarise it in one line."]
    for turn, ask in enumerate(asks):
        if reminder and turn:
            note = f"The user edited file {turn}.py since your last reply."
            messages.append({"role": "system", "content": note})
        messages.append({"role": "user", "content": ask})
        reply = client.messages.create(
            model="gezel",
            max_tokens=2,  # the reply's length is not what the turns check
            system=system(turn, prev, guidance),  # type: ignore[arg-type]
            tools=TOOLS,
            messages=messages,  # type: ignore[arg-type]
            extra_body={"temperature": 0},
            **NO_THINK,  # type: ignore[arg-type]
        )
        read = reply.usage.cache_read_input_tokens or 0
        written = reply.usage.cache_creation_input_tokens or 0
        out.append((reply.usage.input_tokens + written + read, read))
        text = "".join(b.text for b in reply.content if b.type == "text") or "ok"
        messages.append({"role": "assistant", "content": text})
    return out


def _check(turns: list[tuple[int, int]]) -> None:
    for (before, _), (_, read) in itertools.pairwise(turns):
        # The previous prompt, less at most the block its last token is in
        # (the reply after it is re-rendered by the template: not this test).
        assert read >= before - BLOCK, turns


@pytest.mark.slow
@pytest.mark.parametrize("prev", [False, True], ids=["cch", "cc_prev_req"])
def test_dense_model_turns_read_the_previous_prompt(dense_server: Server, prev: bool) -> None:
    _check(_turns(dense_server, prev))


@pytest.mark.slow
@pytest.mark.parametrize("prev", [False, True], ids=["cch", "cc_prev_req"])
def test_hybrid_model_turns_read_the_previous_prompt(hybrid_server: Server, prev: bool) -> None:
    _check(_turns(hybrid_server, prev))


@pytest.mark.slow
def test_default_model_turns_read_the_previous_prompt(smollm2_server: Server) -> None:
    _check(_turns(smollm2_server, prev=True, guidance=SHORT_GUIDANCE))


@pytest.mark.slow
@pytest.mark.parametrize("which", ["dense", "hybrid", "smollm2"])
def test_a_mid_conversation_system_message_keeps_the_prefix(
    which: str, request: pytest.FixtureRequest
) -> None:
    guidance = SHORT_GUIDANCE if which == "smollm2" else GUIDANCE
    _check(_turns(request.getfixturevalue(f"{which}_server"), True, True, guidance))


# A template that renders system messages only first (as Qwen's raise
# "System message must be at the beginning").
FIRST_ONLY = (
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and not loop.first %}"
    "{{- raise_exception('System message must be at the beginning.') }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.mark.slow
def test_a_template_that_refuses_later_system_messages_gets_reminders(
    dense_server: Server,
) -> None:
    """Over chat completions with that template: the request answers, and
    the turn after the reminder reads everything before it."""
    system_text = "You are a coding agent.\n" + GUIDANCE
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": system_text},
        {"role": "user", "content": "List the files."},
    ]
    extra = {"chat_template_override": FIRST_ONLY, "ignore_eos": True}
    first = dense_server.client.chat.completions.create(
        model="gezel", messages=messages, max_tokens=4, temperature=0, extra_body=extra
    )
    assert first.usage is not None
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content or ""},
        {"role": "developer", "content": "The user edited README.md."},
        {"role": "user", "content": "Read it."},
    ]
    second = dense_server.client.chat.completions.create(
        model="gezel", messages=messages, max_tokens=4, temperature=0, extra_body=extra
    )
    assert second.usage is not None
    assert second.usage.prompt_tokens_details is not None
    cached = second.usage.prompt_tokens_details.cached_tokens or 0
    assert cached >= first.usage.prompt_tokens - BLOCK, (first.usage, second.usage)


# --- cache_control pins ---------------------------------------------------------


def _pinned_system(ttl: str | None) -> list[dict[str, Any]]:
    control: dict[str, Any] = {"type": "ephemeral"}
    if ttl is not None:
        control["ttl"] = ttl
    return [{"type": "text", "text": "You pin.\n" + GUIDANCE, "cache_control": control}]


@pytest.mark.slow
@pytest.mark.parametrize("which", ["dense", "hybrid"])
def test_cache_control_pins_the_system_turn_and_reports_the_write(
    which: str, request: pytest.FixtureRequest
) -> None:
    import anthropic

    server: Server = request.getfixturevalue(f"{which}_server")
    client = anthropic.Anthropic(
        base_url=server.url, api_key="unused", max_retries=0, _strict_response_validation=True
    )
    ask: dict[str, Any] = dict(model="gezel", max_tokens=2, tools=TOOLS, **NO_THINK)
    system = _pinned_system("1h")
    system[0]["text"] += f"\n(pinned on the {which} model)"  # a prefix no test cached
    first = client.messages.create(
        system=system,  # type: ignore[arg-type]
        messages=[{"role": "user", "content": "One."}],
        **ask,
    )
    u = first.usage
    assert u.cache_creation is not None
    assert u.cache_creation.ephemeral_1h_input_tokens > 1000
    assert u.cache_creation.ephemeral_5m_input_tokens == 0
    assert u.cache_creation_input_tokens == u.cache_creation.ephemeral_1h_input_tokens
    pinned = u.cache_creation_input_tokens
    stats = httpx.get(f"{server.url}/v1/cache/stats").json()["data"]
    # The pinned entry holds the prefix: what was read, then what was written.
    end = pinned + (u.cache_read_input_tokens or 0)
    pins = [e for e in stats if e["kind"] == "pin" and e["tokens"] == end]
    assert pins
    assert 3500 < pins[0]["pin_expires_in"] <= 3600
    # Another conversation on the same system prompt reads the pinned prefix
    # and writes nothing new (its pin is refreshed).
    second = client.messages.create(
        system=system,  # type: ignore[arg-type]
        messages=[{"role": "user", "content": "Another question entirely."}],
        **ask,
    )
    assert (second.usage.cache_read_input_tokens or 0) >= end
    assert second.usage.cache_creation_input_tokens == 0
    # Anthropic's arithmetic: computed + written + read is the prompt.
    counted = client.messages.count_tokens(
        model="gezel",
        system=system,  # type: ignore[arg-type]
        messages=[{"role": "user", "content": "One."}],
        tools=TOOLS,
        **NO_THINK,  # type: ignore[arg-type]
    )
    assert u.input_tokens + pinned + (u.cache_read_input_tokens or 0) == counted.input_tokens


@pytest.mark.slow
def test_more_than_four_breakpoints_is_a_400_naming_the_fifth(dense_server: Server) -> None:
    import anthropic

    client = anthropic.Anthropic(base_url=dense_server.url, api_key="unused", max_retries=0)
    control = {"type": "ephemeral"}
    blocks = [{"type": "text", "text": f"part {i}", "cache_control": control} for i in range(3)]
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(
            model="gezel",
            max_tokens=1,
            system=_pinned_system(None),  # type: ignore[arg-type]
            messages=[{"role": "user", "content": blocks}],  # type: ignore[list-item]
            cache_control=control,  # type: ignore[call-arg]
        )
    message = err.value.body["error"]["message"]  # type: ignore[index]
    assert "A maximum of 4 blocks with cache_control may be provided. Found 5." in message
    assert "cache_control" in message


@pytest.mark.slow
def test_the_billing_line_is_dropped_on_chat_completions_too(dense_server: Server) -> None:
    """Proxies forward Claude Code's prompt over chat completions: the line
    is dropped there too (and for ``/tokenize``, which renders as a request
    does), and counted in ``/metrics``."""

    def tokens(text: str) -> list[int]:
        body = {
            "messages": [
                {"role": "system", "content": [{"type": "text", "text": text}]},
                {"role": "user", "content": "hi"},
            ]
        }
        response = httpx.post(f"{dense_server.url}/tokenize", json=body)
        assert response.status_code == 200, response.text
        return list(response.json()["tokens"])

    def dropped() -> float:
        text = httpx.get(f"{dense_server.url}/metrics").text
        (line,) = [
            x for x in text.splitlines() if x.startswith("gezel_billing_header_lines_dropped_total")
        ]
        return float(line.split()[-1])

    before = dropped()
    plain = tokens("Be brief.")
    assert tokens(f"{header(1, prev=False)}\nBe brief.") == plain
    assert tokens(f"{header(2, prev=True)}\nBe brief.") == plain
    assert dropped() == before + 2
