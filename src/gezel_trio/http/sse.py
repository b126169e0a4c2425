"""Server-sent-event framing and the OpenAI response shapes."""

from __future__ import annotations

import json
import time
from typing import Any

from ..errors import GezelError
from ..events import Usage

__all__ = ["DONE", "chunk", "comment", "completion", "error_body", "frame", "usage_body"]

DONE = b"data: [DONE]\n\n"


def frame(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def comment(text: str) -> bytes:
    """An SSE comment line: OpenAI clients ignore it; it keeps a slow stream
    visibly alive."""
    return b": " + text.replace("\n", " ").encode() + b"\n\n"


def usage_body(u: Usage) -> dict[str, Any]:
    """gezel's usage names (W1) alongside the standard OpenAI ones, so both
    kinds of client read the same object."""
    return {
        "input_tokens": u.input_tokens,
        "output_tokens": u.output_tokens,
        "total_tokens": u.total_tokens,
        "cached_tokens": u.cached_tokens,
        "prompt_tps": u.prompt_tps,
        "generation_tps": u.generation_tps,
        "prompt_tokens": u.input_tokens,
        "completion_tokens": u.output_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


def error_body(err: GezelError) -> dict[str, Any]:
    return {
        "error": {
            "message": err.message,
            "type": err.error_type,
            "code": err.code,
            "param": err.param,
        }
    }


def chunk(
    cid: str,
    model: str,
    created: int,
    delta: dict[str, Any],
    finish_reason: str | None,
    usage: Usage | None,
) -> dict[str, Any]:
    return {
        "id": cid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}],
        "usage": usage_body(usage) if usage is not None else None,
    }


def completion(
    cid: str, model: str, message: dict[str, Any], finish_reason: str, usage: Usage
) -> dict[str, Any]:
    return {
        "id": cid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": finish_reason,
                "logprobs": None,
            }
        ],
        "usage": usage_body(usage),
    }
