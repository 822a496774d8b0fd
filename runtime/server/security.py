"""The gate every request passes before a route sees it: Host, Origin, API key, body size.

- Host (DNS rebinding): a web page can make a browser send requests to 127.0.0.1 under its own domain
  name; the Host header then names that domain. We serve only Host values that are the bound address
  or a loopback name. Binding all interfaces (0.0.0.0 / ::) requires an API key, which is then what
  protects the server, so any Host is accepted there.
- Origin (cross-site requests): a browser sends Origin on cross-origin requests; unless CORS is enabled
  for that origin the request is refused, so a page cannot spend the user's compute with a blind POST.
  Clients that are not browsers send no Origin.
- API key: `Authorization: Bearer KEY` (OpenAI) or `x-api-key: KEY` (Anthropic); compared in constant
  time. `/` and `/health` stay open for liveness probes.
- Body size: refused past `max_body_bytes`, from Content-Length when given and by counting otherwise.

Written as plain ASGI so it also covers paths no route matches and streams it never buffers twice.
"""
from __future__ import annotations

import hmac
import ipaddress
from dataclasses import dataclass, field

from runtime.server.errors import error_response, is_anthropic

LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1", "[::1]"}
OPEN_PATHS = {"/", "/health"}
DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024   # an agent's first turn is ~80 KB; 16 MB leaves room for images


class SecurityConfigError(ValueError):
    """A server configuration that would be unsafe (e.g. a public bind without an API key)."""


def is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def binds_all_interfaces(host: str) -> bool:
    return host.strip("[]") in ("0.0.0.0", "::", "")


@dataclass(frozen=True)
class SecurityConfig:
    host: str = "127.0.0.1"
    api_key: str | None = None
    cors_origins: tuple[str, ...] = ()        # empty: CORS off; ("*",) allows every origin
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    extra_hosts: tuple[str, ...] = field(default=())   # more Host names to accept (a LAN name, a proxy)

    def check(self) -> None:
        if not is_loopback(self.host) and not self.api_key:
            raise SecurityConfigError(
                f"binding {self.host} exposes the API beyond this machine; set an API key (--api-key) "
                f"or bind 127.0.0.1")


def _host_name(host_header: str) -> str:
    """'example.com:1919' -> 'example.com'; '[::1]:1919' -> '[::1]'."""
    if host_header.startswith("["):
        return host_header[: host_header.find("]") + 1]
    return host_header.rsplit(":", 1)[0] if host_header.count(":") == 1 else host_header


class SecurityMiddleware:
    def __init__(self, app, config: SecurityConfig):
        self.app = app
        self.config = config
        bound = config.host.strip("[]")
        self._hosts = {h.lower() for h in LOOPBACK_NAMES | {bound, f"[{bound}]"} | set(config.extra_hosts)}
        self._any_host = binds_all_interfaces(config.host)
        self._key = (config.api_key or "").encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        path = scope.get("path", "")
        anthropic = is_anthropic(path, headers)

        async def refuse(kind: str, message: str, extra_headers: dict | None = None):
            # drain nothing: the connection is answered and closed by the server
            await error_response(anthropic, kind, message, headers=extra_headers)(scope, receive, send)

        host = _host_name(headers.get("host", "")).lower()
        # no Host at all (HTTP/1.0 tools) cannot come from a browser, so it cannot be a rebinding attack
        if host and not self._any_host and host not in self._hosts:
            return await refuse("permission", f"Host header {headers.get('host', '')!r} is not this server's "
                                              f"address; refused to protect against DNS rebinding")
        origin = headers.get("origin")
        if origin and not self._origin_allowed(origin):
            return await refuse("permission", f"cross-origin request from {origin} refused (CORS is not enabled "
                                              f"for it)")
        if self._key and path not in OPEN_PATHS and scope.get("method") != "OPTIONS":
            given = headers.get("x-api-key") or ""
            auth = headers.get("authorization", "")
            if auth.lower().startswith("bearer "):
                given = given or auth[7:].strip()
            if not given:
                return await refuse("authentication", "an API key is required: send 'Authorization: Bearer KEY' "
                                                      "or 'x-api-key: KEY'")
            if not hmac.compare_digest(given.encode(), self._key):
                return await refuse("authentication", "the API key is not valid")
        limit = self.config.max_body_bytes
        declared = headers.get("content-length")
        if declared is not None:
            if not declared.isdigit():
                return await refuse("invalid_request", f"Content-Length {declared!r} is not a number")
            if int(declared) > limit:
                return await refuse("too_large", f"the request body is {declared} bytes; the limit is {limit}")
        if scope.get("method") in ("POST", "PUT", "PATCH"):
            chunks, size = [], 0
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > limit:
                    return await refuse("too_large", f"the request body exceeds the limit of {limit} bytes")
                chunks.append(chunk)
                if not message.get("more_body"):
                    break
            replayed = False

            async def replay():
                nonlocal replayed
                if not replayed:
                    replayed = True
                    return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
                return await receive()   # later: http.disconnect, which streaming routes listen for

            return await self.app(scope, replay, send)
        return await self.app(scope, receive, send)

    def _origin_allowed(self, origin: str) -> bool:
        allowed = self.config.cors_origins
        return "*" in allowed or origin in allowed
