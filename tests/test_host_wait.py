"""runtime/host_wait.py: the decoding thread's quiet wait for a step."""
import time

import pytest
import torch

from runtime.host_wait import wait_quietly


def test_on_a_cpu_device_there_is_nothing_to_wait_for():
    t0 = time.perf_counter()
    wait_quietly("cpu")
    assert time.perf_counter() - t0 < 0.01


def test_on_the_gpu_it_returns_only_once_the_enqueued_work_is_done_and_naps_meanwhile(device, monkeypatch):
    """On the GPU machine: a ~50 ms kernel is still running when the wait starts; the wait returns after it
    (the stream is idle then) and spends the time in naps, not in a spinning sync."""
    if device != "cuda":
        pytest.skip("needs the GPU machine (--device cuda)")
    import runtime.host_wait as hw
    naps = []
    real = time.sleep
    monkeypatch.setattr(hw.time, "sleep", lambda s: (naps.append(s), real(s))[1])
    torch.cuda.synchronize()
    torch.cuda._sleep(100_000_000)                   # 1e8 GPU cycles: ~50 ms at the H200's ~2 GHz
    after = torch.cuda.Event()
    after.record()
    t0 = time.perf_counter()
    wait_quietly("cuda")
    assert after.query() and len(naps) > 10
    assert time.perf_counter() - t0 > 0.01
