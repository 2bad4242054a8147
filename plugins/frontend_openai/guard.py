"""What every request passes before a route: the Host check (DNS rebinding), the API key, 503
while the server drains, and the security headers on every answer (``_Guard``, ASGI
middleware). ``ServerState`` is what the guard shares with the shutdown."""

from __future__ import annotations

import asyncio
import ipaddress
import secrets
import time
from collections.abc import Sequence
from typing import Any

from .errors import RETRY_AFTER_S, APIError


# Routes outside /v1 that still need the API key (vLLM's tokenizer endpoints).
_KEYED_ROUTES = frozenset({"/tokenize", "/detokenize"})


class ServerState:
    """What the guard and the shutdown share: whether the server drains, and the requests
    (POST routes) it is still answering."""

    def __init__(self) -> None:
        self.draining = False
        self.inflight = 0

    async def wait_idle(self, timeout: float, stop: asyncio.Event | None = None) -> bool:
        """Wait until no request is in flight (True), ``timeout`` passes or ``stop`` is set."""
        deadline = time.monotonic() + timeout
        while self.inflight and time.monotonic() < deadline and not (stop and stop.is_set()):
            await asyncio.sleep(0.02)
        return not self.inflight


def default_allowed_hosts(host: str) -> list[str]:
    """The Host header values a server bound to ``host`` answers by default: any when bound to
    every interface, else the bind address, plus the loopback names when it is loopback."""
    try:
        ip: Any = ipaddress.ip_address(host)
    except ValueError:
        ip = None
    if ip is not None and ip.is_unspecified:
        return ["*"]
    hosts = [host.lower()]
    if host.lower() == "localhost" or (ip is not None and ip.is_loopback):
        hosts += [h for h in ("localhost", "127.0.0.1", "::1") if h not in hosts]
    return hosts


def host_allowed(header: str, allowed: Sequence[str]) -> bool:
    """Whether a Host header (port ignored) matches ``allowed``: exact names, ``*``, or
    ``*.example.com`` for the hosts of a domain."""
    if header.startswith("["):
        name = header[1:header.find("]")] if "]" in header else header[1:]
    elif header.count(":") == 1:
        name = header.partition(":")[0]
    else:
        name = header
    name = name.lower().rstrip(".")
    for pattern in allowed:
        pattern = pattern.lower()
        if pattern == "*" or name == pattern or (
                pattern.startswith("*.") and name.endswith(pattern[1:])):
            return True
    return False


_SECURITY_HEADERS = [(b"x-content-type-options", b"nosniff")]


def _with_security_headers(send: Any) -> Any:
    """``send`` adding the headers every response carries: ``nosniff`` keeps a browser from
    reading a JSON error or an event stream as HTML."""
    async def wrapped(message: Any) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), *_SECURITY_HEADERS]}
        await send(message)
    return wrapped


class _Guard:
    """ASGI middleware in front of every route: the Host check (DNS rebinding), the API key,
    and, while the server drains, 503 for new requests. It also counts the POST requests in
    flight, so the shutdown knows when they are done."""

    def __init__(self, app: Any, *, api_key: str | None, allowed_hosts: list[str],
                 state: ServerState) -> None:
        self.app, self.api_key, self.allowed_hosts, self.state = app, api_key, allowed_hosts, state

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        send = _with_security_headers(send)
        error = self.check(scope)
        if error is not None:
            await error.response()(scope, receive, send)
            return
        if scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        self.state.inflight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.inflight -= 1

    def check(self, scope: Any) -> APIError | None:
        headers = dict(scope["headers"])
        host = headers.get(b"host")
        if "*" not in self.allowed_hosts:
            # HTTP/1.0 lets a client leave Host out: without one the check cannot pass
            if host is None:
                return APIError(400, "no Host header: one of frontend.allowed_hosts is "
                                     "required", code="host_not_allowed")
            if not host_allowed(host.decode("latin-1"), self.allowed_hosts):
                return APIError(400, f"Host header {host.decode('latin-1')!r} is not allowed "
                                     "(frontend.allowed_hosts)", code="host_not_allowed")
        path = scope["path"]
        if self.api_key is not None and (path.startswith("/v1") or path in _KEYED_ROUTES):
            scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer" or not secrets.compare_digest(
                    token.strip(), self.api_key.encode()):
                return APIError(401, "missing or invalid API key: send 'Authorization: Bearer "
                                     "<key>'", code="invalid_api_key")
        if self.state.draining and (scope["method"] == "POST" or path == "/health"):
            return APIError(503, "the server is shutting down", code="server_shutting_down",
                            headers={"Retry-After": str(RETRY_AFTER_S)})
        return None
