"""The CPU's share of zero-copy decode: a worker thread that computes some missed experts while the GPU reads the
others over PCIe, inside one recorded decode step (issue 10).

Why: in zero-copy decode (hybrid.py) the GPU reads every missed expert from host memory at the link's rate
(~41 GB/s measured on the H200's PCIe 5). The CPU reads host memory at ~50 GB/s with the int8 kernel, so both
together roughly double the rate at which misses are served - but a recorded step cannot stop for the host. So
the GPU hands the CPU its share through a **mailbox** in page-locked, device-mapped host memory and waits for the
answer in a kernel (runtime/kernels/handoff_triton.py), while a worker thread polls the mailbox:

    GPU (in the graph)                                   worker thread (this module)
    handoff: split misses, write ids/weights/x, ticket -> sees the ticket (acquire load, no GIL while it spins)
    pool kernels: hits from VRAM, the GPU's misses        computes its experts (cpu_executor, all in one call)
      read in place from host memory                      writes the fp32 rows, then the ticket (release store)
    collect: spins until the answer holds the ticket, <-
      adds the rows

Calls are strictly sequential (the GPU waits for each answer before the next layer), so one mailbox suffices.
Which misses the CPU takes is a rule both sides can replay: the first round(n_miss * share) misses of the call in
assignment order (the host replays it to count CPU and PCIe experts from the step's routing log).

**The finer split** (session 16; a one-token call when the mailbox has a `split_unit`): the CPU's work is
n_miss * share experts exactly, not rounded to whole ones. It takes the first floor(n_miss * share) misses whole
and, of the next one, the first r rows of its gate and up matrices (r in steps of SPLIT_ROWS, the fraction's worth
of the expert's bytes: `split_unit` rows weigh one expert). It writes those rows' activations (fp32) to `part` and
its ticket to `part_resp` early in its request; the GPU gathers the rest of that expert (its other gate/up rows and
its whole down part), computes its own rows, takes rows 0..r from `part` (a kernel between its two gathers waits
for the ticket and copies them to device memory, another writes them into h after the gate/up kernel:
handoff_triton.take_split_rows, fill_split_rows) and runs the down kernel as for any miss. An expert the call names
twice is never split (the gather copies it once for both assignments). Why: with whole experts the two sides can
be no closer than an expert (~55 µs on the GPU, ~39 µs on the CPU, of a ~210 µs layer);
`benchmarks/sim_split_grain.py` models ~9 µs a layer.

Faults: a worker exception answers with zeros and is reported (`error`), and the CPU share drops to 0 from the next
step; a GPU that waited `max_spins` polls sets a device error flag instead of hanging. On a CPU device (tests) the
same protocol runs with torch/numpy stand-ins for the two kernels (`handoff_reference`, `collect_reference`).
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time

import numpy as np
import torch

from runtime.experts.openmp import load_private_openmp

log = logging.getLogger(__name__)

SPIN_S = 0.005                # a nogil spin lasts this long (polls counted by a calibration) before the thread
                              # looks at its stop flag: longer than the host's pause between two decode steps
                              # (bookkeeping and the graph launch, 1-3 ms measured), so a decoding worker never
                              # leaves compiled code, and never naps, between the layers of a generation
GIL_SWITCH_S = 5e-5           # the interpreter's thread switch interval while a worker runs
PY_POLL_SLEEP_S = 0.0005      # without numba the poll is Python's: a nap between polls hands back the GIL
QUIET_AFTER_S = 0.05          # no request for this long: poll lazily...
QUIET_SLEEP_S = 0.005         # ...every 5 ms
TIMELINE_RING = 8192          # requests the mailbox's timeline keeps (Mailbox.times: a bench row's last ones)
SPLIT_ROWS = 16               # a split expert's rows go to the CPU in steps of this many (the int8 kernel's row
                              # task, cpu_kernels_int8.ROWS_PER_TASK: a test keeps the two equal)

try:
    from numba import njit

    from runtime.experts.cpu_kernels_int8 import CTL_BAD, CTL_SIZE, N_PHASES, _cycles, _load_acquire, \
        _store_release, lane_counts, new_phases, serve_layers

    @njit(nogil=True, cache=True)
    def spin_until_changed(word, last, spins):
        """Poll word[0] (acquire) up to `spins` times without the GIL; its value (== last if nothing came)."""
        v = _load_acquire(word, 0)
        for _ in range(spins):
            if v != last:
                return v
            v = _load_acquire(word, 0)
        return v

    @njit(nogil=True, cache=True)
    def publish(word, value):
        """word[0] = value with release semantics (the answer's rows are visible before it)."""
        _store_release(word, 0, value)

    @njit(nogil=True, cache=True)
    def read_cycles():
        return _cycles()

    def serve_int8(req, resp, meta, ids, weights, x, out, part, part_resp, last, spins, clock, stamps, phases, lanes,
                   early_x, sel64, sel32, s64, s32, s8, ctl, codec, bufs, g_scale, u_scale, d_scale, nbytes, offs,
                   has_bias, inter, group, table, activation, alpha, limit):
        """The worker's request loop: poll the request word, gather the CPU's assignments, run the int8 kernel
        over the layer's blocks, answer - in two compiled steps without the GIL. Returns the last ticket served
        once `spins` polls saw nothing new (the Python side then checks its stop flag and naps). clock [2] int64
        accumulates the cycles from seeing a request to the kernel's end, and the requests answered; stamps
        [R, 2] int64 gets each request's cycles when seen and when done, at ticket % R (the mailbox's timeline on
        the CPU's side: Mailbox.cpu_times); phases the
        kernel's own time marks (cpu_kernels_int8.PHASES); lanes its threads; early_x 1: a one-token request's x
        quantized after its plan is published (serve_layers' early plan), 0: before; sel64 [2A], sel32 [A] and s64,
        s32, s8 (the kernel's) scratch: nothing is allocated per request; ctl [CTL_SIZE] the lanes' shared words.

        The poll runs on this thread alone; once a request comes, `serve_layers` serves it and every one after it
        with all lanes kept in one parallel region until the spin ends (an idle worker keeps one core busy, not
        all of them). The step between the two is Python's, once a burst of requests (~10 µs of dispatch): as a
        compiled function of its own this loop made numba optimise the whole kernel once more (~6 s of a fresh
        install's compile) and, cached by this file alone, ran a stale kernel after an edit of
        cpu_kernels_int8.py."""
        if spin_until_changed(req, last, spins) == last:
            return last
        seq = serve_layers(req, resp, meta, ids, weights, x, out, part, part_resp, last, spins, clock, stamps, phases,
                           lanes, early_x, sel64, sel32, s64, s32, s8, ctl, codec, bufs, g_scale, u_scale, d_scale,
                           nbytes, offs, has_bias, inter, group, table, activation, alpha, limit)
        if ctl[CTL_BAD]:           # (the worker answers it with zeros and both tickets, and reports this)
            raise ValueError("CPU expert worker: a split expert's id, token or rows are out of range")
        return seq

    HAVE_NUMBA = True
except ImportError:           # numba absent: the worker polls in Python (tests; the real path needs numba)
    HAVE_NUMBA = False

    def spin_until_changed(word, last, spins):
        for _ in range(min(spins, 2000)):
            if word[0] != last:
                return int(word[0])
        return int(word[0])

    def publish(word, value):
        word[0] = value


def _cycle_rate(seconds: float = 0.02) -> float:
    """Cycles per second of `read_cycles`, against perf_counter over `seconds` (0 where the counter reads 0)."""
    read_cycles()                                   # compiled (or loaded) before the clock starts
    t0, c0 = time.perf_counter(), int(read_cycles())
    while time.perf_counter() - t0 < seconds:
        pass
    t1, c1 = time.perf_counter(), int(read_cycles())
    return (c1 - c0) / (t1 - t0) if c1 > c0 else 0.0


class Mailbox:
    """The GPU <-> CPU mailbox: host words and rows in page-locked (device-mapped) memory, plus the device-side
    scalars and slot vectors of the handoff. Shapes: T <= max_tokens tokens, K experts per token, D hidden."""

    def __init__(self, *, max_tokens: int, top_k: int, hidden: int, device: torch.device, share: float,
                 intermediate: int = 0, layers: int = 1):
        pin = device.type == "cuda"
        self.top_k, self.intermediate = top_k, intermediate
        a = max_tokens * top_k
        host = lambda *shape, dtype: torch.zeros(shape, dtype=dtype, pin_memory=pin)       # noqa: E731
        self.req, self.resp = host(1, dtype=torch.int64), host(1, dtype=torch.int64)        # tickets
        self.meta = host(5, dtype=torch.int64)                     # layer index, T, split expert, its token, rows
        self.ids = host(a, dtype=torch.int64)                      # [A] the CPU's experts (-1: not the CPU's)
        self.weights = host(a, dtype=torch.float32)                # [A]
        self.x = host(max_tokens, hidden, dtype=torch.float32)     # [T, D] the tokens' activations
        self.out = host(max_tokens, hidden, dtype=torch.float32)   # [T, D] the CPU's weighted sum
        self.part = host(max(1, intermediate), dtype=torch.float32)  # [I] the split expert's first rows of h
        self.part_resp = host(1, dtype=torch.int64)                # their ticket
        dev = lambda *shape, dtype, fill=0: torch.full(shape, fill, dtype=dtype, device=device)   # noqa: E731
        self.ticket = dev(1, dtype=torch.int64)                    # the last request's number (device counter)
        self.ncpu = dev(1, dtype=torch.int32)                      # the CPU's experts in the last call
        self.error = dev(1, dtype=torch.int32)                     # set by collect when the answer never came
        # the CPU's share of misses (host sets it): one for every layer, or (layers > 1) one a layer, where
        # HOST_ONLY marks a layer the GPU cannot read (`set_host_only`)
        self.share = dev(max(1, layers), dtype=torch.float32, fill=share)
        self.share_host = np.full(max(1, layers), share, dtype=np.float32)   # the same, for the host's replays
        self.hit_slots = dev(a, dtype=torch.int64, fill=-1)
        self.zc_ids = dev(a, dtype=torch.int64, fill=-1)
        self.split = torch.tensor([-1, 0], dtype=torch.int32, device=device)   # the last call's split (assignment, rows)
        self.split_unit = dev(1, dtype=torch.float32)              # gate/up rows that weigh one expert (0: no split)
        self.part_dev = dev(max(1, intermediate), dtype=torch.float32)   # `part` taken into device memory
        # each request's timeline, ns on the GPU's clock (the host's in the references), at ticket % ring: the
        # request published (handoff), collect started, the answer's ticket seen, its rows added (`timeline`)
        self.times = dev(TIMELINE_RING, 4, dtype=torch.int64)
        # the compiled worker's side of it, the CPU's cycle counter: when it saw each request, when it was done
        self.cpu_times = np.zeros((TIMELINE_RING, 2), dtype=np.int64)
        self.unit = 0                                              # the same, on the host (the rule's replays)
        self._np = {name: getattr(self, name).numpy() for name in ("req", "resp", "meta", "ids", "weights", "x", "out",
                                                                   "part", "part_resp")}

    def set_share(self, share: float) -> None:
        """Every layer's share but the host-only ones' (HOST_ONLY, past any share)."""
        self.share_host[self.share_host <= 1.0] = share
        # kernels on the stream, no host copy: a copy from pageable memory would wait for the step in flight
        self.share.masked_fill_(self.share <= 1.0, float(share))

    def set_host_only(self, layer_indices) -> None:
        """These layers' experts live where the GPU cannot read them (host memory the OS would not page-lock):
        every miss of theirs is the CPU's, whatever the share, and none is read over PCIe - not even once the
        worker failed (the handoff then drops them; the tier reports the failure)."""
        idx = list(layer_indices)
        if idx and len(self.share_host) == 1:
            raise ValueError("host-only layers need a mailbox with a share a layer (layers > 1)")
        self.share_host[idx] = HOST_ONLY
        self.share.copy_(torch.from_numpy(self.share_host))                 # (once, at load)

    def share_of(self, layer_index: int) -> float:
        """The share the handoff applies to this layer (host mirror: no device read)."""
        return float(self.share_host[layer_index if len(self.share_host) > 1 else 0])

    def timeline(self, after: int, last: int | None = None, clock=None) -> dict[str, float] | None:
        """Where a request's round trip goes, from `times`: over tickets after..last (the device counter's value
        now when None; the ring's last TIMELINE_RING at most) each span's median µs, and the mean of "request to
        answer seen" (to set beside the worker's mean time from seeing a request to answering it: the rest is
        the two crossings). With `clock` (a mailbox_clock.ClockMap: the worker's cycle counter on the clock of
        `times`) and the compiled worker's stamps (`cpu_times`), the round trip split at the worker: the
        request's crossing, the worker's time, the answer's crossing (from its end: the answer is out a little
        before). None when no request finished in that range. Syncs (host reads of device memory)."""
        last = int(self.ticket[0]) if last is None else last
        tickets = np.arange(max(after + 1, last - TIMELINE_RING + 1), last + 1)
        if tickets.size == 0:
            return None
        raw = self.times.cpu().numpy()[tickets % TIMELINE_RING]
        done = (raw[:, 0] > 0) & (raw[:, 1] > 0) & (raw[:, 2] >= raw[:, 0]) & (raw[:, 3] >= raw[:, 2])
        if not done.any():
            return None
        base = int(raw[done, 0].min())                  # (ns since it, before floats: exact to the ns)
        t = (raw[done] - base).astype(np.float64) / 1e3                                     # µs
        seen = t[:, 2] - t[:, 0]
        spans = {"requests": int(done.sum()),
                 "request to collect": float(np.median(t[:, 1] - t[:, 0])),
                 "request to answer seen": float(np.median(seen)),
                 "request to answer seen, mean": float(seen.mean()),
                 "collect waited": float(np.median(np.maximum(t[:, 2] - t[:, 1], 0.0))),
                 "answer seen to rows added": float(np.median(t[:, 3] - t[:, 2]))}
        cpu = self.cpu_times[tickets[done] % TIMELINE_RING]
        ok = (cpu[:, 0] > 0) & (cpu[:, 1] >= cpu[:, 0])
        if clock is not None and ok.any():
            c = (clock.ns(cpu[ok]) - base).astype(np.float64) / 1e3                          # µs, same base
            g = t[ok]
            spans.update({"worker stamps": int(ok.sum()),
                          "request to worker": float(np.median(c[:, 0] - g[:, 0])),
                          "worker": float(np.median(c[:, 1] - c[:, 0])),
                          "worker done to answer seen": float(np.median(g[:, 2] - c[:, 1])),
                          "clock error": float(clock.a.error_ns + clock.b.error_ns) / 2e3})
        return spans

    def enable_split(self, unit: int) -> None:
        """Split one expert between the sides from now on (one-token calls): `unit` gate/up rows weigh as many
        bytes as one whole expert (`split_unit_rows`); 0 turns it off."""
        if unit and not self.intermediate:
            raise ValueError("Mailbox.enable_split: the mailbox was made without the expert width (intermediate)")
        self.unit = int(unit)
        self.split_unit.fill_(float(unit))


def nap_after_an_empty_spin(quiet: bool) -> float:
    """Seconds the worker sleeps after a spin that saw no request: none while decoding (the next request may come
    any moment: a nap made a step's first answers late), 5 ms once quiet, and a short one where the poll is
    Python's (it holds the GIL: the decoding thread must get it)."""
    if quiet:
        return QUIET_SLEEP_S
    return 0.0 if HAVE_NUMBA else PY_POLL_SLEEP_S


def polls_per_second(polls: int = 1_000_000) -> float:
    """How many polls of a mailbox word `spin_until_changed` makes a second on this CPU (a word nothing writes;
    the best of three): a spin is sized in time, not in polls, which take ~0.5 ns on a server core and more on a
    laptop's."""
    word = np.zeros(1, dtype=np.int64)
    spin_until_changed(word, 0, 10)                  # compiled (or loaded from the cache) before timing
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        spin_until_changed(word, 0, polls)
        best = min(best, time.perf_counter() - t0)
    return polls / max(best, 1e-9)


def default_worker_threads(cores: int | None = None) -> int:
    """Kernel threads for the CPU-share worker when none were asked for: every core but two. During a decode
    step two threads are busy beside the kernel's own: the decoding thread (CUDA's default sync spins while it
    waits for the GPU) and this worker's polling loop. A parallel region waits for its slowest thread, so one
    kernel thread the OS has to park behind them stalls the whole request, and with it the GPU's collect."""
    cores = cores or os.cpu_count() or 1
    return max(1, cores - 2)


class CpuShareWorker:
    """Serves the mailbox's requests with `compute(layer_index, x [T, D] fp32, tokens [A], experts [A],
    weights [A]) -> [T, D] fp32` until `close()`. A daemon thread; `error` holds the first failure."""

    def __init__(self, box: Mailbox, compute, *, name: str = "cpu-experts", int8_args: tuple | None = None,
                 threads: int = 0, early_x: bool | None = None):
        """`int8_args` (CpuExecutor.int8_args()): serve requests in compiled code (`serve_int8`), no Python
        between a request and its answer; else each request goes through `compute` in Python. `early_x`: the
        compiled loop's early plan (a one-token request's x quantized while the lanes ask for their first rows;
        the same bits either way); None: on unless FREETOKEN_CPU_EARLY_X=0 (an A/B without a recompile)."""
        self.box, self.compute = box, compute
        self.int8_args, self.threads = int8_args, threads
        self.early_x = early_x if early_x is not None else os.environ.get("FREETOKEN_CPU_EARLY_X", "1") != "0"
        self.compiled = int8_args is not None and HAVE_NUMBA     # requests served in compiled code
        load_private_openmp()            # (the tier did it before its warm-up; a worker built alone does it here)
        if HAVE_NUMBA:
            # numba starts its threading layer lazily, at the first parallel call; started from inside the
            # worker's compiled loop (no GIL) it crashes the process: start it here. The tier's warm-up used to
            # do it by accident; a worker built alone segfaulted at its first request
            import numba
            numba.get_num_threads()
        most_lanes = numba.config.NUMBA_NUM_THREADS if HAVE_NUMBA else 1   # any lane count the thread can set
        # compile (or load from numba's cache) the polling code here, while the model loads: compiled in the
        # thread at its first request, it would keep the GPU waiting for seconds (past collect's bounded wait)
        b = box._np
        spin_until_changed(b["req"], int(b["req"][0]), 0)
        publish(np.zeros(1, dtype=np.int64), 0)
        self._clock = np.zeros(2, dtype=np.int64)       # compiled serving: cycles busy, requests answered
        self._phases = new_phases(most_lanes) if HAVE_NUMBA else np.zeros(1, dtype=np.int64)   # + every lane's
        self._lanes = 1                                  # the kernel's threads, as the worker thread sets them
        self._cycles_per_s = 0.0
        if int8_args is not None and HAVE_NUMBA:
            import numba
            self._scratch = self._scratch_for(most_lanes)
            # compiled for these arguments' types without running it (a parallel region run on this thread
            # would leave it a pool of kernel threads for good: CpuExecutor.warm_up)
            args = (b["req"], b["resp"], b["meta"], b["ids"], b["weights"], b["x"], b["out"], b["part"], b["part_resp"],
                    int(b["req"][0]), 0,
                    self._clock, box.cpu_times, self._phases, 1, int(self.early_x), *self._scratch, *int8_args)
            serve_layers.compile(tuple(numba.typeof(a) for a in args))
            self._cycles_per_s = _cycle_rate()
        self.error: BaseException | None = None
        self.served = 0
        self.busy_seconds = 0.0
        self._stop = threading.Event()
        self.spin_polls = max(1000, int(polls_per_second() * SPIN_S)) if HAVE_NUMBA else 1000
        # the worker's few Python steps per request must not wait for the GIL: while the decoding thread runs
        # Python (launching a step, its bookkeeping), a thread asking for the GIL gets it only at the next
        # switch interval (5 ms by default) - longer than the whole answer should take
        self._switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(min(self._switch_interval, GIL_SWITCH_S))
        # the last ticket already answered, read before the thread starts: read in the thread, a request sent
        # while it starts up (the tier's probe call right after construction) would count as already answered
        self._thread = threading.Thread(target=self._run, args=(int(b["req"][0]),), name=name, daemon=True)
        self._thread.start()

    def _run(self, last: int) -> None:
        if HAVE_NUMBA:
            import numba
            if self.threads:
                numba.set_num_threads(self.threads)      # per calling thread: set it where the kernel runs
            self._lanes = numba.get_num_threads()
        serve = self._serve_compiled if self.int8_args is not None and HAVE_NUMBA else self._serve_python
        b = self.box._np
        idle_since = time.monotonic()
        while not self._stop.is_set():
            # spin hard while requests come (a decode step sends one per layer) and through the pauses between
            # steps; after a quiet spell only look now and then, so an idle app does not keep a core busy (the
            # first request then waits <= 5 ms). Run k's trace: a worker that napped 0.5 ms whenever 200,000 polls
            # (~0.1 ms on the H200 host) saw nothing answered a step's first requests 0.1-1.3 ms late, ~1.9 ms a step
            quiet = time.monotonic() - idle_since > QUIET_AFTER_S
            t0 = time.perf_counter()
            try:
                seq = serve(last, 1000 if quiet else self.spin_polls)
            except BaseException as exc:  # noqa: BLE001  (answer anyway, with zeros: the GPU is waiting)
                seq = int(b["req"][0])
                b["out"][:] = 0.0
                if self.error is None:           # set before the answer: whoever sees the zeros sees why
                    self.error = exc
                publish(b["part_resp"], seq)     # (a split expert's rows too: nothing on the GPU waits on)
                publish(b["resp"], seq)
                if self.error is exc:
                    log.error("the CPU expert worker failed (%s); its share goes back to the GPU", exc)
            if seq == last:
                nap = nap_after_an_empty_spin(quiet)
                if nap:
                    time.sleep(nap)
                continue
            self.served += seq - last                    # tickets are consecutive: one per request
            self.busy_seconds += time.perf_counter() - t0
            last = seq
            idle_since = time.monotonic()

    def _scratch_for(self, lanes: int) -> tuple:
        """The compiled loop's scratch for requests of up to the mailbox's tokens and assignments: its own
        selection arrays and the kernel's (cpu_kernels_int8.Scratch)."""
        from runtime.experts.cpu_kernels_int8 import Scratch
        b = self.box._np
        a, (t, d) = len(b["ids"]), b["x"].shape
        codec, bufs, _, _, _, nbytes, _, _, inter, group = self.int8_args[:10]
        kernel = Scratch().fit(t, a, bufs[0].shape[0] // nbytes, d, inter, group, lanes)
        return (np.zeros(2 * a, dtype=np.int64), np.zeros(a, dtype=np.float32), *kernel,
                np.zeros(CTL_SIZE, dtype=np.int64))

    def _serve_compiled(self, last: int, spins: int) -> int:
        """Every request that comes within `spins` polls, in compiled code; the last ticket answered."""
        b = self.box._np
        return int(serve_int8(b["req"], b["resp"], b["meta"], b["ids"], b["weights"], b["x"], b["out"], b["part"],
                              b["part_resp"], last, spins,
                              self._clock, self.box.cpu_times, self._phases, self._lanes, int(self.early_x),
                              *self._scratch, *self.int8_args))

    @property
    def kernel_seconds(self) -> float | None:
        """Compiled serving: seconds from seeing requests to lane 0's end of each (the GPU has the answer at the
        last task, a few µs before), not the wait for them, by the CPU's cycle counter; None where that clock is
        unavailable."""
        if not self._cycles_per_s:
            return None
        return float(self._clock[0]) / self._cycles_per_s

    def phase_marks(self) -> np.ndarray:
        """A copy of the kernel's summed time marks so far, to pass to `kernel_phases(since=...)` later."""
        return self._phases.copy()

    def kernel_phases(self, since: np.ndarray | None = None) -> dict[str, float] | None:
        """Compiled serving: the kernel's mean µs a request from its start to each of its marks (PHASES: the
        serial start, the lanes coming in, each stage done, the join), over the requests since `since` (a
        `phase_marks()` copy; None: all), or None where the cycle counter is unavailable or no request came."""
        d = self._phases_since(since)
        n = int(d[N_PHASES - 1]) if HAVE_NUMBA else 0
        if not self._cycles_per_s or not n:
            return None
        from runtime.experts.cpu_kernels_int8 import PHASES, SPLIT_COUNT, SPLIT_MARK
        marks = {name: 1e6 * float(c) / n / self._cycles_per_s for name, c in zip(PHASES, d)}
        if d.shape[0] > SPLIT_COUNT and d[SPLIT_COUNT]:      # (the finer split's rows, over the requests that had them)
            marks["split rows answered"] = 1e6 * float(d[SPLIT_MARK]) / float(d[SPLIT_COUNT]) / self._cycles_per_s
        return marks

    def lane_counts(self, since: np.ndarray | None = None) -> dict[str, dict[str, float]] | None:
        """Compiled serving: per stage of the kernel, the mean µs a request each lane spent in its tasks and
        waiting for the others' (and the busiest lane's), its tasks, over the requests since `since` (a
        `phase_marks()` copy); None as for `kernel_phases`."""
        if not HAVE_NUMBA:
            return None
        return lane_counts(self._phases_since(since), self._lanes, self._cycles_per_s)

    def _phases_since(self, since: np.ndarray | None) -> np.ndarray:
        """The kernel's phase words added since `since` (a `phase_marks()` copy; None: all of them)."""
        return self._phases if since is None or since.shape != self._phases.shape else self._phases - since

    @property
    def requests(self) -> int:
        """Requests answered so far, current at any moment: the compiled loop's own count (`served` is added to
        only when a spin ends, and a decode run's steps come closer together than the 5 ms spin, so it can stay
        behind for a whole run: session 13's bench rows read 44 requests for 4,500), else `served`."""
        return self.kernel_requests if self.int8_args is not None and HAVE_NUMBA else self.served

    @property
    def kernel_requests(self) -> int:
        """Compiled serving: requests answered so far, by the same count as `kernel_seconds` (current even while
        the worker is inside a spin, where `served` lags until the spin ends)."""
        return int(self._clock[1])

    def _serve_python(self, last: int, spins: int) -> int:
        """At most one request, through `compute`; its ticket (== last when none came)."""
        b = self.box._np
        seq = int(spin_until_changed(b["req"], last, spins))
        if seq == last:
            return last
        li, t = int(b["meta"][0]), int(b["meta"][1])
        if int(b["meta"][4]):       # (the tier enables the split only with the compiled worker)
            raise RuntimeError("the Python CPU-share worker cannot compute a split expert's rows")
        k = len(b["ids"]) // len(b["x"])
        ids = b["ids"][:t * k].reshape(t, k)
        out = b["out"][:t]
        tok, kk = np.nonzero(ids >= 0)
        if len(tok):
            y = self.compute(li, torch.from_numpy(b["x"][:t]), tok, ids[tok, kk],
                             b["weights"][:t * k].reshape(t, k)[tok, kk])
            out[:] = y.numpy() if isinstance(y, torch.Tensor) else y
        else:
            out[:] = 0.0
        publish(b["resp"], seq)
        return seq

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
        sys.setswitchinterval(self._switch_interval)


# ---------------------------------------------------------------------------------- the rule
def split_row_parts(layout) -> list[tuple[int, int]]:
    """(byte offset, bytes a row) of each block part that holds one row per gate/up row: the bytes of a split
    expert's rows the CPU reads (and the gather leaves behind, gather_triton.RowSkip)."""
    return [(layout.parts[name].offset, layout.parts[name].nbytes // layout.intermediate)
            for name in ("gate", "gate_scales", "gate_mins", "up", "up_scales", "up_mins") if name in layout.parts]


def split_unit_rows(layout) -> int:
    """Gate/up rows (both matrices' row i, with their scales and mins) that weigh as many bytes as one whole
    expert block: the exchange rate of the finer split (~1.5 x the expert width: gate and up are ~2/3 of a block)."""
    pair = sum(per for _, per in split_row_parts(layout))
    return max(1, round(sum(part.nbytes for part in layout.parts.values()) / pair))   # (the block's padding: none)


HOST_ONLY = 2.0      # a layer's share past 1: all its misses are the CPU's (Mailbox.set_host_only)


def cpu_split(n_miss: int, share: float, *, unit: float = 0.0, inter: int = 0, tokens: int = 1) -> tuple[int, int]:
    """The handoff's rule (`handoff_triton._handoff_kernel` computes the same in fp32, op for op): (misses the CPU
    computes whole, rows of the next miss it computes the first gate/up rows of). Without a split (`unit` 0, or a
    call of several tokens) the first round(n_miss * share) misses, no rows. With one: the CPU's work is
    n_miss * share experts; its fraction of an expert becomes rows (`unit` rows weigh one), in steps of SPLIT_ROWS,
    at most the expert's width - a fraction past the midpoint between all its gate/up rows and the whole expert
    takes the whole expert instead."""
    f32 = np.float32
    work = f32(n_miss) * f32(share)
    if unit <= 0 or tokens != 1:
        return min(int(work + f32(0.5)), n_miss), 0
    whole = int(np.floor(work))
    rows = (work - f32(whole)) * f32(unit)
    if whole >= n_miss:
        return n_miss, 0
    if rows >= (f32(inter) + f32(unit)) * f32(0.5):
        return whole + 1, 0
    r = int(np.floor(rows * f32(1.0 / SPLIT_ROWS) + f32(0.5))) * SPLIT_ROWS
    return whole, min(r, inter) if whole < n_miss else 0


# ---------------------------------------------------------------------------------- CPU-device stand-ins
def handoff_reference(layer_index: int, ids: torch.Tensor, weights: torch.Tensor, x: torch.Tensor,
                      table_row: torch.Tensor, box: Mailbox, *,
                      log: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """What `handoff_triton.handoff` does, in torch/numpy on a CPU device (tests): same rule, same mailbox, the
    ids written to `log` too when one is given."""
    t, k = ids.shape
    if k != box.top_k:      # the worker reads T rows of the mailbox's K: a shorter row would leave stale ids
        raise ValueError(f"ids have {k} experts a token, the mailbox {box.top_k}")
    if log is not None:
        log.view(-1)[:t * k] = ids.reshape(-1)
    slot = table_row[ids]                                               # [T, K]
    miss = (slot < 0).reshape(-1)
    rank = torch.cumsum(miss.int(), 0) - miss.int()
    share = box.share_of(layer_index)
    n_cpu, rows = cpu_split(int(miss.sum()), share, unit=box.unit, inter=box.intermediate, tokens=t)
    if int(box.error[0]):                       # the worker failed to answer: the GPU's path reads every miss
        n_cpu = rows = 0                        # (but a host-only layer's, which it cannot read: dropped)
    cpu = miss & (rank < n_cpu)
    hit = torch.where(slot >= 0, slot, -1)
    zc = torch.where((miss & (rank >= n_cpu) & (share <= 1.0)).view(t, k), ids, -1)
    split_a = int(torch.nonzero(miss & (rank == n_cpu))[0, 0]) if rows else -1
    if rows and int((ids.reshape(-1) == ids.reshape(-1)[split_a]).sum()) > 1:
        split_a, rows = -1, 0                   # an expert named twice is gathered once for both: no split
    box.split[0], box.split[1] = split_a, rows
    box.ncpu.fill_(n_cpu + (rows > 0))
    if n_cpu or rows:
        b = box._np
        b["ids"][:t * k] = torch.where(cpu, ids.reshape(-1), -1).numpy()
        b["weights"][:t * k] = weights.reshape(-1).float().numpy()
        b["x"][:t] = x.float().numpy()
        b["meta"][:] = (layer_index, t, int(ids.reshape(-1)[split_a]) if rows else -1,
                        split_a // k if rows else 0, rows)
        box.ticket += 1
        stamp = box.times[int(box.ticket[0]) % TIMELINE_RING]
        stamp[1:] = 0
        stamp[0] = time.monotonic_ns()                  # (before the ticket, as the kernel's)
        publish(b["req"], int(box.ticket[0]))
    return hit, zc


def collect_reference(out: torch.Tensor, box: Mailbox, *, extra: torch.Tensor | None = None,
                      timeout_s: float = 10.0) -> torch.Tensor:
    """What `handoff_triton.collect` does, on a CPU device: wait for the answer (bounded), add it, and `extra`."""
    if extra is not None:
        out.add_(extra)
    if int(box.ncpu[0]) == 0:
        return out
    want, deadline = int(box.ticket[0]), time.monotonic() + timeout_s
    times = box.times[want % TIMELINE_RING]
    times[1] = time.monotonic_ns()
    while int(spin_until_changed(box._np["resp"], want - 1, 10_000)) != want:
        if time.monotonic() > deadline:
            box.error.fill_(1)
            return out
        time.sleep(0)
    times[2] = time.monotonic_ns()
    t = out.shape[0]
    out.add_(torch.from_numpy(box._np["out"][:t]).to(out.dtype))
    times[3] = time.monotonic_ns()
    return out


def cpu_share_counts(ids: np.ndarray, table: np.ndarray, share: float, *, unit: float = 0.0,
                     inter: int = 0) -> tuple[int, int]:
    """The handoff's rule replayed on the host for one call: ids [T, K] (all >= 0), table [E] -> (CPU, PCIe)
    missed assignments (a split expert counts as the GPU's: it moves the expert's down part and other rows)."""
    miss = int((table[ids.reshape(-1)] < 0).sum())
    n_cpu = cpu_split(miss, float(np.float32(share)), unit=unit, inter=inter, tokens=ids.shape[0])[0]
    return n_cpu, miss - n_cpu
