"""CUDA graph recording kept apart from page-locking on other threads.

Why: a decode graph is recorded by stream capture (decode_graph.py), and the prefix cache's arena page-locks host
memory on its own thread while the engine steps (host_arena.py). The driver refuses a cudaHostRegister made while
a capture is open (cudaErrorStreamCaptureUnsupported). Under torch's default "global" capture mode, another thread's
unsafe call also invalidates the capture itself. vLLM met exactly this (issue #46933: background pinning beside
graph capture hung its start-up) and moved every capture to "thread_local" (PR #48053).

So: recordings capture in "thread_local" mode, where only the recording thread's own calls are checked. And a
recording and a registration never overlap: each holds `RECORDING` for its duration - every registration goes
through `HostBuffer.pin` (experts/host_store.py), which takes it. A registration holds it ~10-20 ms a 256 MiB slab
(s34b); a recording holds it for its capture, not for the eager run before it.
"""
from __future__ import annotations

import threading

CAPTURE_MODE = "thread_local"      # torch.cuda.CUDAGraph.capture_begin's capture_error_mode
RECORDING = threading.Lock()       # held by a graph capture, and by a page-locking call on another thread
