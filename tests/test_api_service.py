"""The engine service under the API: cancel within one step, the queue bound, context check, unload."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from runtime.service import (ContextTooLong, Failed, Finished, GenerateJob, LoadOptions, NoModel, Overloaded, Piece,
                             Service)
from tests.api_fixtures import scripted_loader


@pytest.fixture(scope="module")
def service(tiny_checkpoints):
    torch.set_num_threads(1)
    svc = Service(engine_loader=scripted_loader)
    info = svc.load_sync(tiny_checkpoints("qwen3_moe"), LoadOptions(device="cpu", context_length=256))
    assert info.context_length == 256 and svc.state == "ready"
    yield svc
    svc.close()


def job_for(service, text, sink, *, max_tokens=200):
    from runtime.engine import SamplingParams

    ids = service.model.tokenizer.encode(text)
    return GenerateJob(prompt_ids=ids, prompt_text=text, sampling=SamplingParams(temperature=0, max_tokens=max_tokens),
                       sink=sink, parse=False)


def test_cancel_takes_effect_before_the_next_step(service):
    """Cancelled while its 5th token is being delivered: no further token is generated for it."""
    done = threading.Event()
    events: list = []
    holder: dict = {}

    def sink(event):
        events.append(event)
        if isinstance(event, Piece) and "at_cancel" not in holder and holder["job"].completion_tokens >= 5:
            holder["at_cancel"] = holder["job"].completion_tokens
            service.cancel(holder["job"])
        if isinstance(event, (Finished, Failed)):
            done.set()

    holder["job"] = job_for(service, "The quick brown fox", sink)
    service.submit(holder["job"])
    assert done.wait(30)
    finished = events[-1]
    assert isinstance(finished, Finished) and finished.finish_reason == "cancelled"
    assert finished.completion_tokens == holder["at_cancel"]
    assert service.pending() == 0


def test_queue_bound_refuses_at_once_and_context_is_checked_at_submit(service):
    release, started = threading.Event(), threading.Event()

    def slow_sink(event):
        if isinstance(event, Piece):
            started.set()
        if isinstance(event, (Finished, Failed)):
            release.set()

    old = service.max_queue
    service.max_queue = 1
    try:
        busy = service.submit(job_for(service, "The quick brown fox", slow_sink))
        with pytest.raises(Overloaded, match="limit 1"):
            service.submit(job_for(service, "hi", lambda e: None))
        service.cancel(busy)
        assert release.wait(30)
    finally:
        service.max_queue = old
    with pytest.raises(ContextTooLong) as err:
        service.submit(job_for(service, "word " * 300, lambda e: None))
    assert err.value.limit == 256 and err.value.prompt_tokens > 256
    assert f"{err.value.prompt_tokens} tokens" in str(err.value) and "256 tokens" in str(err.value)


def test_unload_fails_running_jobs_and_refuses_new_ones(tiny_checkpoints):
    svc = Service(engine_loader=scripted_loader)
    try:
        svc.load_sync(tiny_checkpoints("qwen3_moe"), LoadOptions(device="cpu", context_length=2048))
        outcome: list = []
        got = threading.Event()

        def sink(event):
            if isinstance(event, Piece) and not got.is_set():
                got.set()
            if isinstance(event, (Finished, Failed)):
                outcome.append(event)

        svc.submit(job_for(svc, "The quick brown fox", sink, max_tokens=1900))
        assert got.wait(30)
        unloaded = threading.Event()
        svc.unload(on_done=unloaded.set)
        assert unloaded.wait(30)
        assert isinstance(outcome[0], Failed) and outcome[0].code == "no_model"
        assert svc.model is None and svc.state == "empty" and svc.pending() == 0
        with pytest.raises(NoModel):
            svc.submit(GenerateJob(prompt_ids=[1, 2], prompt_text="x", sampling=None, sink=lambda e: None))
    finally:
        svc.close()


def test_a_failing_receiver_cancels_its_request_not_the_engine_thread(service):
    def broken_sink(event):
        raise RuntimeError("the client's event loop is gone")

    service.submit(job_for(service, "The quick brown fox", broken_sink, max_tokens=1900))
    deadline = time.monotonic() + 10
    while service.pending() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert service.pending() == 0
    done = threading.Event()
    result: list = []
    service.submit(job_for(service, "hi", lambda e: (result.append(e), done.set()) if isinstance(e, Finished)
                           else None, max_tokens=3))
    assert done.wait(30) and result[0].completion_tokens == 3
