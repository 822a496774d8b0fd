"""The CPU worker's cycle counter on the GPU's clock: where a CPU-share request's round trip goes (issue 10).

The mailbox's timeline has each request's GPU side on the GPU's %globaltimer (`Mailbox.times`: published,
collect started, the answer seen, its rows added) and its CPU side on the CPU's cycle counter (`Mailbox.cpu_times`:
the compiled worker saw it, was done with it). Set on one clock they split the round trip into the request's
crossing, the worker's time and the answer's crossing: session 18's rows had ~25 µs a request that neither the
worker's own time nor an idle round trip (2.3 µs) accounts for, and a flush of the request's ticket did not move it.

A `ClockMap` maps cycles to the other clock, fitted from two samples taken apart (before and after a bench row).
A sample is the best of many pings: the GPU reads its clock (g0), stores a word a compiled CPU echo waits on; the
echo reads its cycle counter (c) and answers; the GPU reads its clock again (g1). c happened between g0 and g1, so
c ~ (g0 + g1) / 2 within half the shortest ping (~1.2 µs on the H200 host). On a CPU device (tests) the
references stamp time.monotonic_ns, and `host_sample` pairs the counter with that clock instead.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

PINGS = 200


@dataclass(frozen=True)
class ClockSample:
    cycles: int             # the CPU's cycle counter...
    ns: int                 # ...and the other clock at the same moment
    error_ns: float         # within this much (half the ping, or the host's bracket)


@dataclass(frozen=True)
class ClockMap:
    """cycles -> ns of the other clock: the line through two samples."""
    a: ClockSample
    b: ClockSample

    @classmethod
    def fit(cls, a: ClockSample, b: ClockSample) -> ClockMap | None:
        """None where the two samples cannot make a line (the same moment, or the counter unavailable: 0)."""
        if b.cycles <= a.cycles or b.ns <= a.ns:
            return None
        return cls(a, b)

    @property
    def ns_per_cycle(self) -> float:
        return (self.b.ns - self.a.ns) / (self.b.cycles - self.a.cycles)

    def ns(self, cycles: np.ndarray) -> np.ndarray:
        """int64 ns of the other clock (offsets from sample a in float64: exact to well under a ns per second)."""
        offset = (np.asarray(cycles, dtype=np.int64) - self.a.cycles).astype(np.float64) * self.ns_per_cycle
        return self.a.ns + np.rint(offset).astype(np.int64)


def host_sample(tries: int = 50) -> ClockSample:
    """The cycle counter against time.monotonic_ns (the clock the references stamp), the tightest of `tries`
    brackets of one clock read between two counter reads."""
    from runtime.experts.cpu_share import read_cycles

    read_cycles()                                   # (compiled or loaded before timing)
    best = None
    for _ in range(tries):
        c0 = int(read_cycles())
        t = time.monotonic_ns()
        c1 = int(read_cycles())
        if best is None or c1 - c0 < best[1] - best[0]:
            best = (c0, c1, t)
    c0, c1, t = best
    return ClockSample((c0 + c1) // 2, t, 0.0)


try:
    from numba import njit

    from runtime.experts.cpu_kernels_int8 import _cycles
    from runtime.experts.cpu_share import publish, spin_until_changed

    @njit(nogil=True, cache=True)
    def echo_pings(req, resp, cycles, n, spins, last):
        """Answer n pings (req's new value back in resp), each one's cycle counter when seen into cycles; returns
        the pings answered (fewer: one did not come within `spins` polls)."""
        for k in range(n):
            v = spin_until_changed(req, last, spins)
            if v == last:
                return k
            cycles[k] = _cycles()
            publish(resp, v)
            last = v
        return n
except ImportError:               # numba absent: no compiled echo (the GPU's clock sync needs one)
    echo_pings = None


class GpuClockSync:
    """Samples of the cycle counter against the GPU's %globaltimer (page-locked words of its own: the worker's
    mailbox is not touched, and it may be serving beside). `pings(n)` is also the mailbox bench's round trip."""

    def __init__(self, device: torch.device):
        self.device = device
        self.req = torch.zeros(1, dtype=torch.int64).pin_memory()
        self.resp = torch.zeros(1, dtype=torch.int64).pin_memory()
        self._count = 0
        if echo_pings is None:
            raise RuntimeError("the GPU's clock sync needs numba (a compiled CPU echo)")
        echo_pings(self.req.numpy(), self.resp.numpy(), np.zeros(1, dtype=np.int64), 0, 1, 0)    # compiled now
        self.pings(1)                               # and the kernel: a first compile outlasts any echo's spin

    def _round(self, n: int, send, *, spins: int = 2_000_000_000) -> tuple[np.ndarray, np.ndarray]:
        """n values sent by `send(g, first)` while a compiled echo answers each one from a thread of its own: (the
        GPU's clocks g [n, 2], the echo's cycle counter at each [n]); raises when the echo missed one."""
        g = torch.zeros(n, 2, dtype=torch.int64, device=self.device)
        cycles = np.zeros(n, dtype=np.int64)
        first = self._count + 1
        self._count += n
        answered = [0]
        start = int(self.req[0])          # (the last round's final value is not one of this round's)

        def echo() -> None:
            answered[0] = echo_pings(self.req.numpy(), self.resp.numpy(), cycles, n, spins, start)

        t = threading.Thread(target=echo, name="clock-echo")
        t.start()
        send(g, first)
        torch.cuda.current_stream(self.device).synchronize()
        t.join()
        if answered[0] < n:
            raise RuntimeError("the CPU's echo stopped answering the GPU's pings")
        return g.cpu().numpy(), cycles

    def pings(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """n pings: (the GPU's clock before and after each [n, 2], the echo's cycle counter at each [n]); raises
        when the echo stopped answering."""
        from runtime.kernels.handoff_triton import clock_pings

        g, cycles = self._round(n, lambda g, first: clock_pings(self.req, self.resp, g, first))
        if bool((g[:, 1] < 0).any()):
            raise RuntimeError("the CPU's echo stopped answering the GPU's pings")
        return g, cycles

    def one_way(self, trials: int, then=None, *, gap_s: float = 2e-4) -> np.ndarray:
        """ns from the GPU storing a word (its clock just before the store) to a CPU echo seeing it, `trials`
        times, each store alone on an idle link, then `then()` launched right behind it on the same stream (as
        decode's handoff is followed by its misses' gather) when given: the request's crossing without the
        worker. The clock set by samples around the trials."""
        from runtime.kernels.handoff_triton import clock_pings

        def send(g: torch.Tensor, first: int) -> None:
            stream = torch.cuda.current_stream(self.device)
            for i in range(trials):
                clock_pings(self.req, self.resp, g[i:i + 1], first + i, max_spins=0)   # the store, no wait for it
                if then is not None:
                    then()
                stream.synchronize()
                time.sleep(gap_s)                     # (seen before the next: the echo takes every value)

        before = self.sample()
        g, cycles = self._round(trials, send)
        clock = ClockMap.fit(before, self.sample())
        if clock is None:
            raise RuntimeError("the CPU's cycle counter could not be set against the GPU's clock")
        return clock.ns(cycles) - g[:, 0]

    def sample(self, n: int = PINGS) -> ClockSample:
        """The cycle counter against the GPU's clock, from the shortest of n pings (the first tenth left out:
        they warm both sides up)."""
        g, cycles = self.pings(n)
        g, cycles = g[n // 10:], cycles[n // 10:]
        k = int(np.argmin(g[:, 1] - g[:, 0]))
        return ClockSample(int(cycles[k]), int((g[k, 0] + g[k, 1]) // 2), float(g[k, 1] - g[k, 0]) / 2)
