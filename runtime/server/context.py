"""What every route needs: the service, the server's settings, and the loaded model (waiting while it loads)."""
from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass

from fastapi import Request

from runtime.server.errors import APIError
from runtime.server.security import SecurityConfig
from runtime.service import ModelInfo, Service

LOAD_POLL_S = 0.05


@dataclass(frozen=True)
class ServerConfig:
    security: SecurityConfig = SecurityConfig()
    port: int = 1919
    load_wait_s: float = 60.0      # a request that arrives while a model loads waits this long, then 503
    served_name: str | None = None  # model id to advertise instead of the engine's


def service_of(request: Request) -> Service:
    return request.app.state.service


def config_of(request: Request) -> ServerConfig:
    return request.app.state.config


async def current_model(request: Request) -> ModelInfo:
    """The loaded model; while one is loading, wait up to load_wait_s; else a 503 in the caller's shape."""
    service = service_of(request)
    deadline = time.monotonic() + config_of(request).load_wait_s
    while service.state == "loading" and time.monotonic() < deadline:
        await asyncio.sleep(LOAD_POLL_S)
    model = service.model
    if model is None:
        if service.state == "loading":
            raise APIError("unavailable", "the model is still loading; retry in a moment")
        reason = f" (the last load failed: {service.load_error})" if service.load_error else ""
        raise APIError("unavailable", f"no model is loaded{reason}; load one in the app or start "
                                      f"`freetoken serve MODEL`")
    return model


def advertised_id(request: Request, model: ModelInfo) -> str:
    return config_of(request).served_name or model.model_id


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())
