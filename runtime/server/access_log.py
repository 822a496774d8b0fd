"""One line per HTTP request on the `freetoken.access` logger: method, path, status, duration.

Pure ASGI (not BaseHTTPMiddleware) so streaming bodies and client disconnects pass through untouched.
The line is written when the response ends, so a stream's duration is the whole stream's.
"""
from __future__ import annotations

import logging
import time

log = logging.getLogger("freetoken.access")


class AccessLogMiddleware:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = time.monotonic()
        status = {"code": 0}

        async def send_and_note(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            query = scope.get("query_string", b"").decode("latin-1")
            path = scope.get("path", "") + (f"?{query}" if query else "")
            log.info("%s %s %d %.0f ms", scope.get("method", "?"), path, status["code"],
                     (time.monotonic() - started) * 1000)
