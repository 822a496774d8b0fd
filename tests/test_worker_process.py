"""The real worker process, started by the UI-side WorkerClient (QProcess + QLocalServer), with pytest-qt.

One module-wide worker: load, generate, HTTP inside the worker, stats; then it is killed mid-generation
(the job fails with an error, the client reports the crash) and a new worker serves again.
"""
from __future__ import annotations

import httpx
import pytest

from app.worker_client import GenerationJob, WorkerClient
from runtime import protocol

START_MS = 90_000      # a cold worker imports torch; CI disks can be slow
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}   # 2 shared cores: threads only fight


@pytest.fixture(scope="module")
def package(tiny_checkpoints, tmp_path_factory):
    from runtime.ftw.converter import convert

    return convert(tiny_checkpoints("qwen3_moe"), tmp_path_factory.mktemp("ftw") / "tiny-qwen3-moe", codec="bf16")


def start_worker(qtbot) -> WorkerClient:
    client = WorkerClient(env=ONE_THREAD)
    with qtbot.waitSignal(client.ready, timeout=START_MS):
        client.start()
    assert client.worker_pid == client.process.processId()     # the hello comes from the process we started
    return client


def events_of(client, request_id: str, kind: str) -> list[dict]:
    return [e for e in client.seen if e.get("id") == request_id and e["type"] == kind]


def recording(client: WorkerClient) -> WorkerClient:
    client.seen = []
    client.event.connect(client.seen.append)
    return client


def load(qtbot, client, package) -> dict:
    rid = client.load(str(package), device="cpu", context_length=2048)
    qtbot.waitUntil(lambda: bool(events_of(client, rid, "loaded") or events_of(client, rid, "error")), timeout=60_000)
    assert not events_of(client, rid, "error"), events_of(client, rid, "error")
    return events_of(client, rid, "loaded")[0]


def finish(qtbot, job: GenerationJob, timeout=60_000) -> GenerationJob:
    if not job.is_finished:
        with qtbot.waitSignal(job.finished, timeout=timeout):
            pass
    return job


def test_worker_serves_ipc_and_http_then_survives_a_kill(qtbot, package):
    client = recording(start_worker(qtbot))
    crashes: list[str] = []
    client.crashed.connect(crashes.append)
    try:
        loaded = load(qtbot, client, package)
        assert loaded["model_id"] == "tiny-qwen3-moe" and loaded["context_length"] == 2048
        assert loaded["plan"]["device"] == "cpu"
        progress = [e for e in client.seen if e["type"] == "load_progress"]
        assert progress and all(e["done"] <= e["total"] for e in progress)

        job = finish(qtbot, client.generate(messages=[{"role": "user", "content": "Hello there"}],
                                            sampling={"max_tokens": 16, "temperature": 0}))
        assert job.outcome == "done" and job.finish_reason == "length"
        assert job.usage["completion_tokens"] == 16 and job.usage["prompt_tokens"] > 5
        assert job.text or job.reasoning

        # the same model answers over HTTP from inside the worker, identically
        sid = client.request("server", enable=True, host="127.0.0.1", port=0)
        qtbot.waitUntil(lambda: bool(events_of(client, sid, "server_state")), timeout=10_000)
        state = events_of(client, sid, "server_state")[0]
        assert state["running"], state
        assert not state["url"].endswith(":1919")          # port 0 asked for any free port
        r = httpx.post(state["url"] + "/v1/chat/completions", timeout=30, json={
            "model": "x", "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 16,
            "temperature": 0})
        answer = r.json()["choices"][0]["message"]
        assert r.status_code == 200 and (answer["content"] or "") == job.text
        assert (answer.get("reasoning_content") or "") == job.reasoning

        stats_id = client.request("subscribe_stats", interval_s=0.2)
        qtbot.waitUntil(lambda: any("engine" in e["stats"] for e in events_of(client, stats_id, "stats")),
                        timeout=10_000)
        engine = [e for e in events_of(client, stats_id, "stats") if "engine" in e["stats"]][-1]["stats"]["engine"]
        assert engine["finished"] >= 2 and engine["model_type"] == "qwen3_moe"

        # killed mid-generation: the job fails with an error, the client says so, nothing hangs
        long_job = client.generate(prompt="The quick brown fox", sampling={"max_tokens": 1900, "temperature": 0})
        qtbot.waitUntil(lambda: len(long_job.text) > 0, timeout=30_000)
        with qtbot.waitSignals([client.crashed, client.stopped], timeout=10_000):
            client.kill()
        assert long_job.outcome == "error" and long_job.error_code == "worker_crashed"
        assert crashes and "crashed" in crashes[0]
        assert not client.is_ready
        late = client.generate(prompt="hi")          # a request with no worker fails at once, never hangs
        with qtbot.waitSignal(late.finished, timeout=1000):
            pass
        assert late.outcome == "error" and late.error_code == "worker_crashed"

        # a new worker serves again
        with qtbot.waitSignal(client.ready, timeout=START_MS):
            client.start()
        load(qtbot, client, package)
        again = finish(qtbot, client.generate(prompt="The quick brown fox",
                                              sampling={"max_tokens": 8, "temperature": 0}))
        assert again.outcome == "done" and again.usage["completion_tokens"] == 8
        shorter, longer = sorted([long_job.text, again.text], key=len)
        assert longer.startswith(shorter)        # the same greedy text the killed worker was writing

        # cancel through IPC
        slow = client.generate(prompt="The quick brown fox", sampling={"max_tokens": 1900, "temperature": 0})
        qtbot.waitUntil(lambda: len(slow.text) > 0, timeout=30_000)
        client.cancel(slow)
        finish(qtbot, slow, timeout=10_000)
        assert slow.outcome == "cancelled" and slow.usage["completion_tokens"] < 1900

        # a clean shutdown is not a crash
        crashes.clear()
        with qtbot.waitSignal(client.stopped, timeout=15_000) as stopped:
            client.shutdown()
        assert stopped.args == [0] and crashes == []
    finally:
        if client.process is not None:
            client.process.kill()
            client.process.waitForFinished(5000)


def test_worker_rejects_an_app_of_another_protocol_version(qtbot):
    """A real worker process, an app that says hello with the wrong version: a clear error, exit code 3."""
    from PySide6.QtCore import QProcess, QProcessEnvironment
    from PySide6.QtNetwork import QLocalServer

    from app.worker_client import worker_command
    from runtime.protocol import FrameDecoder, encode_frame
    from runtime.worker import EXIT_PROTOCOL

    server = QLocalServer()
    assert server.listen(f"freetoken-mismatch-{id(server)}")
    process = QProcess()
    env = QProcessEnvironment.systemEnvironment()
    for key, value in ONE_THREAD.items():
        env.insert(key, value)
    process.setProcessEnvironment(env)
    program, args = worker_command(server.fullServerName())
    process.start(program, args)
    try:
        qtbot.waitUntil(server.hasPendingConnections, timeout=START_MS)
        sock = server.nextPendingConnection()
        decoder, got = FrameDecoder(), []
        read = lambda: got.extend(decoder.feed(bytes(sock.readAll().data())))   # noqa: E731
        sock.readyRead.connect(read)
        read()                     # the worker's hello may have arrived before the slot was connected
        qtbot.waitUntil(lambda: bool(got), timeout=10_000)
        assert got[0]["type"] == "hello" and got[0]["protocol"] == protocol.PROTOCOL_VERSION
        sock.write(encode_frame({"type": "hello", "protocol": protocol.PROTOCOL_VERSION + 41, "version": "99.0"}))
        qtbot.waitUntil(lambda: len(got) >= 2, timeout=10_000)
        assert got[1]["type"] == "error" and got[1]["code"] == "protocol_mismatch"
        assert str(protocol.PROTOCOL_VERSION + 41) in got[1]["message"]
        qtbot.waitUntil(lambda: process.state() == QProcess.ProcessState.NotRunning, timeout=10_000)
        assert process.exitCode() == EXIT_PROTOCOL
    finally:
        process.kill()
        process.waitForFinished(5000)
        server.close()
