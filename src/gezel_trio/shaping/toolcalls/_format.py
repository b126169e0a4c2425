"""The description of one chat-template family's tool-call markup."""

from __future__ import annotations

from typing import Literal

import attrs

__all__ = ["ToolFormat"]


@attrs.frozen
class ToolFormat:
    """How one chat-template family writes a tool call.

    ``start`` opens a call and ``end`` closes it (empty when the call ends with
    its body). ``body`` names the syntax in between:

    * ``"json"``: one object ``{"name": ..., "arguments": ...}`` (Hermes, Qwen
      2.5/3); ``"parameters"`` is accepted for ``"arguments"``.
    * ``"xml"``: ``<function=NAME>`` then ``<parameter=KEY>VALUE</parameter>``
      blocks, then ``</function>`` (Qwen3-Coder).
    * ``"name_args"``: ``NAME[ARGS]`` then the arguments as one JSON value
      (Mistral tokenizer v11 and later).
    * ``"gemma"``: ``call:NAME{key:VALUE,...}`` in Gemma 4's own value syntax
      (bare keys, strings between ``<|"|>`` tokens).
    * ``"glm"``: ``NAME`` then ``<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>``
      pairs (GLM-4.5 to 4.7).
    """

    name: str
    start: str = attrs.field(validator=attrs.validators.min_len(1))
    end: str
    body: Literal["json", "xml", "name_args", "gemma", "glm"]
