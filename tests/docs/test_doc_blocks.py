"""Every fenced block of README.md and docs/ is checked by its kind.

A block is found wherever it is (``tests.support.doc_blocks``), so a new one
is checked from its first commit, and a block of no kind the test knows
fails. The kinds:

- shell (``sh``, ``bash``, ``console``): each command against what it names:
  the real argument parsers of ``gezel-trio``, ``./dev``, ``python -m
  bench``, ``mlx.launch`` and ``vllm-router``; ``pip install``'s extras;
  ``export``'s variable names; a coding agent's command line against the
  one the bench drives; ``curl`` run against the shared dense-model
  server, answering 2xx.
- ``python``: run, its ``http://127.0.0.1:8080`` the dense-model server's
  address, the names its prose defines bound (``PLACEHOLDERS``), and an
  engine it opens the scripted one (``gezel_trio.testing``: a model load
  per block would cost more than the whole file, and the model does not
  matter to what the block shows); its ``case Class(name=...)`` patterns
  name attributes the classes have.
- ``json`` request bodies: POSTed to their route (named after the language,
  ```` ```json POST /v1/messages ````, or known by their fields).
- client configurations (``toml`` for Codex, ``json`` for opencode and for
  Claude Code's ``settings.json``, a shell block's ``export`` lines for
  Claude Code and opencode): compared with what
  ``bench/scenarios/_real_clients.py`` writes when it drives that client,
  setting by setting, every difference listed below with its reason; each
  server address in them leads to the route the recorded client requested,
  and the server answers it.
- ``text``: an illustration, allowed only where ``ILLUSTRATIONS`` names it.

The README's "It prints `...`" is checked where the default model is
served: ``tests/mlx/test_real_model.py``.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import inspect
import json
import os
import re
import subprocess
import tempfile
import tomllib
import urllib.parse
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import attrs
import httpx2 as httpx
import pytest
import trio

import gezel_trio
from bench.scenarios import _real_clients
from gezel_trio.testing import open_test_engine
from tests.support.doc_blocks import (
    AGENTS,
    ROOT,
    SHELLS,
    Block,
    check_command,
    commands,
    doc_blocks,
    exports,
    parse_blocks,
    product_env_names,
    program_of,
)
from tests.support.process import Server

pytestmark = pytest.mark.slow  # the shared dense-model server

BLOCKS = doc_blocks()
ADDRESS = "http://127.0.0.1:8080"  # where the docs say the server listens

# Blocks that show rather than run, each marked ```text (``listed`` says
# how an entry names its block).
ILLUSTRATIONS = {
    ("docs/migrating-from-the-seed.md", "Started server process [<pid>]"): (
        "the stdout lines' formats, with placeholders (tests/support/seed.py's regexes)"
    ),
    ("docs/architecture.md", "serve()  ── nursery"): "the server's task tree",
    ("docs/protocols.md", '"cache_miss": {'): "a member of a response's usage, not a whole body",
}

# Names a python block uses that its prose defines, and what the test binds.
PLACEHOLDERS: dict[str, Any] = {
    "messages": [{"role": "user", "content": "Say hello."}],
    "tools": [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ],
    # "model_dir", "path": the dense demo model; "engine": the scripted engine.
}

# --- what the docs may say differently from what the bench drives, and why

# The doc's value is the reader's to fit; the bench drove its own.
FITTED = {
    "codex": {"model_context_window": "the served model's window (the bench's: 262,144)"},
    "opencode": {"provider.gezel.models.gezel.limit.output": "max_tokens (bench --tokens)"},
    "claude-code": {"CLAUDE_CODE_MAX_OUTPUT_TOKENS": "max_tokens (bench --tokens)"},
}
# Set by the doc, not by the bench.
DOC_ONLY = {
    "codex": {
        "model_auto_compact_token_limit": "below the window; the driven turns never reach it",
        "model_providers.gezel.supports_websockets": "false: Codex's default, spelled out",
        "openai_base_url": "the built-in provider's address: the driven provider's base_url",
    },
}
# Set by the bench, not by the doc: what a measured, unattended run needs.
_SCRATCH = {"HOME": "a scratch home", "CODEX_HOME": "a scratch home"} | {
    f"XDG_{d}_HOME": "a scratch home" for d in ("CONFIG", "DATA", "CACHE", "STATE")
}
DRIVER_ONLY = {
    "codex": _SCRATCH
    | {
        "approval_policy": "`codex exec` runs unattended",
        "sandbox_mode": "the scratch repository is read, not written",
        "model_providers.gezel.request_max_retries": "a failed request counts, unretried",
        "model_providers.gezel.stream_max_retries": "a failed stream counts, unretried",
    },
    "opencode": _SCRATCH
    | {"OPENCODE_DISABLE_CLAUDE_CODE": "the prompt must not depend on the machine's ~/.claude"},
    "claude-code": _SCRATCH,
}

# Blocks that show one variant and are compared as a subset: the README's
# (short forms of the client pages'), and these.
VARIANTS = {("docs/clients/codex.md", "openai_base_url"): "the built-in provider"}

# What a client requests under the address its configuration names.
CLIENT_ROUTE = {
    "codex": "/responses",
    "opencode": "/chat/completions",
    "claude-code": "/v1/messages",
}
SAY_HELLO = [{"role": "user", "content": "Say hello."}]
SMALLEST = {
    "/v1/chat/completions": {"model": "gezel", "messages": SAY_HELLO, "max_tokens": 1},
    "/v1/responses": {"model": "gezel", "input": "Say hello.", "max_output_tokens": 1},
    "/v1/messages": {"model": "gezel", "messages": SAY_HELLO, "max_tokens": 1},
}


def listed(block: Block, table: dict[tuple[str, str], str]) -> str | None:
    """What ``table`` says of ``block``: an entry names a block by its file
    and the start of one of its lines."""
    lines = [line.strip() for line in block.text.splitlines()]
    for (path, start), why in table.items():
        if path == block.path and any(line.startswith(start) for line in lines):
            return why
    return None


@attrs.define
class Ctx:
    server: Server
    model: Path
    env_names: set[str]


@pytest.fixture(scope="module")
def ctx(dense_server: Server, dense_model: Path) -> Ctx:
    return Ctx(dense_server, dense_model, product_env_names() | _driven_env_names())


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_block(block: Block, ctx: Ctx) -> None:
    check_block(block, ctx)


def test_every_listed_block_exists_once() -> None:
    for table in (ILLUSTRATIONS, VARIANTS):
        for entry in table:
            named = [b.id for b in BLOCKS if listed(b, {entry: "named"})]
            assert len(named) == 1, f"{entry} names {named or 'no block'}: one, please"


def check_block(block: Block, ctx: Ctx) -> None:
    """Raise AssertionError, starting with what is wrong, unless ``block``
    holds what its kind promises."""
    if not block.lang:
        raise AssertionError("no info string: ```text for an illustration, else its language")
    if block.lang in SHELLS:
        check_shell(block, ctx)
    elif block.lang == "python":
        check_python(block, ctx)
    elif block.lang == "json":
        check_json(block, ctx)
    elif block.lang == "toml":
        check_toml(block, ctx)
    elif block.lang == "text":
        assert listed(block, ILLUSTRATIONS), "an illustration ILLUSTRATIONS lacks"
    else:
        raise AssertionError(f"no check for ```{block.lang} blocks")


# --- shell


def check_shell(block: Block, ctx: Ctx) -> None:
    found = commands(block)
    assert found, "a shell block with no command"
    for words in found:
        if not check_command(words, ctx.env_names):
            run_curl(words, ctx.server)
    agents = {AGENTS[program_of(w[0])] for w in found if program_of(w[0]) in AGENTS}
    for client in agents:
        compare(client, exports(block), driven_env(client), block)
        for value in exports(block).values():
            if value.startswith(ADDRESS):
                check_address(client, value, ctx.server)


def run_curl(words: list[str], server: Server) -> None:
    args = [w.replace(ADDRESS, server.url) for w in words[1:]]
    out = subprocess.run(
        ["curl", "-sS", "-o", os.devnull, "-w", "%{http_code}", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.stdout.startswith("2"), f"curl: status {out.stdout} {out.stderr.strip()}"


# --- python


def check_python(block: Block, ctx: Ctx) -> None:
    source = block.text.replace(ADDRESS, ctx.server.url)
    tree = ast.parse(source)
    code = compile(source, block.id, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    values = PLACEHOLDERS | {"model_dir": ctx.model, "path": ctx.model}
    free = _free_names(tree)
    unknown = free - set(values) - {"engine"}
    assert not unknown, f"names neither bound in the block nor PLACEHOLDERS: {sorted(unknown)}"
    ns: dict[str, Any] = {"__name__": "doc_block", **{n: values[n] for n in free & set(values)}}

    async def run() -> None:
        async with contextlib.AsyncExitStack() as stack:
            if "engine" in free:
                ns["engine"] = (await stack.enter_async_context(open_test_engine())).engine
            result = eval(code, ns)
            if inspect.iscoroutine(result):
                await result

    try:
        with mock.patch.object(gezel_trio, "open_engine", _scripted_open_engine):
            if "engine" in free or code.co_flags & inspect.CO_COROUTINE:
                trio.run(run)
            else:
                exec(code, ns)
    except Exception as exc:
        raise AssertionError(f"the block raised {exc!r}") from exc
    _check_class_patterns(tree, ns)


@asynccontextmanager
async def _scripted_open_engine(config: Any, *args: Any, **kw: Any) -> AsyncIterator[Any]:
    """``open_engine`` for a block: its config checked, the engine scripted."""
    assert isinstance(config, gezel_trio.EngineConfig)
    async with open_test_engine() as t:
        yield t.engine


def _free_names(tree: ast.AST) -> set[str]:
    """Names the block reads and never binds (a block is one scope to its
    reader, so any binding anywhere counts)."""
    read, bound = set(), set(dir(builtins))
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, ast.alias):
            bound.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.MatchAs | ast.MatchStar) and node.name:
            bound.add(node.name)
    return read - bound


def _check_class_patterns(tree: ast.AST, ns: dict[str, Any]) -> None:
    """``case TextDelta(text=text)``: the class has ``text``, whether or not
    the run met such an event."""
    for node in ast.walk(tree):
        if isinstance(node, ast.MatchClass) and isinstance(node.cls, ast.Name):
            cls = ns[node.cls.id]
            fields = attrs.fields_dict(cls) if attrs.has(cls) else vars(cls)
            missing = [k for k in node.kwd_attrs if k not in fields and not hasattr(cls, k)]
            assert not missing, f"case {cls.__name__}(...): no attribute {missing}"


# --- json and toml


def check_json(block: Block, ctx: Ctx) -> None:
    try:
        value = json.loads(block.text)
    except ValueError as exc:
        raise AssertionError(f"not JSON: {exc}") from None
    if isinstance(value, dict) and value.get("$schema") == "https://opencode.ai/config.json":
        check_config("opencode", value, _real_clients.opencode_config(ADDRESS, 1024), block, ctx)
        return
    if isinstance(value, dict) and set(value) == {"env"}:  # Claude Code's settings.json
        check_config("claude-code", value["env"], driven_env("claude-code"), block, ctx)
        return
    route = _route(block, value)
    response = httpx.post(ctx.server.url + route, json=value, timeout=60)
    assert response.is_success, f"POST {route}: {response.status_code} {response.text[:300]}"


def _route(block: Block, body: Any) -> str:
    """The route a request body goes to: named in the info string
    (``json POST /v1/messages``), else known by its fields."""
    words = block.info.split()[1:]
    if words[:1] == ["POST"] and len(words) == 2:
        return words[1]
    fields = set(body) if isinstance(body, dict) else set()
    for field, route in (("input", "/v1/responses"), ("prompt", "/v1/completions")):
        if field in fields:
            return route
    if "messages" in fields:
        return "/v1/chat/completions"
    raise AssertionError("neither a request body (```json POST /v1/...) nor a client config")


def check_toml(block: Block, ctx: Ctx) -> None:
    try:
        value = tomllib.loads(block.text)
    except ValueError as exc:
        raise AssertionError(f"not TOML: {exc}") from None
    assert {"model_providers", "openai_base_url"} & set(value), "no check for this TOML"
    check_config("codex", value, tomllib.loads(_real_clients.codex_config(ADDRESS)), block, ctx)


# --- client configurations


def check_config(
    client: str, doc: dict[str, Any], driven: dict[str, Any], block: Block, ctx: Ctx
) -> None:
    flat, drove = _flat(doc), _flat(driven)
    if "openai_base_url" in flat:
        provider = drove["model_providers.gezel.base_url"]
        assert flat["openai_base_url"] == provider, f"openai_base_url is not {provider}"
    compare(client, flat, drove, block)
    for value in flat.values():
        if isinstance(value, str) and value.startswith(ADDRESS):
            check_address(client, value, ctx.server)


def compare(client: str, doc: dict[str, Any], driven: dict[str, Any], block: Block) -> None:
    """Each setting the doc gives is the bench's, or listed with why; a
    client page gives every setting the bench gave, or lists why not."""
    fitted, doc_only = FITTED.get(client, {}), DOC_ONLY.get(client, {})
    wrong = [
        f"{k} = {v!r}, the bench drove {driven.get(k, 'no such setting')!r}"
        for k, v in doc.items()
        if k not in fitted and k not in doc_only and driven.get(k, object()) != v
    ]
    whole = block.path.startswith("docs/clients/") and not listed(block, VARIANTS)
    if whole:
        wrong += [
            f"{k} = {v!r} was driven; the doc leaves it out"
            for k, v in driven.items()
            if k not in doc and k not in fitted and k not in DRIVER_ONLY.get(client, {})
        ]
    assert not wrong, f"{client} config unlike the driven one: " + "; ".join(wrong)


def check_address(client: str, url: str, server: Server) -> None:
    """``url`` from a config leads where the recorded client went, and the
    server answers a request there."""
    path = urllib.parse.urlsplit(url).path.rstrip("/") + CLIENT_ROUTE[client]
    (recorded,) = (ROOT / "tests" / "fixtures" / "clients").glob(f"{client}-*/request-1.json")
    went = urllib.parse.urlsplit(json.loads(recorded.read_text())["path"]).path
    assert path == went, f"{url} leads {client} to {path}; it requested {went}"
    response = httpx.post(server.url + path, json=SMALLEST[path], timeout=60)
    assert response.is_success, f"POST {path}: {response.status_code} {response.text[:300]}"


def driven_env(client: str) -> dict[str, str]:
    """The variables the bench sets for ``client`` (not those it passes on)."""
    with tempfile.TemporaryDirectory() as home:
        env = _real_clients.client_env(client, Path(home), ADDRESS, 1024)
    return {k: v for k, v in env.items() if os.environ.get(k) != v}


def _driven_env_names() -> set[str]:
    return {name for client in _real_clients.CLIENTS for name in driven_env(client)}


def _flat(value: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in value.items():
        if isinstance(v, dict) and v:
            out |= _flat(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = v
    return out


# --- the checks catch what they are for


WRONG = {  # a block, and what the check says of it
    "unknown serve flag": ("sh", "gezel-trio serve --no-such", "unrecognized arguments: --no-such"),
    "serve value out of range": ("sh", "gezel-trio serve --max-concurrency -3", ">= 1, got -3"),
    "unknown scenario": ("sh", "python -m bench no_such", "unknown scenario 'no_such'"),
    "another scenario's flag": ("sh", "python -m bench matmul --sections health", "none of matmul"),
    "bad mlx.launch value": ("sh", "mlx.launch -n none gezel-trio serve", "-n: invalid"),
    "flag under mlx.launch": ("sh", "mlx.launch -n 2 gezel-trio serve --no-such", "gezel-trio: "),
    "unknown router flag": ("sh", "vllm-router --no-such 1", "unrecognized arguments: --no-such"),
    "unknown extra": ("sh", "pip install 'gezel-trio[no-such]'", "no extra ['no-such']"),
    "unread variable": ("sh", "export GEZEL_NO_SUCH=1", "reads GEZEL_NO_SUCH"),
    "undriven agent flag": ("sh", "claude --no-such -p hello", "not how the bench drives it"),
    "unknown command": ("sh", "rm -rf build", "no check for `rm`"),
    "curl 404": ("sh", f"curl {ADDRESS}/v1/no-such-route", "curl: status 404"),
    "failing python": ("python", "import gezel_trio\ngezel_trio.no_such\n", "AttributeError"),
    "wrong class pattern": (
        "python",
        "from gezel_trio import TextDelta\nmatch None:\n    case TextDelta(txt=t): pass\n",
        "no attribute ['txt']",
    ),
    "bad request body": ("json", '{"messages": "not a list"}', "400"),
    "codex setting not driven": (
        "toml",
        'model = "other"\n[model_providers.gezel]\nname = "gezel-trio"\n',
        "model = 'other', the bench drove 'gezel'",
    ),
    "claude setting not driven": ("json", '{"env": {"ANTHROPIC_MODEL": "x"}}', "drove 'gezel'"),
    "unlisted illustration": ("text", "a picture\n", "ILLUSTRATIONS lacks"),
    "no info string": ("", "anything\n", "no info string"),
}


@pytest.mark.parametrize("case", WRONG)
def test_a_wrong_block_fails(case: str, ctx: Ctx) -> None:
    lang, text, says = WRONG[case]
    (block,) = parse_blocks("README.md", f"```{lang}\n{text}\n```\n")
    with pytest.raises(AssertionError, match=re.escape(says)):
        check_block(block, ctx)


RIGHT = {  # what a shell reads as it does
    "console prompts and output": "$ gezel-trio serve --help\nusage: gezel-trio serve ...\n",
    "continued lines, comments": "gezel-trio serve \\\n    --port 8081  # a comment\n",
    "substitution, separators": 'M=$(gezel-trio prepare-model); gezel-trio serve --model "$M" &',
    "a launched program": "mlx.launch --hosts 127.0.0.1 -n 2 -- .venv/bin/gezel-trio serve",
}


@pytest.mark.parametrize("case", RIGHT)
def test_a_right_shell_block_passes(case: str, ctx: Ctx) -> None:
    lang = "console" if case.startswith("console") else "sh"
    (block,) = parse_blocks("README.md", f"```{lang}\n{RIGHT[case]}\n```\n")
    check_block(block, ctx)


def test_commands_are_read_as_a_shell_reads_them() -> None:
    text = (
        "export A=http://h/#x B='1 # 2'  # a comment\n"
        "M=$(gezel-trio prepare-model) && X=1 gezel-trio serve \\\n"
        '    --model "$M" & python -m bench --list; echo done | cat\n'
    )
    (block,) = parse_blocks("README.md", f"  ```sh\n  {text.replace(chr(10), chr(10) + '  ')}```\n")
    assert commands(block) == [
        ["export", "A=http://h/#x", "B=1 # 2"],
        ["gezel-trio", "prepare-model"],
        ["gezel-trio", "serve", "--model", "$M"],
        ["python", "-m", "bench", "--list"],
        ["echo", "done"],
        ["cat"],
    ]
    (console,) = parse_blocks("README.md", "```console\n$ gezel-trio --help\nusage: ...\n```\n")
    assert commands(console) == [["gezel-trio", "--help"]]
