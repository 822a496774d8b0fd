"""The FastAPI application: routes, error shapes, the security gate, and a runner on its own thread.

FastAPI + uvicorn: the ASGI stack vLLM and most local servers use; typed request models give 400s that
name the field, and the OpenAPI document comes for free (served at /openapi.json, fuzzed in the tests).
"""
from __future__ import annotations

import asyncio
import logging
import socket
import sys
import threading
import time

from fastapi import FastAPI, Request, Response

from runtime.server import anthropic_routes, openai_routes, responses_routes
from runtime.server.access_log import AccessLogMiddleware
from runtime.server.context import ServerConfig
from runtime.server.errors import install_handlers
from runtime.server.security import SecurityMiddleware
from runtime.service import Service

log = logging.getLogger(__name__)


def create_app(service: Service, config: ServerConfig | None = None) -> FastAPI:
    config = config or ServerConfig()
    config.security.check()
    app = FastAPI(title="FreeToken local API", version="1",
                  description="OpenAI- and Anthropic-compatible endpoints over the locally loaded model.")
    app.state.service = service
    app.state.config = config
    install_handlers(app)
    app.include_router(openai_routes.router)
    app.include_router(responses_routes.router)
    app.include_router(anthropic_routes.router)

    @app.get("/health", summary="Liveness and the model state")
    async def health(request: Request):
        svc: Service = request.app.state.service
        model = svc.model
        return {"status": "ok" if model else svc.state, "state": svc.state,
                "model": model.model_id if model else None, "requests_admitted": svc.pending(),
                "queue_limit": svc.max_queue}

    @app.get("/", summary="Probe")
    async def root():
        return Response(status_code=200)

    @app.head("/", summary="Probe (clients send HEAD / at start)")
    async def root_head():
        return Response(status_code=200)

    app.add_middleware(SecurityMiddleware, config=config.security)
    origins = config.security.cors_origins
    if origins:   # outermost, so it answers preflights before the security gate
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(origins), allow_methods=["*"], allow_headers=["*"])
    app.add_middleware(AccessLogMiddleware)   # outermost: refused requests are logged too
    return app


class ServerThread:
    """uvicorn on a thread of its own, for the worker and the tests; `stop()` ends it gracefully."""

    def __init__(self, app: FastAPI, *, host: str, port: int):
        import uvicorn

        self.host, self.port = host, port
        self._sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        if sys.platform != "win32":   # on Windows SO_REUSEADDR would let two servers share the port
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))          # bind now: a busy port is an error here, not in a thread
        self.port = self._sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                timeout_graceful_shutdown=3)
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._run, name="freetoken-http", daemon=True)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def _run(self) -> None:
        asyncio.run(self.server.serve(sockets=[self._sock]))

    def start(self, timeout_s: float = 10.0) -> "ServerThread":
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP server did not start on {self.url}")
            time.sleep(0.01)
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            self.server.force_exit = True
            self._thread.join(timeout_s)
        self._sock.close()
