"""Tenants: each API key is one, and what one makes is its own.

A server without ``--api-key`` has one tenant, the empty one: its names and
salts are what they always were. With keys (``--api-key``, repeated, and
``--api-key-file``), the key a request brings names its tenant, and inside the
server the tenant is a short id derived from the key (a sha256 prefix), never
the key: that id is what logs, stats and files may hold.

Enforced here, at the HTTP edge, so the engine needs no notion of tenants:

* **Names.** A cache id, prefix id or a Responses chain's ``responses:<id>``
  is namespaced on the way in (``<tenant id>\\x1f<name>``: the separator is a
  control character, which no client id may hold) and stripped on the way
  out; another tenant's names are never listed, evicted, warmed or seeded.
* **Salts.** Every request's prompt-cache salt (``CacheRequest.salt``) is
  the tenant's id, and with a request's own ``cache_salt`` also its digest:
  a prompt reuses only what prompts of the same tenant and salt left.
* **Stored responses** carry their tenant (``StoredResponse.owner``);
  another tenant's id is answered as an unknown one.
* **Bodies after keys.** A request without a valid key never has its body
  read (``bodies_after_keys``, in front of the app): Quart reads a body
  as it arrives, beside the checks, so 40 unauthenticated 7 MB uploads
  once took 280 MB before their 401s.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import trio
from quart import g
from werkzeug.datastructures import Headers

from ..core.prepare import ChatRequest
from .edge import closing
from .probe import HEALTH_PATH

__all__ = [
    "NO_TENANT",
    "KeyRing",
    "Tenant",
    "bodies_after_keys",
    "current_tenant",
    "public_name",
    "read_key_file",
    "tenant_id",
]

# Between a tenant's id and a name: refused in every id a client sends
# (``checks.check_cache_id``), so the split is never ambiguous.
SEP = "\x1f"


def tenant_id(key: str) -> str:
    """The stable id of the tenant ``key`` is: 16 hex digits of a sha256,
    from which the key cannot be read back."""
    return hashlib.sha256(b"gezel-tenant\0" + key.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def public_name(name: str) -> str:
    """A cache name as its tenant wrote it (the namespace stripped)."""
    return name.split(SEP, 1)[1] if SEP in name else name


@attrs.frozen
class Tenant:
    """One tenant: ``id`` is ``""`` for the one tenant of a server without keys."""

    id: str = ""

    def name(self, cache_id: str | None) -> str | None:
        """``cache_id`` as the engine knows it: in this tenant's namespace."""
        if cache_id is None or not self.id:
            return cache_id
        return f"{self.id}{SEP}{cache_id}"

    def own(self, name: str) -> str | None:
        """The tenant's own name for the engine's ``name``; ``None`` when the
        name is another tenant's."""
        if not self.id:
            return None if SEP in name else name
        prefix = self.id + SEP
        return name[len(prefix) :] if name.startswith(prefix) else None

    def salt(self, cache_salt: str | None) -> str:
        """The engine's salt for a request of this tenant with ``cache_salt``:
        the tenant's id, then the digest of the request's salt (the salt
        itself is never kept)."""
        if cache_salt is None:
            return self.id
        digest = hashlib.sha256(cache_salt.encode("utf-8", "surrogatepass")).hexdigest()[:32]
        return f"{self.id}{SEP}{digest}"

    def owns_salt(self, salt: str) -> bool:
        return salt == self.id or salt.startswith(self.id + SEP)

    def chat(self, chat: ChatRequest, cache_salt: str | None) -> ChatRequest:
        """``chat`` as this tenant's: its names namespaced, its salt set."""
        return attrs.evolve(
            chat,
            cache_id=self.name(chat.cache_id),
            prefix_ids=tuple(self.name(p) or p for p in chat.prefix_ids),
            cache_salt=self.salt(cache_salt),
        )


NO_TENANT = Tenant()


def current_tenant() -> Tenant:
    """The tenant of the request being served (the app's key check sets it)."""
    tenant = g.get("gezel_tenant")
    return tenant if isinstance(tenant, Tenant) else NO_TENANT


def read_key_file(path: Path) -> tuple[str, ...]:
    """The keys in ``path``: one a line, blank lines and ``#`` comments
    skipped, surrounding whitespace dropped. ``ValueError`` (naming the
    file) when it cannot be read or holds no key."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise ValueError(f"--api-key-file {path}: cannot be read ({reason})") from None
    keys = []
    for line in text.splitlines():
        key = line.strip()
        if key and not key.startswith("#"):
            keys.append(key)
    if not keys:
        raise ValueError(f"--api-key-file {path}: holds no key (one a line, # comments)")
    return tuple(keys)


class KeyRing:
    """The server's keys, each a tenant. Empty: no key is asked for."""

    def __init__(self, keys: Iterable[str]) -> None:
        # By the sha256 of the key: a request's key is found in one lookup by
        # its digest, then compared with the key in constant time.
        self._keys: Mapping[bytes, str] = {_digest(k): k for k in keys}

    @classmethod
    def of(cls, keys: Sequence[str], key_file: Path | None) -> KeyRing:
        return cls([*keys, *(read_key_file(key_file) if key_file is not None else ())])

    def __bool__(self) -> bool:
        return bool(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def tenant(self, headers: Any) -> Tenant | None:
        """The tenant whose key ``headers`` carry (``Authorization: Bearer
        KEY``, OpenAI's clients, or ``x-api-key: KEY``, Anthropic's); ``None``
        for a missing or wrong key. Both headers are looked at every time."""
        bearer = headers.get("Authorization", "")
        found = [
            self._match(bearer[7:] if bearer.startswith("Bearer ") else None),
            self._match(headers.get("x-api-key") or None),
        ]
        for key in found:
            if key is not None:
                return Tenant(tenant_id(key))
        return None

    def _match(self, given: str | None) -> str | None:
        if given is None:
            return None
        key = self._keys.get(_digest(given))
        if key is None or not hmac.compare_digest(key.encode(), given.encode()):
            return None
        return key


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


# The ASGI callable the server serves.
Asgi = Callable[[Any, Any, Any], Awaitable[None]]

# What a withheld request's app reads: an empty body.
_NO_BODY = {"type": "http.request", "body": b"", "more_body": False}


def bodies_after_keys(app: Asgi, keys: KeyRing) -> Asgi:
    """``app`` with the body withheld from every request that may not send
    one: with ``keys``, one without a valid key, and a ``/health`` probe
    always (it reads none). ``app`` reads an empty body and answers from
    the headers (the key check's 401, the probe's answer), and the
    connection closes after that answer when a body was announced, so the
    body is never read, buffered or waited for.

    Cancellation: as ``app``'s."""

    async def keyed(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        if scope["path"] != HEALTH_PATH:
            if not keys:
                await app(scope, receive, send)
                return
            if keys.tenant(_headers(scope)) is not None:
                await app(scope, receive, send)
                return
        await app(scope, _withheld(), _closing_if_body(scope, send))

    return keyed


def _headers(scope: Any) -> Headers:
    """The request's headers, as Quart reads them from ``scope``."""
    return Headers([(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]])


def _withheld() -> Callable[[], Awaitable[dict[str, Any]]]:
    """An ASGI ``receive`` that gives an empty body, then waits (the app
    stops listening as its response ends)."""
    given = False

    async def receive() -> dict[str, Any]:
        nonlocal given
        if not given:
            given = True
            return dict(_NO_BODY)
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    return receive


def _closing_if_body(scope: Any, send: Any) -> Any:
    """``send``, its response closing the connection when the request
    announced a body (which stays unread)."""
    announced = any(
        (name == b"content-length" and value.strip() != b"0") or name == b"transfer-encoding"
        for name, value in scope["headers"]
    )
    return closing(send) if announced else send
