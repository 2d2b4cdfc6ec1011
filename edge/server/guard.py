"""Who may talk to `edge serve`: the Host and Origin checks, CORS, and the API key.

A server on loopback is still reachable from a web browser on the same machine, in two ways
this module closes:

- DNS rebinding (the class of Ollama's CVE-2024-28224): a page of ``evil.example`` makes its
  name resolve to 127.0.0.1 and then talks to the server as a same-origin site. Its requests
  carry ``Host: evil.example:PORT``. Only Host names that cannot be rebound are answered:
  IP addresses (a browser sends one only when the user typed it), ``localhost`` and
  ``*.localhost``, this machine's host name, the ``--host`` value, and the names given to
  ``--allowed-hosts`` (``*`` = any). Others get a 403.
- Cross-site requests: a page of another site can send a "simple" POST (``text/plain``, no
  preflight) to any address. Requests with an ``Origin`` header are served only for origins on
  loopback (any port), desktop apps' pages (app://, file://, tauri://, vscode-webview://,
  vscode-file://: Ollama's defaults) and those given to ``--cors-origins`` (``*`` = any);
  others get a 403 before anything runs. Allowed origins get CORS headers (starlette's
  CORSMiddleware answers their preflight). POST bodies must be ``application/json`` besides
  (protocol.check_content_type), which no simple request can send.

Clients that are not browsers (curl, the openai SDK) send no Origin and a loopback Host.
Every refusal is the error shape of the API the path belongs to (``respond``: OpenAI's unless
the app says otherwise, e.g. Anthropic's under /v1/messages) with a 4xx status.
"""
from __future__ import annotations

import hmac
import ipaddress
import re
import socket

from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse

from edge.server.protocol import APIError


def openai_error(path: str, err: APIError) -> JSONResponse:
    """``err`` in OpenAI's shape (the default ``respond`` of the middleware)."""
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

_LOOPBACK_ORIGIN = re.compile(r"https?://(localhost|[a-z0-9.-]+\.localhost|127(\.[0-9]{1,3}){3}|\[::1\])"
                              r"(:[0-9]{1,5})?"
                              # desktop apps' own pages, allowed by Ollama's default OLLAMA_ORIGINS too
                              r"|(app|file|tauri|vscode-webview|vscode-file):(//.*)?")
_ORIGIN = re.compile(r"[a-z][a-z0-9+.-]*://[^/?#\s]+")
_WILDCARD_HOSTS = {"0.0.0.0", "::", ""}


def host_name(host_header: str) -> str:
    """The name or address of a Host header, lowercased, without port, brackets or a
    trailing dot ("[::1]:8080" -> "::1", "LocalHost.:80" -> "localhost")."""
    h = host_header.strip().lower()
    if h.startswith("["):
        end = h.find("]")
        h = h[1:end] if end > 0 else h[1:]
    elif h.count(":") == 1:
        h = h.split(":", 1)[0]
    return h.rstrip(".")


def parse_origins(text: str | None, flag: str = "--cors-origins") -> tuple[str, ...]:
    """A comma-separated list of origins ("scheme://host[:port]" or "*"), normalized
    (lowercase, no trailing /). Raises ValueError naming ``flag`` for an entry that is not one."""
    out = []
    for item in (text or "").split(","):
        item = item.strip().lower().rstrip("/")
        if not item:
            continue
        if item != "*" and not _ORIGIN.fullmatch(item):
            raise ValueError(f"{flag}: {item!r} is not an origin (scheme://host[:port], e.g. "
                             "http://localhost:3000, or * for any)")
        out.append(item)
    return tuple(out)


def parse_hosts(text: str | None, flag: str = "--allowed-hosts") -> tuple[str, ...]:
    """A comma-separated list of host names ("*" = any), normalized as host_name() does.
    Raises ValueError naming ``flag`` for an entry with a scheme, path or space."""
    out = []
    for item in (text or "").split(","):
        item = item.strip()
        if not item:
            continue
        if item != "*" and (re.search(r"[/\s@]", item) or not host_name(item)):
            raise ValueError(f"{flag}: {item!r} is not a host name (e.g. myhost.lan, or * for any)")
        out.append(item if item == "*" else host_name(item))
    return tuple(out)


class HostOriginGuard:
    """ASGI middleware: 403 for a Host that could be a rebound name or an Origin not allowed
    (see the module docstring); everything else passes on."""

    def __init__(self, app, listen_host: str = "127.0.0.1", allowed_hosts: tuple[str, ...] = (),
                 cors_origins: tuple[str, ...] = (), respond=openai_error):
        self.app, self.respond = app, respond
        names = {"localhost", host_name(socket.gethostname()), *allowed_hosts}
        for host in listen_host.split(","):     # --host may list several addresses
            if host.strip() not in _WILDCARD_HOSTS:
                names.add(host_name(host.strip()))
        self.any_host = "*" in allowed_hosts
        self.names = names
        self.any_origin = "*" in cors_origins
        self.origins = set(cors_origins)

    def host_allowed(self, header: str | None) -> bool:
        """True for an absent Host (HTTP/1.0), an IP address, localhost, *.localhost or an allowed name."""
        if self.any_host or header is None:
            return True
        name = host_name(header)
        try:
            ipaddress.ip_address(name)
            return True
        except ValueError:
            pass
        return name in self.names or name.endswith(".localhost")

    def origin_allowed(self, origin: str) -> bool:
        """True for a loopback origin, a desktop app's page or one given to --cors-origins."""
        o = origin.strip().lower().rstrip("/")
        return self.any_origin or o in self.origins or bool(_LOOPBACK_ORIGIN.fullmatch(o))

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        host = origin = None
        for k, v in scope["headers"]:
            if k == b"host":
                host = v.decode("latin-1")
            elif k == b"origin":
                origin = v.decode("latin-1")
        err = None
        if not self.host_allowed(host):
            err = APIError(403, f"Host {host!r} is not allowed: this server answers requests addressed to localhost "
                                "or an IP address (a page of another site can reach a local server under its own "
                                "name by DNS rebinding); allow a name with --allowed-hosts", code="host_not_allowed")
        elif origin is not None and not self.origin_allowed(origin):
            err = APIError(403, f"Origin {origin!r} is not allowed: web pages of other sites may not use this "
                                f"server; allow this one with --cors-origins {origin}", code="origin_not_allowed")
        if err is not None:
            await self.respond(scope["path"], err)(scope, receive, send)
            return
        await self.app(scope, receive, send)


class RequireAPIKey:
    """ASGI middleware: every HTTP route but /health needs ``Authorization: Bearer KEY`` or
    ``x-api-key: KEY`` (Anthropic's header, which Claude Code sends), compared in constant
    time; otherwise a 401 (``respond``'s shape)."""

    def __init__(self, app, key: str, respond=openai_error):
        self.app, self.respond = app, respond
        self.want = key.encode()

    def _given(self, headers) -> bool:
        for k, v in headers:
            if k == b"authorization":
                scheme, _, token = v.partition(b" ")
                if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.want):
                    return True
            elif k == b"x-api-key" and hmac.compare_digest(v.strip(), self.want):
                return True
        return False

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in ("/health", "/v1/health") and not self._given(scope["headers"]):
            err = APIError(401, "invalid or missing API key (Authorization: Bearer KEY or x-api-key: KEY)",
                           code="invalid_api_key")
            await self.respond(scope["path"], err)(scope, receive, send)
            return
        await self.app(scope, receive, send)


def check_api_key(key: str | None, source: str = "--api-key") -> None:
    """Raise ValueError naming ``source`` for a key that would turn authentication off or
    could never be sent: empty, with surrounding whitespace, or not printable ASCII."""
    if key is None:
        return
    if not key.strip():
        raise ValueError(f"{source} is empty, which would turn authentication off; give a key, or leave "
                         f"{source} out to serve without one")
    if key != key.strip() or not all(" " <= c <= "~" for c in key):
        raise ValueError(f"{source} must be printable ASCII without leading or trailing spaces (a client "
                         "could never send it in 'Authorization: Bearer KEY')")


def middleware(listen_host: str, allowed_hosts: tuple[str, ...], cors_origins: tuple[str, ...],
               api_key: str | None, respond=openai_error) -> list[Middleware]:
    """The app's middleware, outermost first: the Host/Origin guard, CORS for the origins it
    let through (every Origin that reaches CORSMiddleware is allowed), then the API key (a
    preflight carries none: CORSMiddleware has answered it). ``respond(path, APIError)``
    gives a refusal's response."""
    check_api_key(api_key)
    out = [Middleware(HostOriginGuard, listen_host=listen_host, allowed_hosts=allowed_hosts,
                      cors_origins=cors_origins, respond=respond),
           Middleware(CORSMiddleware, allow_origin_regex=".*", allow_methods=["GET", "POST", "OPTIONS"],
                      allow_headers=["*"], allow_private_network=True,   # Chrome's preflight to loopback
                      expose_headers=["Retry-After"], max_age=600)]
    if api_key is not None:
        out.append(Middleware(RequireAPIKey, key=api_key, respond=respond))
    return out
