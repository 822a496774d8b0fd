"""The IPC protocol: frames, schema, handshake, through a real QLocalServer, and the worker's protocol core."""
from __future__ import annotations

import json
import threading
import time

import pytest

from runtime import protocol
from runtime.protocol import FrameDecoder, ProtocolError, encode_frame


def test_frames_round_trip_whatever_the_split():
    messages = [protocol.request("generate", id="g1", messages=[{"role": "user", "content": "héllo 🦊 東京"}]),
                protocol.event("delta", id="g1", kind="text", text="\u2028 line\nbreak \"quoted\""),
                protocol.event("done", id="g1", finish_reason="stop", usage={"prompt_tokens": 3}, timings={})]
    stream = b"".join(encode_frame(m) for m in messages)
    assert stream[:4] == len(json.dumps(messages[0], ensure_ascii=False, separators=(",", ":")).encode()) \
        .to_bytes(4, "big")
    for step in (1, 2, 3, 7, len(stream)):
        decoder, got = FrameDecoder(), []
        for i in range(0, len(stream), step):
            got += decoder.feed(stream[i:i + step])
        assert got == messages and decoder.pending_bytes == 0


def test_bad_frames_are_refused_naming_the_problem():
    with pytest.raises(ProtocolError, match="announces 999999999 bytes"):
        FrameDecoder(max_frame_bytes=1000).feed((999_999_999).to_bytes(4, "big") + b"{}")
    with pytest.raises(ProtocolError, match="not UTF-8 JSON"):
        FrameDecoder().feed((3).to_bytes(4, "big") + b"{x}")
    with pytest.raises(ProtocolError, match="JSON list, not an object"):
        FrameDecoder().feed((2).to_bytes(4, "big") + b"[]")
    with pytest.raises(ProtocolError, match="cannot be sent as JSON"):
        encode_frame({"type": "stats", "id": None, "stats": {"x": float("nan")}})


def test_schema_names_the_message_and_field():
    with pytest.raises(ProtocolError, match="request 'load' lacks field 'model'"):
        protocol.check_request({"type": "load", "id": "1"})
    with pytest.raises(ProtocolError, match="field 'target' has type int, expected str"):
        protocol.check_request({"type": "cancel", "id": "1", "target": 5})
    with pytest.raises(ProtocolError, match="field 'enable' has type int"):
        protocol.check_request({"type": "server", "id": "1", "enable": 1})
    with pytest.raises(ProtocolError, match="field 'context_length' has type bool"):
        protocol.check_event({"type": "loaded", "id": "1", "model_id": "m", "model_type": "t",
                              "context_length": True})
    with pytest.raises(ProtocolError, match="unknown request type 'explode'"):
        protocol.check_request({"type": "explode", "id": "1"})
    with pytest.raises(ProtocolError, match="exactly one of 'messages' or 'prompt'"):
        protocol.check_request({"type": "generate", "id": "1"})
    with pytest.raises(ProtocolError, match="'kind' is 'image'"):
        protocol.check_event({"type": "delta", "id": "1", "kind": "image"})
    # unknown fields are allowed: a newer peer may add optional ones
    assert protocol.check_request({"type": "unload", "id": "1", "future": [1]})["future"] == [1]


def test_handshake_rejects_another_version_clearly():
    protocol.check_hello(protocol.hello(version="1.0"), peer="worker")
    with pytest.raises(ProtocolError) as err:
        protocol.check_hello({"type": "hello", "protocol": protocol.PROTOCOL_VERSION + 1, "version": "9.9"},
                             peer="worker")
    message = str(err.value)
    assert "protocol_mismatch" in message and str(protocol.PROTOCOL_VERSION + 1) in message
    assert f"this side speaks {protocol.PROTOCOL_VERSION}" in message and "9.9" in message
    with pytest.raises(ProtocolError, match="did not start with 'hello'"):
        protocol.check_hello({"type": "load"}, peer="app")


def test_round_trip_through_a_real_qlocalserver(qtbot):
    """The worker's transport against a QLocalServer: big and many frames, in order, sent from other threads."""
    from PySide6.QtNetwork import QLocalServer

    from runtime.worker_transport import WorkerTransport

    server = QLocalServer()
    assert server.listen(f"freetoken-test-{time.monotonic_ns()}")
    transport = WorkerTransport(server.fullServerName())
    assert transport.connect_to_server(5000)
    qtbot.waitUntil(server.hasPendingConnections, timeout=5000)
    app_side = server.nextPendingConnection()
    app_decoder, app_got = FrameDecoder(), []
    app_side.readyRead.connect(lambda: app_got.extend(app_decoder.feed(bytes(app_side.readAll().data()))))
    worker_got: list[dict] = []
    transport.received.connect(worker_got.append)

    # app -> worker: a 4 MB request arrives whole after many socket reads
    big = protocol.request("generate", id="big", prompt="x" * (4 << 20))
    app_side.write(encode_frame(big) + encode_frame(protocol.request("unload", id="u")))
    qtbot.waitUntil(lambda: len(worker_got) == 2, timeout=10000)
    assert worker_got[0] == big and worker_got[1]["type"] == "unload"

    # worker -> app: 500 events from two non-Qt threads, each thread's events in its own order
    def produce(tag):
        for i in range(250):
            transport.send(protocol.event("delta", id=tag, kind="text", text=str(i)))

    threads = [threading.Thread(target=produce, args=(tag,)) for tag in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    qtbot.waitUntil(lambda: len(app_got) == 500, timeout=10000)
    for tag in ("a", "b"):
        assert [int(m["text"]) for m in app_got if m["id"] == tag] == list(range(250))

    broken: list[str] = []
    transport.broken.connect(broken.append)
    app_side.disconnectFromServer()
    qtbot.waitUntil(lambda: bool(broken), timeout=5000)
    assert "closed the connection" in broken[0]
    server.close()


# ---- the worker's protocol core, in process, over the real engine ----

@pytest.fixture(scope="module")
def core_env(tiny_checkpoints):
    import torch

    from runtime.service import Service
    from runtime.worker import WorkerCore
    from tests.api_fixtures import scripted_loader

    torch.set_num_threads(1)      # 2 shared cores: more threads only fight each other
    sent: list[dict] = []
    exits: list[int] = []
    service = Service(engine_loader=scripted_loader, stats_interval_s=0.1)
    core = WorkerCore(service, lambda m: sent.append(protocol.check_event(json.loads(encode_frame(m)[4:]))),
                      version="test", on_exit=exits.append)
    yield core, sent, exits, tiny_checkpoints("qwen3_moe")
    core.close()


def wait_for(sent, predicate, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = [m for m in list(sent) if predicate(m)]
        if found:
            return found[-1]
        time.sleep(0.01)
    raise AssertionError(f"no such event; got {[m['type'] for m in sent][-20:]}")


def test_worker_core_speaks_the_protocol(core_env):
    core, sent, exits, ckpt = core_env
    core.start()
    assert sent[0]["type"] == "hello" and sent[0]["protocol"] == protocol.PROTOCOL_VERSION
    core.handle(protocol.hello(version="app"))
    core.handle({"type": "load", "id": "x"})
    assert wait_for(sent, lambda m: m.get("id") == "x")["code"] == "bad_request"
    core.handle(protocol.request("generate", id="early", prompt="hi"))
    assert wait_for(sent, lambda m: m.get("id") == "early")["code"] == "no_model"
    core.handle(protocol.request("load", id="missing", model=str(ckpt / "no-such-model")))
    failed = wait_for(sent, lambda m: m.get("id") == "missing")
    assert failed["code"] == "load_failed" and "no-such-model" in failed["message"]
    core.handle(protocol.request("load", id="badopt", model=str(ckpt), options={"gpu_layers": 3}))
    assert "gpu_layers" in wait_for(sent, lambda m: m.get("id") == "badopt")["message"]

    core.handle(protocol.request("load", id="L", model=str(ckpt), options={"device": "cpu", "context_length": 1024}))
    loaded = wait_for(sent, lambda m: m["type"] == "loaded")
    assert loaded["id"] == "L" and loaded["model_type"] == "qwen3_moe" and loaded["context_length"] == 1024
    assert any(m["type"] == "load_progress" and m["id"] == "L" for m in sent)

    core.handle(protocol.request("generate", id="g", messages=[{"role": "user", "content": "[[script:weather]]"}],
                                 sampling={"max_tokens": 200}))
    done = wait_for(sent, lambda m: m["type"] == "done" and m["id"] == "g")
    deltas = [m for m in sent if m["type"] == "delta" and m["id"] == "g"]
    reasoning = "".join(m["text"] for m in deltas if m["kind"] == "reasoning")
    calls = [m for m in deltas if m["kind"] == "tool_call"]
    assert reasoning == "The user asks about the weather, so I call the tool."
    assert calls[0]["name"] == "get_weather" and calls[0]["call_id"]
    assert json.loads("".join(m["arguments"] for m in calls)) == {"city": "Paris", "unit": "celsius"}
    assert done["finish_reason"] == "tool_calls" and done["usage"]["completion_tokens"] > 10
    assert set(done["timings"]) == {"ttft_s", "prefill_tps", "decode_tps", "total_s"}

    core.handle(protocol.request("generate", id="long", prompt="The quick", sampling={"max_tokens": 900,
                                                                                      "temperature": 0}))
    wait_for(sent, lambda m: m["type"] == "delta" and m["id"] == "long")
    core.handle(protocol.request("cancel", id="c", target="long"))
    assert wait_for(sent, lambda m: m["type"] == "done" and m["id"] == "long")["finish_reason"] == "cancelled"
    core.handle(protocol.request("cancel", id="c2", target="nothing"))
    assert wait_for(sent, lambda m: m.get("id") == "c2")["code"] == "unknown_request"

    core.handle(protocol.request("subscribe_stats", id="s", interval_s=0.1))
    stats = wait_for(sent, lambda m: m["type"] == "stats" and "engine" in m["stats"])
    assert stats["id"] == "s" and stats["stats"]["engine"]["finished"] >= 1
    core.handle(protocol.request("generate", id="huge", prompt="word " * 2000))
    err = wait_for(sent, lambda m: m.get("id") == "huge")
    assert err["code"] == "context_length" and "1024" in err["message"]

    core.handle(protocol.request("generate", id="badmsg", messages=[{"content": "no role"}]))
    assert "role" in wait_for(sent, lambda m: m.get("id") == "badmsg")["message"]
    core.handle(protocol.request("generate", id="badsampling", prompt="hi", sampling={"top_p": 7}))
    assert wait_for(sent, lambda m: m.get("id") == "badsampling")["code"] == "bad_request"

    core.handle(protocol.request("server", id="pub", enable=True, host="0.0.0.0", port=0))
    refused = wait_for(sent, lambda m: m.get("id") == "pub")
    assert refused["running"] is False and "API key" in refused["message"]
    core.handle(protocol.request("server", id="on", enable=True, host="127.0.0.1", port=0))
    on = wait_for(sent, lambda m: m.get("id") == "on")
    assert on["running"] and on["url"].startswith("http://127.0.0.1:") and not on["url"].endswith(":1919")
    core.handle(protocol.request("server", id="off", enable=False))
    assert wait_for(sent, lambda m: m.get("id") == "off")["running"] is False and core.server is None

    core.handle(protocol.request("unload", id="U"))
    wait_for(sent, lambda m: m["type"] == "unloaded" and m["id"] == "U")
    assert exits == []


def test_worker_core_refuses_another_protocol_version(tiny_checkpoints):
    from runtime.service import Service
    from runtime.worker import EXIT_PROTOCOL, WorkerCore

    sent, exits = [], []
    core = WorkerCore(Service(), sent.append, on_exit=exits.append)
    try:
        core.handle({"type": "hello", "protocol": protocol.PROTOCOL_VERSION + 1})
        assert sent[-1]["type"] == "error" and sent[-1]["code"] == "protocol_mismatch"
        assert exits == [EXIT_PROTOCOL]
    finally:
        core.close()
