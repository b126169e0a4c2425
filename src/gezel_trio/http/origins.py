"""Which Host and Origin headers a request may carry: what keeps a web page
the user happens to open from driving the server.

Two attacks need no key when the server has none:

* A page on another origin sends a "simple" request - a form POST as
  ``text/plain``, ``application/x-www-form-urlencoded`` or
  ``multipart/form-data``, or a bodiless POST - which a browser sends
  without asking the server first (no CORS preflight). Routes that take a
  JSON body refuse every other content type (``edge.json_body``); every
  state-changing request (POST, PUT, PATCH, DELETE) whose ``Origin`` names
  an origin that is not allowed is refused here, bodiless ones included
  (``/admin/flush``, ``/v1/responses/{id}/cancel``, the DELETEs).
* DNS rebinding: ``evil.example`` is made to resolve to the server's
  address, so the page's requests are same-origin to the browser and carry
  no foreign ``Origin``; only the ``Host`` header still says
  ``evil.example``. Bound to loopback, ``Host`` must be a loopback name;
  bound elsewhere without a key, an IP literal, a loopback name or a name
  given with ``--allowed-host``. With a key the page cannot authenticate,
  so any ``Host`` is served.

SDK clients send no ``Origin`` and JSON bodies, so none of this touches them.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from urllib.parse import urlsplit

import attrs

__all__ = ["LOOPBACK_HOSTS", "OriginPolicy", "host_name"]

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1", "[::1]"})

# The methods that change state; a browser sends GET and HEAD cross-origin
# freely, but their answers are not readable by the page without CORS.
_STATE_CHANGING = frozenset({"POST", "PUT", "PATCH", "DELETE"})
_DEFAULT_PORTS = {"http": "80", "https": "443"}


def host_name(host: str) -> str:
    """The name part of a Host header: ``[::1]:8080`` -> ``[::1]``, ``a:80`` -> ``a``."""
    host = host.lower()
    if host.startswith("["):
        return host[: host.find("]") + 1] if "]" in host else host
    return host.rsplit(":", 1)[0]


def _is_ip_literal(name: str) -> bool:
    try:
        ipaddress.ip_address(name.removeprefix("[").removesuffix("]"))
    except ValueError:
        return False
    return True


def _origin(value: str) -> tuple[str, str, str] | None:
    """``(scheme, host name, port)`` of an origin, default port filled in;
    ``None`` for ``null`` or anything that is not an http(s) origin."""
    try:
        parts = urlsplit(value.strip().lower())
        port = parts.port
    except ValueError:
        return None
    if parts.scheme not in _DEFAULT_PORTS or not parts.hostname:
        return None
    if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username:
        return None
    name = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return parts.scheme, name, str(port) if port is not None else _DEFAULT_PORTS[parts.scheme]


def _host_port(host: str, scheme: str) -> tuple[str, str]:
    """A Host header's name and port, the scheme's default port filled in."""
    name = host_name(host)
    rest = host.lower()[len(name) :]
    return name, rest[1:] if rest.startswith(":") and rest[1:] else _DEFAULT_PORTS[scheme]


def check_origins(values: Iterable[str]) -> tuple[str, ...]:
    """``--allowed-origin`` values as given; ``ValueError`` names one that is
    not an origin (``https://app.example``, ``http://10.0.0.2:3000``) or ``*``."""
    out = tuple(values)
    for value in out:
        if value != "*" and _origin(value) is None:
            raise ValueError(
                f"--allowed-origin {value!r} is not an origin: give scheme://host[:port], "
                "e.g. https://app.example, or * for any"
            )
    return out


@attrs.frozen
class OriginPolicy:
    """The Host and Origin rules of one server (see the module's docstring)."""

    loopback_bound: bool
    # Bound beyond loopback with no API key: Host is checked against rebinding.
    open_bind: bool
    allowed_hosts: frozenset[str]
    allowed_origins: frozenset[tuple[str, str, str]]
    any_origin: bool

    @classmethod
    def of(
        cls,
        bind_host: str,
        keyed: bool,
        allowed_hosts: Iterable[str],
        allowed_origins: Iterable[str],
    ) -> OriginPolicy:
        loopback = bind_host.lower() in LOOPBACK_HOSTS
        origins = tuple(allowed_origins)
        return cls(
            loopback_bound=loopback,
            open_bind=not loopback and not keyed,
            allowed_hosts=frozenset(host_name(h.strip()) for h in allowed_hosts),
            allowed_origins=frozenset(o for o in map(_origin, origins) if o is not None),
            any_origin="*" in origins,
        )

    def host_problem(self, host: str) -> str | None:
        """Why a request with this ``Host`` header is refused; ``None``: it is not."""
        name = host_name(host)
        if name in self.allowed_hosts:
            return None
        if self.loopback_bound:
            if name in LOOPBACK_HOSTS:
                return None
            return (
                f"host {host!r} is not allowed: this server is bound to loopback and "
                "answers only loopback names (add others with --allowed-host)"
            )
        if self.open_bind and not (name in LOOPBACK_HOSTS or _is_ip_literal(name)):
            return (
                f"host {host!r} is not allowed: without --api-key this server answers "
                "only an IP address or a name given with --allowed-host"
            )
        return None

    def origin_allowed(self, origin: str, host: str) -> bool:
        """Whether a browser page on ``origin`` may send state-changing
        requests: the server's own origin (``host``), a loopback one, or
        one given with ``--allowed-origin``."""
        if self.any_origin:
            return True
        parsed = _origin(origin)
        if parsed is None:
            return False  # "null": a sandboxed frame, a file: page, a privacy redirect
        scheme, name, _port = parsed
        if name in LOOPBACK_HOSTS or parsed in self.allowed_origins:
            return True
        return (name, parsed[2]) == _host_port(host, scheme)

    def origin_problem(self, method: str, origin: str | None, host: str) -> str | None:
        """Why a ``method`` request from ``origin`` is refused; ``None``: it is not."""
        if method.upper() not in _STATE_CHANGING or origin is None:
            return None
        if self.origin_allowed(origin, host):
            return None
        return (
            f"origin {origin!r} may not send {method.upper()} requests to this server "
            "(a web page on another origin); allow it with --allowed-origin"
        )

    def cors_origin(self, origin: str | None) -> str | None:
        """The ``Access-Control-Allow-Origin`` to answer ``origin`` with: only
        origins allowed by flag, so a page there can read what it sent for."""
        if origin is None:
            return None
        if self.any_origin:
            return "*"
        parsed = _origin(origin)
        return origin if parsed is not None and parsed in self.allowed_origins else None
