"""Rendering a conversation into prompt tokens with the model's chat template.

Plain Python over the Hugging Face tokenizer (no MLX), so it runs on a worker
thread beside the event loop, never on the engine's host thread.
"""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import json
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from ..core.cache_plan import common_prefix
from ..core.errors import InvalidRequest
from ..core.request import RenderedPrompt
from .replies import GeneratedReply, ReplyLedger
from .template_budget import BoundedTemplates, TemplateBudget, TemplateBudgetExceeded

log = logging.getLogger("gezel_trio.prompt")

__all__ = [
    "ChatTemplateRenderer",
    "RenderedPrompt",
    "generic_tool_messages",
    "later_system_as_reminders",
]


def _prepare_message(message: dict[str, Any]) -> dict[str, Any]:
    """Templates index into ``arguments``; OpenAI clients send it as a JSON
    string, so parse it to a mapping (left as-is when it is not JSON, or is
    nested past Python's recursion limit: 5,000 "[" raised RecursionError)."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    prepared = []
    for call in calls:
        fn = dict(call.get("function") or {})
        args = fn.get("arguments")
        if isinstance(args, str):
            with contextlib.suppress(ValueError, RecursionError):
                fn["arguments"] = json.loads(args) if args.strip() else {}
        prepared.append({**call, "function": fn})
    return {**message, "tool_calls": prepared}


# Template kwargs that tune reasoning depth; the first to go when a template
# rejects the kwargs it was given.
_REASONING_DEPTH_KEYS = ("reasoning_effort", "reasoning_budget", "thinking_budget", "thinking")
_PROBE_RESULT = "gezel-probe-tool-result-7f3a"
_PROBE_USER = "gezel-probe-next-turn-5c1e"
_PROBE_LATER_SYSTEM = "gezel-probe-later-system-9b2d"
_SYSTEM_ROLES = ("system", "developer")


def _strip_linkage(message: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in message.items() if k != "tool_call_id"}
    if out.get("tool_calls"):
        out["tool_calls"] = [
            {k: v for k, v in call.items() if k != "id"} for call in out["tool_calls"]
        ]
    return out


def _without_calls(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant message as its text alone: its tool calls left out."""
    if message.get("role") != "assistant" or "tool_calls" not in message:
        return message
    out = {k: v for k, v in message.items() if k != "tool_calls"}
    if out.get("content") is None:
        out["content"] = ""  # templates concatenate it
    return out


_GENERIC_INSTRUCTIONS = (
    "You can call the tools described by these JSON schemas:\n{tools}\n\n"
    "To call a tool, reply with only one JSON object of this form and nothing else:\n"
    '{{"tool_call": {{"name": "<tool name>", "arguments": {{<the arguments>}}}}}}\n'
    "A tool's result comes back in the next user turn as "
    '{{"tool_response": {{"name": "<tool name>", "content": "<result>"}}}}. '
    "When no tool is needed, answer in plain text."
)


def _dumps(value: Any) -> str:
    # The separators and the raw Unicode the tool grammar generates, so a
    # replayed call renders to the tokens the model produced.
    return json.dumps(value, ensure_ascii=False)


def _with_text(content: Any, text: str) -> Any:
    if isinstance(content, str) and content:
        return f"{content}\n\n{text}"
    if isinstance(content, list):
        return [*content, {"type": "text", "text": text}]
    return text


def _text(content: Any) -> str:
    """A system message's text: a string, or its text parts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n\n".join(
            p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
        )
    return ""


def _before_text(content: Any, text: str) -> Any:
    if isinstance(content, str):
        return f"{text}\n\n{content}" if content else text
    if isinstance(content, list):
        return [{"type": "text", "text": text}, *content]
    return text


def later_system_as_reminders(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation with each system or developer message after the
    first turn as a user-side reminder at the same place, for templates that
    render system messages only first (Qwen-style templates raise "System
    message must be at the beginning"; others drop or move them).

    The reminder, wrapped in ``<system-reminder>`` as Claude Code writes its
    own, opens the next user message; with none next, it closes the previous
    user message, or else is a user message of its own. Opening the next
    turn leaves every byte rendered before it as it was, so the prefix a
    previous turn cached is still read; a user message of its own only where
    no user turn is adjacent keeps templates that enforce alternation
    rendering."""
    out: list[dict[str, Any]] = []
    pending: list[str] = []
    leading = True
    for message in messages:
        role = message.get("role")
        if role in _SYSTEM_ROLES and not leading:
            pending.append(
                f"<system-reminder>\n{_text(message.get('content'))}\n</system-reminder>"
            )
            continue
        if role not in _SYSTEM_ROLES:
            leading = False
        if pending and role == "user":
            note = "\n\n".join(pending)
            message = {**message, "content": _before_text(message.get("content"), note)}
            pending = []
        elif pending:
            _place(out, pending)
            pending = []
        out.append(message)
    if pending:
        _place(out, pending)
    return out


def _place(out: list[dict[str, Any]], notes: list[str]) -> None:
    """Reminders with no user turn after them: closing the previous user
    message, or as a user message of their own."""
    note = "\n\n".join(notes)
    if out and out[-1].get("role") == "user":
        out[-1] = {**out[-1], "content": _with_text(out[-1].get("content"), note)}
    else:
        out.append({"role": "user", "content": note})


def generic_tool_messages(
    messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """The conversation in the generic tool format, for a template with no
    tool syntax (``shaping.toolcalls.GENERIC``): the tools are described at the end of
    the system turn (one is added when there is none), an assistant's calls
    become its text, one ``{"tool_call": ...}`` object per call, and a tool
    result becomes a user turn holding ``{"tool_response": ...}``.
    """
    out: list[dict[str, Any]] = []
    names: dict[str, str] = {}
    for message in messages:
        role = message.get("role")
        if role == "assistant" and message.get("tool_calls"):
            calls = []
            for call in message["tool_calls"]:
                fn = call.get("function") or {}
                name = fn.get("name", "")
                if call.get("id"):
                    names[call["id"]] = name
                calls.append(
                    _dumps({"tool_call": {"name": name, "arguments": fn.get("arguments", {})}})
                )
            text = message.get("content")
            body = "\n".join(calls)
            content = f"{text}\n{body}" if isinstance(text, str) and text else body
            rest = {k: v for k, v in message.items() if k != "tool_calls"}
            out.append({**rest, "content": content})
        elif role == "tool":
            response: dict[str, Any] = {"content": message.get("content") or ""}
            name = names.get(message.get("tool_call_id") or "") or message.get("name")
            if name:
                response = {"name": name, **response}
            out.append({"role": "user", "content": _dumps({"tool_response": response})})
        else:
            out.append(dict(message))
    if tools:
        text = _GENERIC_INSTRUCTIONS.format(tools="\n".join(_dumps(t) for t in tools))
        if out and out[0].get("role") in ("system", "developer"):
            out[0] = {**out[0], "content": _with_text(out[0].get("content"), text)}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


@attrs.frozen
class _Piece:
    """Part of a spliced prompt: its text, how many characters of the
    template's text it stands for, and the generated ids that spell it
    (``None``: tokenize the text)."""

    text: str
    source_len: int
    ids: tuple[int, ...] | None = None


class ChatTemplateRenderer:
    """Implements ``backend.PromptRenderer`` over a tokenizer with a chat template.

    ``tool_calls`` ids and ``tool_call_id`` are passed only to templates that
    need them: a probe render, once per template, shows whether the template
    drops a tool result that is not linked to its call. When a template
    rejects the kwargs, rendering falls back in rungs - without the
    reasoning-depth kwargs, without any kwargs, and last, logged loudly,
    without the tools - rather than failing the turn.

    ``generic_tools``: the model's template has no tool syntax, so tools,
    calls and results are written into the messages in the generic format
    (``generic_tool_messages``) and the template never sees ``tools``.

    ``drop_past_tool_calls`` (the seed's history rule): the history's
    assistant tool calls are left out for templates that render a tool
    result without its call (Hermes/Qwen style; a probe render once per
    template tells); the results and the assistant text stay. Templates that
    pair each result with its call (Gemma style) keep the calls, which they
    cannot do without. The seed measured its client's core suite at 8/11
    with the rule and 5/11 without: a Qwen model that sees its own past
    ``<tool_call>`` blocks imitates them into loops (tool calls 457 -> 753).
    The price is the prompt cache: a turn whose earlier call is no longer
    rendered matches the cached conversation only up to that call.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        boundaries: bool = False,
        generic_tools: bool = False,
        drop_past_tool_calls: bool = False,
        template_budget: TemplateBudget | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        self._generic_tools = generic_tools
        self._drop_past_tool_calls = drop_past_tool_calls
        self._needs_linkage = _ProbeMemo()
        self._bare_results = _ProbeMemo()
        self._system_in_place = _ProbeMemo()
        # A request's own template renders under this budget.
        self._templates = BoundedTemplates(template_budget or TemplateBudget())
        self._find_boundaries = boundaries

    def render(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        tools: Sequence[dict[str, Any]] | None,
        template_kwargs: dict[str, Any],
        template_override: str | None,
        band_chars: int | None = None,
        pins: Sequence[int] = (),
        replies: ReplyLedger | None = None,
    ) -> RenderedPrompt:
        """``messages`` as prompt tokens. ``pins``: indices into ``messages``
        whose rendered end to find (``RenderedPrompt.pin_ends``, in the same
        order). With ``replies``, each assistant turn this server generated
        is spelled with the ids it generated where the rendered text holds
        its reply (``_splice``), so a re-sent history reuses the cache
        through its last reply. A ``template_override`` that spends more
        than its budget is an ``InvalidRequest`` naming it."""
        if template_override is None:
            return self._render(messages, tools, template_kwargs, None, band_chars, pins, replies)
        try:
            with self._templates.spending():
                return self._render(
                    messages, tools, template_kwargs, template_override, band_chars, pins, replies
                )
        except TemplateBudgetExceeded as exc:
            raise InvalidRequest(
                f"chat_template_override is too costly to render: {exc.why}",
                param="chat_template_override",
            ) from exc

    def bookkeeping(self) -> dict[str, int]:
        """The sizes of what this renderer keeps per process: the template
        probes' answers (entries) and the compiled request templates
        (characters of source)."""
        probes = len(self._needs_linkage) + len(self._bare_results) + len(self._system_in_place)
        return {
            "template_probe_entries": probes,
            "compiled_template_chars": self._templates.held_bytes(),
        }

    def _render(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None,
        template_kwargs: dict[str, Any],
        template_override: str | None,
        band_chars: int | None,
        pins: Sequence[int],
        replies: ReplyLedger | None,
    ) -> RenderedPrompt:
        template = template_override or getattr(self._tokenizer, "chat_template", None)
        if not template:
            raise InvalidRequest(
                "this model has no chat template; send chat_template_override",
                param="chat_template_override",
            )
        given_tools = tools
        prepared, tools = self._prepared(messages, tools, template, template_override)
        # No enable_thinking unless the request sends one: every template
        # follows its own default.
        kwargs: dict[str, Any] = dict(template_kwargs)
        depthless = {k: v for k, v in kwargs.items() if k not in _REASONING_DEPTH_KEYS}
        rungs: list[tuple[dict[str, Any], Sequence[dict[str, Any]] | None, str]] = [
            (kwargs, tools, ""),
            (depthless, tools, "without reasoning-depth kwargs"),
            ({}, tools, "without chat_template_kwargs"),
            ({}, None, "WITHOUT TOOLS"),
        ]
        first_error: Exception | None = None
        text: str | None = None
        used: tuple[dict[str, Any], Sequence[dict[str, Any]] | None] = (kwargs, tools)
        for rung_kwargs, rung_tools, label in rungs:
            if label and rung_kwargs == kwargs and rung_tools == tools:
                continue
            if label == "WITHOUT TOOLS" and not tools:
                break
            try:
                text = self._apply(prepared, rung_tools, rung_kwargs, template_override)
            except TemplateBudgetExceeded:
                raise  # no fallback renders a bomb any cheaper
            except Exception as exc:  # jinja2 and transformers raise assorted types
                first_error = first_error or exc
                continue
            if label:
                level = logging.WARNING if rung_tools is None else logging.INFO
                log.log(level, "chat template rejected the request's kwargs; rendered %s", label)
            used = (rung_kwargs, rung_tools)
            break
        if text is None:
            error = first_error or RuntimeError("no render")
            raise InvalidRequest(
                "the chat template could not render these messages: "
                f"{type(error).__name__}: {error}",
                param="messages",
            ) from error
        roles = tuple(str(m.get("role") or "") for m in messages)
        pieces = self._splice(text, messages, replies) if replies is not None else None
        spliced: str | None = None
        if pieces is not None:
            # Band and boundaries are found in the template's own text, so
            # token ends are given in its coordinates.
            spliced = "".join(p.text for p in pieces)
            tokens, ends = self._tokenize_pieces(pieces)
        elif not band_chars and not self._find_boundaries and not pins:
            hf = getattr(self._tokenizer, "_tokenizer", self._tokenizer)
            if getattr(hf, "is_fast", False) is True:
                # The fast tokenizer's encoding maps characters to tokens at
                # no extra cost, which places each message for cache misses.
                fast = hf(text, add_special_tokens=False)
                starts = _message_starts(text, messages, fast.char_to_token)
                return RenderedPrompt(
                    tuple(fast["input_ids"]),
                    text=text,
                    message_starts=starts,
                    message_roles=roles if starts else (),
                )
            ids: list[int] = self._tokenizer.encode(text, add_special_tokens=False)
            return RenderedPrompt(tuple(ids), text=text)
        else:
            hf = getattr(self._tokenizer, "_tokenizer", self._tokenizer)
            enc = hf(text, add_special_tokens=False, return_offsets_mapping=True)
            tokens = tuple(enc["input_ids"])
            ends = [stop for _, stop in enc["offset_mapping"]]
        band_end = _band_end(text, messages, band_chars, ends) if band_chars else None
        bounds: tuple[int, ...] = ()
        if self._find_boundaries:
            bounds = self._boundaries(prepared, text, ends, *used, template_override)
        pin_ends = tuple(
            self._message_end(messages[: i + 1], given_tools, text, ends, used, template_override)
            if 0 <= i < len(messages)
            else None
            for i in pins
        )
        starts = _message_starts(text, messages, lambda c: bisect.bisect_right(ends, c))
        return RenderedPrompt(
            tokens,
            band_end,
            bounds,
            spliced if spliced is not None else text,
            pin_ends=pin_ends,
            message_starts=starts,
            message_roles=roles if starts else (),
        )

    def _prepared(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None,
        template: str,
        override: str | None,
    ) -> tuple[list[dict[str, Any]], Sequence[dict[str, Any]] | None]:
        """The messages (and tools) as this template is given them."""
        prepared = [_prepare_message(m) for m in messages]
        if _has_later_system(prepared) and not self._later_system_in_place(template, override):
            prepared = later_system_as_reminders(prepared)
        if self._generic_tools:
            return generic_tool_messages(prepared, tools), None
        if not self._linkage_needed(template, override):
            prepared = [_strip_linkage(m) for m in prepared]
        if (
            self._drop_past_tool_calls
            and any(m.get("tool_calls") for m in prepared)
            and self._renders_bare_results(template, override)
        ):
            prepared = [_without_calls(m) for m in prepared]
        return prepared, tools

    def _message_end(
        self,
        head: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None,
        text: str,
        ends: Sequence[int],
        used: tuple[dict[str, Any], Sequence[dict[str, Any]] | None],
        override: str | None,
    ) -> int | None:
        """Where the conversation ``head`` (a prefix of the messages) ends in
        the rendered ``text``, as a token index: rendered alone, without a
        generation prompt, it shares exactly that much text. Backs off one
        token, as the boundaries do."""
        template = str(override or getattr(self._tokenizer, "chat_template", ""))
        prepared, head_tools = self._prepared(head, tools, template, override)
        try:
            other = self._apply(prepared, head_tools if used[1] else None, used[0], override, False)
        except TemplateBudgetExceeded:
            raise
        except Exception:  # a template that refuses the shorter conversation: no pin
            return None
        cut = bisect.bisect_right(ends, common_prefix(text, other)) - 1
        return cut if 0 < cut < len(ends) else None

    def _splice(
        self,
        text: str,
        messages: Sequence[dict[str, Any]],
        replies: ReplyLedger,
    ) -> list[_Piece] | None:
        """The rendered ``text`` cut into text pieces and generated replies,
        or ``None`` when no turn of ``messages`` is a reply the ledger holds
        where the text shows it.

        A reply is spliced where the text holds what its ids spell, right
        after the generation prompt it continued, searched in turn order.
        Two layout changes are undone, since the model wrote the reply after
        them: the first space the stream trimmed, and an empty think block
        the template drops from old turns (Qwen-style templates write
        ``<think>\\n\\n</think>\\n\\n`` into the generation prompt when
        thinking is off, and not into the history). Anything else the
        template changed (old reasoning dropped, a call re-serialised) leaves
        that turn as rendered. The text before a spliced reply is the same
        string the earlier prompt was, so it tokenizes to the same ids."""
        if any(_has_image(m) for m in messages):
            return None  # the vision processor tokenizes the text itself
        hits = [
            known for m in messages if m.get("role") == "assistant" and (known := replies.get(m))
        ]
        if not hits:
            return None
        pieces: list[_Piece] = []
        cursor = 0
        for candidates in hits:
            # The same text may have been generated after several prompts
            # (a model that repeats itself): this turn is the earliest place.
            places = [
                (place, reply)
                for reply in candidates
                if (place := self._find_reply(text, cursor, reply, replies.think_markers))
            ]
            if not places:
                log.debug("a generated reply is not rendered as generated; not spliced")
                continue
            (start, end, restored, spelled), reply = min(places, key=lambda p: p[0][0])
            pieces.append(_Piece(text[cursor:start] + restored, start - cursor))
            pieces.append(_Piece(spelled, end - start, reply.tokens))
            cursor = end
        if not pieces:
            return None
        pieces.append(_Piece(text[cursor:], len(text) - cursor))
        return pieces

    def _find_reply(
        self,
        text: str,
        cursor: int,
        reply: GeneratedReply,
        think_markers: tuple[str, str] | None,
    ) -> tuple[int, int, str, str] | None:
        """Where ``reply`` stands in ``text`` from ``cursor`` on: its start,
        its end, the text to put back before it, and what its ids spell."""
        try:
            spelled = self._spell(reply.tokens)
            tail = self._spell(reply.tail)
        except Exception:  # ids this tokenizer cannot spell (an image's keys): no splice
            return None
        dropped: tuple[str, str] | None = None
        if think_markers is not None:
            start, end = map(re.escape, think_markers)
            m = re.search(rf"{start}\s*{end}\s*$", tail)
            if m is not None:
                dropped = (tail[: m.start()], tail[m.start() :])
        candidates = [spelled]
        if spelled.startswith(" "):
            candidates.append(spelled[1:])  # the stream trims a reply's first space
        for shown in candidates:
            if not shown:
                continue
            at = text.find(shown, cursor)
            while at >= 0:
                before = text[:at]
                if before.endswith(tail):
                    return at, at + len(shown), "", spelled
                if dropped is not None and dropped[0] and before.endswith(dropped[0]):
                    return at, at + len(shown), dropped[1], spelled
                at = text.find(shown, at + 1)
        return None

    def _tokenize_pieces(self, pieces: Sequence[_Piece]) -> tuple[tuple[int, ...], list[int]]:
        """Each text piece tokenized alone, each reply as its ids; and where
        each token ends in the template's text (a reply's inner tokens are
        placed at its start, so no boundary falls inside a reply; a token of
        restored text ends where the template's piece does)."""
        hf = getattr(self._tokenizer, "_tokenizer", self._tokenizer)
        tokens: list[int] = []
        ends: list[int] = []
        pos = 0
        for piece in pieces:
            if piece.ids is not None:
                tokens += piece.ids
                ends += [pos] * (len(piece.ids) - 1) + [pos + piece.source_len]
            elif piece.text:
                enc = hf(piece.text, add_special_tokens=False, return_offsets_mapping=True)
                tokens += enc["input_ids"]
                ends += [pos + min(stop, piece.source_len) for _, stop in enc["offset_mapping"]]
            pos += piece.source_len
        return tuple(tokens), ends

    def _spell(self, tokens: Sequence[int]) -> str:
        """Ids as the exact text they stand for, special tokens included."""
        hf = getattr(self._tokenizer, "_tokenizer", self._tokenizer)
        ids = list(tokens)
        try:
            text = hf.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        except TypeError:  # a bare ``tokenizers.Tokenizer``
            text = hf.decode(ids, skip_special_tokens=False)
        return str(text)

    def encode(self, text: str, *, add_special_tokens: bool) -> tuple[int, ...]:
        hf = getattr(self._tokenizer, "_tokenizer", self._tokenizer)
        ids: list[int] = hf.encode(text, add_special_tokens=add_special_tokens)
        return tuple(ids)

    def decode(self, tokens: Sequence[int]) -> str:
        hf = getattr(self._tokenizer, "_tokenizer", self._tokenizer)
        return str(hf.decode(list(tokens)))

    def _boundaries(
        self,
        messages: Sequence[dict[str, Any]],
        text: str,
        ends: Sequence[int],
        kwargs: dict[str, Any],
        tools: Sequence[dict[str, Any]] | None,
        template_override: str | None,
    ) -> tuple[int, ...]:
        """Token indices where later turns of this conversation will still
        share the prompt, found by rendering what a later turn could look like
        and comparing texts - whatever the template's markup:

        * the system turn followed by another user turn (where conversations
          that share a system prompt part);
        * the history without the generation prompt (a tool loop continues
          the same history);
        * the history followed by another user turn (templates that re-render
          earlier turns once a user speaks again, e.g. dropping reasoning).

        Each cut backs off one token from the shared text, since the token
        that touches the boundary may merge differently with other text.
        Costs a few template renders; the prompt is tokenized once."""
        probe = {"role": "user", "content": _PROBE_USER}
        n_system = 0
        while n_system < len(messages) and messages[n_system].get("role") in (
            "system",
            "developer",
        ):
            n_system += 1
        probes: list[tuple[list[dict[str, Any]], bool]] = [
            (list(messages), False),
            ([*messages, probe], True),
        ]
        if 0 < n_system < len(messages):
            probes.insert(0, ([*messages[:n_system], probe], True))
        out: list[int] = []
        for head, generation_prompt in probes:
            try:
                other = self._apply(head, tools, kwargs, template_override, generation_prompt)
            except TemplateBudgetExceeded:
                raise
            except Exception:  # a template that refuses the probe: no checkpoint there
                continue
            cut = bisect.bisect_right(ends, common_prefix(text, other)) - 1
            if 0 < cut < len(ends) - 1 and cut not in out:
                out.append(cut)
        return tuple(sorted(out))

    def _apply(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None,
        kwargs: dict[str, Any],
        template_override: str | None,
        generation_prompt: bool = True,
    ) -> str:
        owner = self._template_owner()
        if template_override is not None:
            # transformers' variables: the special tokens, then the kwargs.
            special = getattr(owner, "special_tokens_map", None)
            return self._templates.render(
                template_override,
                messages,
                tools=tools,
                add_generation_prompt=generation_prompt,
                variables={**(special if isinstance(special, dict) else {}), **kwargs},
            )
        extra = dict(kwargs)
        text = owner.apply_chat_template(
            list(messages),
            tools=list(tools) if tools else None,
            add_generation_prompt=generation_prompt,
            tokenize=False,
            **extra,
        )
        if not isinstance(text, str):
            raise TypeError("the chat template did not produce text")
        return text

    def _template_owner(self) -> Any:
        """Who renders: the Hugging Face tokenizer itself, unless mlx-lm's
        wrapper brings a renderer of its own. The wrapper sets
        ``enable_thinking`` to whether the vocabulary has think tokens when a
        request names none; the template's own default must decide."""
        hf = getattr(self._tokenizer, "_tokenizer", None)
        if (
            not hasattr(hf, "apply_chat_template")  # a Hugging Face tokenizer itself
            or getattr(self._tokenizer, "_chat_template", None) is not None
        ):
            return self._tokenizer
        return hf

    def _later_system_in_place(self, template: str, override: str | None) -> bool:
        """Render a system message after a turn once per template: whether
        it comes out where it stands (not refused, dropped or moved)."""
        cached = self._system_in_place.get(template)
        if cached is not None:
            return cached
        marks = ("gezel-probe-system-1", "gezel-probe-user-1", "gezel-probe-assistant-1")
        probe: list[dict[str, Any]] = [
            {"role": "system", "content": marks[0]},
            {"role": "user", "content": marks[1]},
            {"role": "assistant", "content": marks[2]},
            {"role": "system", "content": _PROBE_LATER_SYSTEM},
            {"role": "user", "content": _PROBE_USER},
        ]
        try:
            text = self._apply(probe, None, {}, override)
        except TemplateBudgetExceeded:
            raise
        except Exception:  # a template that refuses a later system message
            text = ""
        at = [text.find(m) for m in (*marks, _PROBE_LATER_SYSTEM, _PROBE_USER)]
        in_place = all(a >= 0 for a in at) and at == sorted(at)
        if not in_place:
            log.info(
                "the chat template renders system messages only first: later ones "
                "become user-side reminders"
            )
        self._system_in_place[template] = in_place
        return in_place

    def _linkage_needed(self, template: str, override: str | None) -> bool:
        """Render a tool round without ids once per template: if the result
        vanishes, the template links results to calls and needs the ids."""
        cached = self._needs_linkage.get(template)
        if cached is not None:
            return cached
        probe: list[dict[str, Any]] = [
            {"role": "user", "content": "probe"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"type": "function", "function": {"name": "probe", "arguments": {}}}
                ],
            },
            {"role": "tool", "content": _PROBE_RESULT},
        ]
        try:
            needed = _PROBE_RESULT not in self._apply(probe, None, {}, override)
        except TemplateBudgetExceeded:
            raise
        except Exception:  # a template that cannot render unlinked calls needs links
            needed = True
        self._needs_linkage[template] = needed
        return needed

    def _renders_bare_results(self, template: str, override: str | None) -> bool:
        """Render a tool result after an assistant turn without calls once
        per template: whether the result still shows (the calls can go)."""
        cached = self._bare_results.get(template)
        if cached is not None:
            return cached
        probe: list[dict[str, Any]] = [
            {"role": "user", "content": "probe"},
            {"role": "assistant", "content": ""},
            {"role": "tool", "content": _PROBE_RESULT},
        ]
        try:
            bare = _PROBE_RESULT in self._apply(probe, None, {}, override)
        except TemplateBudgetExceeded:
            raise
        except Exception:  # a template that refuses a result without its call keeps calls
            bare = False
        log.info(
            "--drop-past-tool-calls: %s",
            "the chat template renders a tool result without its call: the history's "
            "calls are left out"
            if bare
            else "the chat template pairs each tool result with its call: the calls stay",
        )
        self._bare_results[template] = bare
        return bare


class _ProbeMemo:
    """A probe's answer per template, kept by the template's digest in an
    LRU: every distinct override used to be kept whole (+33 MB per 600
    templates); 32-byte keys and ``MAX`` entries bound it near 1 MB."""

    MAX = 4096

    def __init__(self) -> None:
        self._answers: OrderedDict[bytes, bool] = OrderedDict()
        self._lock = threading.Lock()  # renders run on several worker threads

    @staticmethod
    def _key(template: str) -> bytes:
        return hashlib.sha256(template.encode("utf-8", "surrogatepass")).digest()

    def get(self, template: str) -> bool | None:
        key = self._key(template)
        with self._lock:
            answer = self._answers.get(key)
            if answer is not None:
                self._answers.move_to_end(key)
            return answer

    def __setitem__(self, template: str, answer: bool) -> None:
        key = self._key(template)
        with self._lock:
            self._answers[key] = answer
            self._answers.move_to_end(key)
            while len(self._answers) > self.MAX:
                self._answers.popitem(last=False)

    def __len__(self) -> int:
        return len(self._answers)


def _has_later_system(messages: Sequence[dict[str, Any]]) -> bool:
    """Whether a system or developer message follows a turn."""
    seen_turn = False
    for m in messages:
        if m.get("role") not in _SYSTEM_ROLES:
            seen_turn = True
        elif seen_turn:
            return True
    return False


def _has_image(message: dict[str, Any]) -> bool:
    content = message.get("content")
    return isinstance(content, list) and any(
        isinstance(p, dict) and p.get("type") == "image" for p in content
    )


def _band_end(
    text: str, messages: Sequence[dict[str, Any]], band_chars: int, ends: Sequence[int]
) -> int | None:
    """The band's end as a token index: the number of tokens that end at or
    before the band's last character in the rendered text."""
    system = next((m for m in messages if m.get("role") in ("system", "developer")), None)
    content = system.get("content") if system else None
    if not isinstance(content, str) or not content:
        return None
    band = content[:band_chars]
    start = text.find(band)
    if start < 0:
        return None
    return bisect.bisect_right(ends, start + len(band))


def _content_text(message: dict[str, Any]) -> str:
    """The text a template writes verbatim for ``message``: its content, or
    its first text part."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str) and part["text"]:
                return str(part["text"])
    return ""


def _message_starts(
    text: str, messages: Sequence[dict[str, Any]], to_token: Callable[[int], int | None]
) -> tuple[int, ...]:
    """The token index where each message starts in the rendered ``text``:
    a message runs from the end of the previous message's content (so the
    template's markup before a content belongs to that message) to the end
    of its own. Contents are found by a text search in order, one pass over
    the text; a content the template rewrote is not found and its message
    starts where the previous one ended. ``()`` when no content is found."""
    starts: list[int] = []
    cursor, found = 0, False
    for message in messages:
        starts.append(cursor)
        content = _content_text(message)
        at = text.find(content, cursor) if content else -1
        if at >= 0:
            found = True
            cursor = at + len(content)
    if not found:
        return ()
    out: list[int] = []
    for char in starts:
        token = to_token(char) if char < len(text) else None
        out.append(token if token is not None else (out[-1] if out else 0))
    return tuple(out)
