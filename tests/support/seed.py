"""The seed sidecar as its supervisor sees it: the command line it is started
with and the regular expressions that read its stdout (``tests/server``)."""

from __future__ import annotations

import re
from pathlib import Path

# The seed's marker, as its emitter documents it for the supervisor's parser:
#   Prefill: 42%| | 8192/<total> [batched] cache=<id>
# (the percentage right-aligned in three places; the tag optional).
PREFILL = re.compile(
    r"^Prefill:\s*(?P<pct>\d{1,3})%\|[^|]*\|\s*(?P<done>\d+)/(?P<total>\d+)"
    r" \[batched\](?: cache=(?P<cache>\S+))?$"
)
# The classifier the seed's comments describe: a bare "SomeError: message"
# leaf line - an exception line as Python prints it (dotted names allowed),
# not indented, not tagged - means the engine died. Our own exception
# classes end in Failure or Failed too (EngineFailure, RequestFailed).
LEAF = re.compile(r"^(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Failure|Failed)(?::|$)")
# The seed client's classifier for cache events (its stdout-parser): a hit
# and a warm flash "Cache hit · reusing N tokens" / "Cache warmed".
CACHE_HIT = re.compile(r"\[cache\] hit cache_id=\S+ prior_tokens=(\d+)")
CACHE_WARMED = re.compile(r"\[cache\] warmed cache_id=\S+ tokens=(\d+)")
# And for the queue lines, each routed to the session that owns the cache id
# and re-arming its watchdog.
QUEUE = re.compile(
    r"\[batch\] (waiting|paused|admitted) cache=(\S+)(?: ahead=(\d+))?(?: (?:behind|for)=(\S+))?"
)
# A contained failure, tagged line by line.
TAGGED = re.compile(r"^\[(?P<tag>[\w-]+)\] \| ")

# The prefill step the seed's command line asks for.
STEP = 64


def seed_command_line(model: Path, work: Path) -> list[str]:
    """What the supervisor passes the seed: every flag its parser declares."""
    return [
        "serve",
        "--model", str(model),
        "--external-ple-dir", str(work / "ple-view"),
        "--allow-resident-ple-fallback",
        "--host", "127.0.0.1",
        "--port", "0",
        "--cache-budget-mb", "4096",
        "--prefill-step-size", str(STEP),
        "--spec-draft-model", str(work / "drafter"),
        "--spec-draft-kind", "mtp",
        "--spec-block-size", "4",
        "--persist-dir", str(work / "persist"),
        "--model-fingerprint", "seed-compat-test",
        "--disk-cache-budget-mb", "8192",
        "--vision",
        "--max-concurrency", "2",
        "--gpu-memory-limit-mb", "8192",
        "--wired-limit-mb", "4096",
        "--stream-tool-calls",
        "--kv-bits", "8",
        "--kv-group-size", "64",
        "--kv-quant-scheme", "uniform",
        "--quantized-kv-start", "256",
    ]  # fmt: skip
