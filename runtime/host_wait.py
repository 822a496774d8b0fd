"""Waiting for the GPU without spinning a core: the decoding thread's wait for each step's token.

Why: CUDA's default synchronisation spins a CPU core for as long as the GPU works. In a hybrid decode step the CPU
share's kernel threads need every core but two (cpu_share.default_worker_threads), and the decoding thread
spinning through the whole step is one of those two. `wait_quietly` records an event and naps between polls
instead, handing the core to the kernel threads for the ~15 ms of a step, at the price of up to one nap's
latency (`POLL_S`) a step.
"""
from __future__ import annotations

import time

import torch

POLL_S = 5e-5            # a nap between event polls (Linux sleeps ~50-100 us for it; a step takes ~15 ms)


def wait_quietly(device: torch.device | str | None = None) -> None:
    """Block until the work enqueued so far on `device`'s current stream is done, napping between polls. On a
    CPU device (nothing runs asynchronously) it returns at once."""
    device = torch.device(device) if device is not None else None
    if device is not None and device.type != "cuda":
        return
    if not torch.cuda.is_available():
        return
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(device))
    while not done.query():
        time.sleep(POLL_S)
