"""Every request leaves one access-log line with its method, path, status and duration."""
from __future__ import annotations

import logging

from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from fastapi.testclient import TestClient

from runtime.server.access_log import AccessLogMiddleware


def test_access_log_lines_carry_method_path_and_status(caplog):
    app = FastAPI()

    @app.post("/v1/messages")
    async def messages():
        async def body():
            yield b"event: ping\n\n"
        return StreamingResponse(body(), media_type="text/event-stream")

    app.add_middleware(AccessLogMiddleware)
    client = TestClient(app)
    with caplog.at_level(logging.INFO, logger="freetoken.access"):
        assert client.post("/v1/messages?beta=true").status_code == 200
        assert client.get("/nope").status_code == 404
    lines = [r.getMessage() for r in caplog.records if r.name == "freetoken.access"]
    assert len(lines) == 2
    assert lines[0].startswith("POST /v1/messages?beta=true 200 ") and lines[0].endswith(" ms")
    assert lines[1].startswith("GET /nope 404 ")
