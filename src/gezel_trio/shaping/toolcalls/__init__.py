"""Tool-call markup in streamed model output, split out as OpenAI tool-call deltas.

Pure string logic (stdlib and attrs only), used per sequence like
:mod:`gezel_trio.shaping.text`: the detokenized text of each step goes into
:meth:`ToolCallSplitter.feed`, typed events come out. Argument text is
streamed as it is generated, not handed over as one whole call at the end.

Formats are resolved from the chat template (:func:`resolve_format`), never
guessed from what the model writes; a template with tool syntax of an unknown
family gets no splitter and its output stays content. A template with no tool
syntax at all gets :data:`GENERIC`, as llama.cpp's generic handler does: the
tools are described in the system turn (``prompt.generic_tool_messages``)
and a call is one JSON object, ``{"tool_call": {"name": ..., "arguments":
...}}``, constrained by a grammar when the request forces one.

For every call the events are, in order: one :class:`CallStart` (index, id,
name), sent once the name is known and the markup so far is valid; zero or
more :class:`CallArgs` whose fragments concatenate to the call's arguments
JSON text; one :class:`CallEnd`. :class:`Content` carries the text outside
calls. Any chunking of the same output gives the same events once adjacent
``Content`` values, and adjacent ``CallArgs`` of one call, are merged (ids
come from ``id_factory`` and so differ unless it is deterministic).

Malformed markup never raises. Before its ``CallStart`` a call that turns out
malformed degrades to content: its raw text, opening marker included, is
emitted as ``Content`` and scanning resumes at the offending character. A
``CallStart`` cannot be taken back, so a call that breaks later ends with
``CallEnd(malformed=True)`` (its arguments are then whatever was already
sent) and the text from the offending character on is scanned again as
ordinary output. ``malformed`` is false when the arguments value itself was
complete, so a model that only forgets the object's closing brace still
produces a good call.

Whitespace right after a call is markup layout: it is held back and dropped if
another call or the end of the text follows, and emitted otherwise.

Cost is linear in the text fed, whatever its chunking: no pattern here can
backtrack, each character is looked at a bounded number of times, and
held-back text is bounded by the longest marker (or, inside a call, kept in
lists joined once). Runs that are whole in a piece (strings, numbers,
whitespace, openers, the text between markers) are taken at C speed; only
tokens of markup go through Python one by one.

The modules behind this facade: ``_splitter`` (the marker search and the
event stream), ``_events``, ``_format``, and one module per markup family,
which declares its ``ToolFormat``: how a template teaches it, the body
scanner that reads a call, and the grammar that writes one (on
``shaping.call_syntax``): ``_hermes`` (and ``_generic``, which reuses its
body), ``_mistral``, ``_qwen_xml``, ``_gemma`` (Gemma 4), ``_glm`` (GLM-4.5
to 4.7). ``_families`` lists the families once; every name of one is read
there. ``_json_lexer`` is the JSON lexer that Hermes and Mistral share,
``_tags`` the reading of fixed tags that Qwen3-Coder, GLM and Gemma 4 share.
"""

from ._events import CallArgs, CallEnd, CallStart, Content, ToolEvent, collect, new_call_id
from ._families import (
    FAMILIES,
    GRAMMAR_FORMATS,
    TOOL_GRAMMAR_FORMATS,
    TOOL_GRAMMAR_NAMES,
    detect_format,
    family,
    resolve_format,
)
from ._format import ToolFormat
from ._gemma import GEMMA4
from ._generic import GENERIC
from ._glm import GLM
from ._hermes import HERMES
from ._mistral import MISTRAL
from ._qwen_xml import QWEN3_CODER
from ._splitter import ToolCallSplitter, string_parameters

__all__ = [
    "FAMILIES",
    "GEMMA4",
    "GENERIC",
    "GLM",
    "GRAMMAR_FORMATS",
    "HERMES",
    "MISTRAL",
    "QWEN3_CODER",
    "TOOL_GRAMMAR_FORMATS",
    "TOOL_GRAMMAR_NAMES",
    "CallArgs",
    "CallEnd",
    "CallStart",
    "Content",
    "ToolCallSplitter",
    "ToolEvent",
    "ToolFormat",
    "collect",
    "detect_format",
    "family",
    "new_call_id",
    "resolve_format",
    "string_parameters",
]
