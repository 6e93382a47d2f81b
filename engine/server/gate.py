"""The server's front door: which requests are served at all, decided before any work.

A local server without a key is reachable by every web page the user opens: a page can make the
browser send requests to ``127.0.0.1`` (a cross-site "simple" POST needs no CORS preflight), or
point its own domain at ``127.0.0.1`` and talk to the server as if same-origin (DNS
rebinding). :class:`RequestGate` refuses, with a 4xx and an error body in the API's shape:

* a ``Host`` header naming anything but this computer (``localhost``, a loopback address) or the
  configured ``--host`` (421: DNS rebinding); with a wildcard ``--host`` (0.0.0.0, ::) the key
  the server then requires is the guard instead;
* an ``Origin`` header other than the server's own and the ``--cors-origin`` list (403): only
  browsers send it, so command-line and SDK clients are unaffected;
* a POST whose body is not ``application/json`` (415): forms and ``text/plain`` are what a page
  may send cross-site without a preflight.
"""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit

WILDCARD_HOSTS = ("0.0.0.0", "::", "[::]")


def _is_loopback_name(host: str) -> bool:
    h = host.strip().lower().strip("[]")
    if h == "localhost":
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        pass
    # the IPv4 shorthands every resolver accepts (127.1, 0x7f.1, 2130706433) name loopback too
    if h and all(c in "0123456789abcdefx." for c in h):
        try:
            return ipaddress.ip_address(socket.inet_aton(h)).is_loopback
        except (OSError, ValueError):
            return False
    return False


def split_host(value: str) -> tuple[str, int | None]:
    """A Host header (``name``, ``name:port``, ``[v6]:port``) -> (name lowercased, port or None).
    Raises ValueError for a malformed one."""
    value = value.strip().lower()
    if not value:
        raise ValueError("empty Host")
    if value.startswith("["):
        end = value.find("]")
        if end < 0:
            raise ValueError("unclosed [")
        name, rest = value[1:end], value[end + 1:]
        if rest and not rest.startswith(":"):
            raise ValueError("junk after ]")
        port = rest[1:] if rest else None
    elif value.count(":") == 1:
        name, port = value.split(":")
    elif ":" in value:  # a bare IPv6 address
        name, port = value, None
    else:
        name, port = value, None
    if port is not None:
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError("bad port")
        return name, int(port)
    return name, None


def check_origin_syntax(origin: str) -> str:
    """An origin of ``--cors-origin``: ``scheme://host[:port]`` -> normalized (lowercase, no
    trailing slash). Raises ValueError saying what is wrong."""
    o = origin.strip().rstrip("/")
    parts = urlsplit(o)
    if o == "*":
        raise ValueError("'*' would let every web page use the model; list the origins of the pages "
                         "that may (e.g. http://localhost:3000)")
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path or parts.query:
        raise ValueError(f"{origin!r} is not an origin; write scheme://host[:port], e.g. http://localhost:3000")
    return o.lower()


class RequestGate:
    """Pure ASGI middleware applying the checks of the module docstring.

    host: the configured ``--host``; cors_origins: origins allowed besides the server's own;
    error: ``error(path, status, message, code, anthropic) -> starlette Response`` (the API's error
    shape; ``anthropic``: the request came from an Anthropic client);
    counted: ``counted(path, status)`` for each refusal (the /metrics request counts).
    """

    def __init__(self, app, host: str, cors_origins: tuple[str, ...], error, counted=None):
        self.app, self.error, self.counted = app, error, counted
        self.host = host.strip().lower().strip("[]")
        self.any_host = host.strip() in WILDCARD_HOSTS
        self.origins = frozenset(o.rstrip("/").lower() for o in cors_origins)

    def _host_ok(self, name: str) -> bool:
        return self.any_host or _is_loopback_name(name) or name == self.host

    def _own_origin(self, origin: str, scope) -> bool:
        """The server's own pages (none today, but a page it served may call it): same scheme,
        a loopback or configured host name and the port the server listens on."""
        parts = urlsplit(origin)
        server = scope.get("server") or (None, None)
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError:
            return False
        return (parts.scheme == "http" and parts.hostname is not None and self._host_ok(parts.hostname)
                and not self.any_host and port == server[1])

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {}
        for k, v in scope.get("headers", ()):
            headers.setdefault(k, v)
        path = scope.get("path", "")
        refusal = self._refusal(scope, headers)
        if refusal is not None:
            status, message, code = refusal
            if self.counted is not None:
                self.counted(path, status)
            # Anthropic's clients send anthropic-version: their refusals get Anthropic's shape anywhere
            return await self.error(path, status, message, code,
                                    anthropic=b"anthropic-version" in headers)(scope, receive, send)
        return await self.app(scope, receive, send)

    def _refusal(self, scope, headers) -> tuple[int, str, str] | None:
        raw_host = headers.get(b"host")
        if raw_host is not None:
            host = raw_host.decode("latin-1")
            try:
                name, _ = split_host(host)
            except ValueError:
                return 400, f"the Host header {host!r} is malformed", "invalid_host"
            if not self._host_ok(name):
                return (421, f"this server answers only requests addressed to this computer (Host "
                             f"localhost or 127.0.0.1), not {host!r}: a web page may have pointed its own "
                             f"domain here (DNS rebinding)", "host_not_allowed")
        raw_origin = headers.get(b"origin")
        if raw_origin is not None:
            origin = raw_origin.decode("latin-1").strip().rstrip("/").lower()
            if origin not in self.origins and not self._own_origin(origin, scope):
                if origin == "null":  # a sandboxed frame or a file:// page: no origin one could allow
                    return (403, "requests from web pages with the opaque origin 'null' (a sandboxed frame or a "
                                 "file:// page) are refused: a page must not use the model without the user's "
                                 "consent; serve the page from an http(s) origin and allow that one with colibri "
                                 "serve --cors-origin", "origin_not_allowed")
                return (403, f"requests from web pages of {origin!r} are refused: a page must not use the "
                             f"model without the user's consent; allow the origin with colibri serve "
                             f"--cors-origin {origin} (or in the app's server dialog)", "origin_not_allowed")
        if scope.get("method") == "POST":
            ctype = headers.get(b"content-type", b"").decode("latin-1")
            media = ctype.split(";")[0].strip().lower()
            if media != "application/json":
                shown = media or "none"
                return (415, f"the request body must be JSON sent with 'Content-Type: application/json' "
                             f"(got {shown}); e.g. curl -H 'Content-Type: application/json' -d @body.json",
                        "unsupported_media_type")
        return None

