"""Concurrency and faults of the live API server: many streams, disconnects, overload, loading, bad input.

Every error must come in the shape of the API that was called and none may be a 500.
"""
from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time

import anthropic
import httpx
import openai
import pytest
import torch

from runtime.server.app import ServerThread, create_app
from runtime.server.context import ServerConfig
from runtime.server.security import SecurityConfig, SecurityConfigError
from runtime.service import LoadOptions, Service
from tests.api_fixtures import live_server, scripted_loader

CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoints):
    return tiny_checkpoints("qwen3_moe")


@pytest.fixture(scope="module")
def server(ckpt):
    torch.set_num_threads(1)
    with live_server(ckpt, max_body_bytes=256 * 1024) as (service, srv):
        yield service, srv


def wait_until(predicate, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def engine_stats(service: Service) -> dict:
    """The engine's own counters, read through the service's stats feed (the engine lives on its thread)."""
    got: list[dict] = []
    service.subscribe_stats("test", got.append)
    try:
        assert wait_until(lambda: any("engine" in s for s in got), 5)
    finally:
        service.unsubscribe_stats("test")
    return [s for s in got if "engine" in s][-1]["engine"]


def test_sixteen_concurrent_streams_complete_with_correct_usage(server):
    """16 streams at once (batched by the engine) give exactly what each gives alone."""
    service, srv = server

    def request(i):
        return dict(model="m", messages=[{"role": "user", "content": f"Request number {i}: " + "go " * (i % 5)}],
                    max_tokens=12 + i % 4, temperature=0)

    async def one(client, i):
        stream = await client.chat.completions.create(**request(i), stream=True,
                                                      stream_options={"include_usage": True})
        text, usage, finish = "", None, None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage:
                usage = chunk.usage
        return text, finish, usage

    async def main():
        async with openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0) as client:
            return await asyncio.gather(*(one(client, i) for i in range(16)))

    results = asyncio.run(main())
    assert len(results) == 16
    alone = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    for i, (text, finish, usage) in enumerate(results):
        reference = alone.chat.completions.create(**request(i))
        assert text == reference.choices[0].message.content
        assert finish == reference.choices[0].finish_reason
        assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
            reference.usage.prompt_tokens, reference.usage.completion_tokens, reference.usage.total_tokens)
        assert usage.completion_tokens == 12 + i % 4 or finish == "stop"
    assert wait_until(lambda: service.pending() == 0, 5)


STREAMING_CLIENT = """
import sys, httpx
body = {"model": "m", "messages": [{"role": "user", "content": "write forever"}], "max_tokens": 1900,
        "stream": True, "temperature": 0}
with httpx.stream("POST", sys.argv[1], json=body, timeout=60) as response:
    for line in response.iter_lines():
        print(line, flush=True)
"""


def test_client_killed_mid_stream_frees_its_slot(server):
    """A client process SIGKILLed mid-stream: its sequence is cancelled and its slot freed at once."""
    service, srv = server
    before = engine_stats(service)["cancelled"]
    client = subprocess.Popen([sys.executable, "-c", STREAMING_CLIENT, srv.url + CHAT], stdout=subprocess.PIPE,
                              text=True)
    try:
        data_lines = 0
        while data_lines < 3:
            line = client.stdout.readline()
            assert line, "the client's stream ended early"
            data_lines += line.startswith("data:")
        assert service.pending() == 1
    finally:
        client.kill()
        client.wait()
    t0 = time.monotonic()
    assert wait_until(lambda: service.pending() == 0, 5), "the killed client's request still holds its slot"
    freed_after = time.monotonic() - t0
    stats = engine_stats(service)
    assert stats["cancelled"] == before + 1 and stats["active_sequences"] == 0
    assert freed_after < 3.0      # 1900 tokens take ~10 s or more here: the cancel came within a few steps


def test_non_streaming_client_that_gives_up_is_cancelled(server):
    service, srv = server
    before = engine_stats(service)["cancelled"]
    body = {"model": "m", "messages": [{"role": "user", "content": "write forever"}], "max_tokens": 1900,
            "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(srv.url + CHAT, json=body, timeout=0.5)
    assert wait_until(lambda: service.pending() == 0, 5)
    assert engine_stats(service)["cancelled"] == before + 1


def test_queue_bound_gives_429_and_529_never_a_hang(server):
    service, srv = server
    old = service.max_queue
    service.max_queue = 1
    body = {"model": "m", "messages": [{"role": "user", "content": "long"}], "max_tokens": 1900, "stream": True,
            "temperature": 0}
    try:
        with httpx.Client(timeout=10) as client, client.stream("POST", srv.url + CHAT, json=body) as busy:
            assert busy.status_code == 200
            t0 = time.monotonic()
            oa = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
            with pytest.raises(openai.RateLimitError) as err:
                oa.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
            assert err.value.status_code == 429 and err.value.body["type"] == "rate_limit_error"
            assert err.value.response.headers["retry-after"] == "1"
            an = anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0)
            with pytest.raises(anthropic.APIStatusError) as err:
                an.messages.create(model="c", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
            assert err.value.status_code == 529 and err.value.body["error"]["type"] == "overloaded_error"
            assert time.monotonic() - t0 < 5      # refused at once, not queued behind the busy stream
    finally:
        service.max_queue = old
    assert wait_until(lambda: service.pending() == 0, 5)


def test_prompt_past_the_context_is_a_400_with_length_and_limit(server):
    _, srv = server
    long_text = "The quick brown fox jumps over the lazy dog. " * 400
    r = httpx.post(srv.url + CHAT, json={"model": "m", "messages": [{"role": "user", "content": long_text}]})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["type"] == "invalid_request_error"
    assert "2048" in err["message"] and "tokens" in err["message"]
    prompt_tokens = int(err["message"].split("the prompt is ")[1].split()[0])
    assert prompt_tokens > 2048
    r = httpx.post(srv.url + MESSAGES, json={"model": "c", "max_tokens": 5,
                                              "messages": [{"role": "user", "content": long_text}]})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert str(prompt_tokens) in r.json()["error"]["message"]


@pytest.mark.parametrize("path", [CHAT, MESSAGES, "/v1/responses", "/v1/completions", "/v1/messages/count_tokens"])
def test_bad_bodies_get_400_in_the_right_shape(server, path):
    _, srv = server
    anthropic_shape = path.startswith(MESSAGES)
    cases = [
        (b"{not json", "application/json"),
        (b"[1, 2, 3]", "application/json"),
        (b'{"messages": 7, "prompt": {}, "input": 5, "max_tokens": "x"}', "application/json"),
        (b"\xff\xfe\x00garbage", "application/json"),
    ]
    for content, ctype in cases:
        r = httpx.post(srv.url + path, content=content, headers={"content-type": ctype})
        assert r.status_code == 400, (path, content, r.text)
        body = r.json()
        if anthropic_shape:
            assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        else:
            assert body["error"]["type"] == "invalid_request_error" and body["error"]["message"]


def test_unknown_fields_are_accepted(server):
    _, srv = server
    r = httpx.post(srv.url + CHAT, json={"model": "m", "messages": [{"role": "user", "content": "hi",
                                                                    "future_field": 1}],
                                         "max_tokens": 2, "temperature": 0, "brand_new_option": {"x": 1},
                                         "logit_bias": {}})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_oversized_body_is_413(server):
    _, srv = server
    big = {"model": "m", "messages": [{"role": "user", "content": "x" * (300 * 1024)}]}
    r = httpx.post(srv.url + CHAT, json=big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = httpx.post(srv.url + MESSAGES, json={**big, "max_tokens": 1})
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"

    def chunked():       # no Content-Length: counted as it arrives
        for _ in range(40):
            yield b"x" * 8192
    r = httpx.post(srv.url + CHAT, content=chunked(), headers={"content-type": "application/json"})
    assert r.status_code == 413


def test_bad_host_and_foreign_origin_are_refused(server):
    _, srv = server
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    r = httpx.post(srv.url + CHAT, json=body, headers={"Host": "evil.example:1919"})
    assert r.status_code == 403 and "DNS rebinding" in r.json()["error"]["message"]
    r = httpx.post(srv.url + MESSAGES, json={**body}, headers={"Host": "attacker.test"})
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
    r = httpx.post(srv.url + CHAT, json=body, headers={"Origin": "https://evil.example"})
    assert r.status_code == 403 and "cross-origin" in r.json()["error"]["message"]
    assert "access-control-allow-origin" not in r.headers
    ok = httpx.post(srv.url + CHAT, json=body, headers={"Host": f"localhost:{srv.port}"})
    assert ok.status_code == 200


def test_unknown_path_and_method_in_the_right_shape(server):
    _, srv = server
    r = httpx.get(srv.url + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.get(srv.url + MESSAGES)
    assert r.status_code == 405 and r.json()["type"] == "error"


def test_api_key_is_checked_and_public_binds_require_one(ckpt):
    with pytest.raises(SecurityConfigError, match="API key"):
        SecurityConfig(host="0.0.0.0").check()
    with pytest.raises(SecurityConfigError):
        create_app(Service(engine_loader=scripted_loader), ServerConfig(security=SecurityConfig(host="192.168.1.5")))
    with live_server(ckpt, api_key="secret") as (_, srv):
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        assert httpx.post(srv.url + CHAT, json=body).status_code == 401
        r = httpx.post(srv.url + CHAT, json=body, headers={"Authorization": "Bearer nope"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert httpx.post(srv.url + CHAT, json=body, headers={"Authorization": "Bearer secret"}).status_code == 200
        assert httpx.post(srv.url + CHAT, json=body, headers={"x-api-key": "secret"}).status_code == 200
        assert httpx.get(srv.url + "/health").status_code == 200      # liveness stays open
        assert httpx.get(srv.url + "/openapi.json").status_code == 401


def test_requests_while_loading_wait_or_get_503(ckpt):
    release = threading.Event()

    def slow_loader(path, options, progress):
        release.wait(10)
        return scripted_loader(path, options, progress)

    service = Service(engine_loader=slow_loader)
    app = create_app(service, ServerConfig(load_wait_s=0.3))
    server = ServerThread(app, host="127.0.0.1", port=0).start()
    try:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        r = httpx.post(server.url + CHAT, json=body)
        assert r.status_code == 503 and "no model is loaded" in r.json()["error"]["message"]
        service.load(ckpt, LoadOptions(device="cpu", context_length=256))
        t0 = time.monotonic()
        r = httpx.post(server.url + MESSAGES, json={**body, "max_tokens": 1})
        assert r.status_code == 503 and r.json()["error"]["type"] == "api_error"
        assert "loading" in r.json()["error"]["message"] and time.monotonic() - t0 >= 0.3
        assert httpx.get(server.url + "/health").json()["state"] == "loading"
        # a request that arrives during the load and may wait long enough is served when it ends
        result: dict = {}
        waiter = threading.Thread(target=lambda: result.update(r=httpx.post(server.url + CHAT, json=body, timeout=20)))
        app.state.config = ServerConfig(load_wait_s=15)
        waiter.start()
        time.sleep(0.2)
        release.set()
        waiter.join(20)
        assert result["r"].status_code == 200 and result["r"].json()["usage"]["completion_tokens"] == 1
    finally:
        release.set()
        server.stop()
        service.close()


def test_schemathesis_finds_no_server_errors(ckpt, tmp_path):
    """Fuzz every operation of the served OpenAPI document (few examples each, to stay quick)."""
    with live_server(ckpt, context_length=64) as (_, srv):
        cmd = [sys.executable, "-m", "schemathesis.cli", "run", srv.url + "/openapi.json",
               "--checks", "not_a_server_error", "--max-examples", "4", "--phases", "examples,fuzzing",
               "--workers", "1", "--no-shrink", "--generation-database", "none", "--seed", "7",
               "--request-timeout", "30", "--no-color", "--suppress-health-check", "all"]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "10 selected" in run.stdout and " passed" in run.stdout and "failed" not in run.stdout


def test_cors_only_when_enabled_for_that_origin():
    import asyncio as aio

    async def probe(origins):
        app = create_app(Service(engine_loader=scripted_loader),
                         ServerConfig(security=SecurityConfig(cors_origins=origins)))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:1919") as client:
            preflight = await client.options(CHAT, headers={
                "Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "content-type,authorization"})
            get = await client.get("/health", headers={"Origin": "http://localhost:3000"})
        return preflight, get

    preflight, get = aio.run(probe(("http://localhost:3000",)))
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "http://localhost:3000"
    assert get.status_code == 200 and get.headers["access-control-allow-origin"] == "http://localhost:3000"
    preflight, get = aio.run(probe(()))
    assert preflight.status_code == 403 and "access-control-allow-origin" not in preflight.headers
    assert get.status_code == 403


def test_engine_failure_mid_stream_is_an_error_in_each_api_and_the_server_lives_on(server):
    service, srv = server
    ask = [{"role": "user", "content": "[[script:explode]]"}]
    oa = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    seen = ""
    with pytest.raises(openai.APIError) as err:
        for chunk in oa.chat.completions.create(model="m", messages=ask, max_tokens=100, stream=True):
            seen += chunk.choices[0].delta.content or "" if chunk.choices else ""
    assert "simulated engine failure" in str(err.value.message) and seen.startswith("Starting to answer")
    with pytest.raises(openai.InternalServerError):          # not streamed: a 500 in OpenAI's shape
        oa.chat.completions.create(model="m", messages=ask, max_tokens=100)
    an = anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0)
    with pytest.raises(anthropic.APIStatusError) as aerr:
        with an.messages.stream(model="c", max_tokens=100, messages=ask) as stream:
            for _ in stream:
                pass
    assert "simulated engine failure" in str(aerr.value)
    events = list(oa.responses.create(model="m", input="[[script:explode]]", stream=True))
    assert events[-1].type == "response.failed"
    assert "simulated engine failure" in events[-1].response.error.message
    ok = oa.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                    temperature=0)
    assert ok.usage.completion_tokens == 3 and service.pending() == 0
