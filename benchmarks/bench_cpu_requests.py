"""The CPU expert kernel on a decode step's small requests, alone and beside a GPU reading host memory (issue 10).

    python benchmarks/bench_cpu_requests.py [--threads 8 12 14 16] [--experts 1 2 3 4 8] [--calls 200]
                                            [--gap-us 250] [--json PATH]

Why: in zero-copy decode the CPU-share worker answers one request a layer of 1-3 experts (one token) while the
GPU reads the layer's other misses over PCIe from the same DRAM. Runs f-l measured ~67 µs + ~88 µs an expert a
request in the decode step (~28 GB/s), where the probe's whole-layer calls (8 experts) reach 52-57 GB/s. Three
causes predict different tables here:

- the kernel's fixed cost (two parallel regions, serial steps): `hot` rows (the same experts every call, in
  cache) as slow as `cold` ones, and µs falling little with fewer experts;
- DRAM shared with the GPU's reads: `cold` rows slower with `h2d` (the copy engine reading pinned host memory
  at the link's rate beside them), and the read sweep's GB/s + the H2D's GB/s together near a fixed roof;
- thread count: a knee in µs per thread count.

`FREETOKEN_OMP_SPINCOUNT` (runtime/experts/openmp.py) sets how long the kernel's idle threads spin before they
sleep; run it once without and once with to see what the wake-ups cost. Each call: one token, `experts` distinct experts of the qwen3-30b-a3b shape (D 2048, I 768, int4 group 128),
cycling through 8 layers (2.5 GB, past the caches) in `cold`; the same layer and experts in `hot`. Calls are
`--gap-us` apart (the GPU's part of a layer), the calling thread spinning in between as the worker does. The
kernel runs in a thread of its own with numba's threads set there (numba's pools are per calling thread), after
numba's OpenMP is set apart from torch's (runtime/experts/openmp.py), as in the tier.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

GB = 1e9


class BackgroundH2D:
    """Host->device copies from a pinned buffer, back to back on a side stream, until stopped: DRAM read by the
    copy engine at the link's rate. The thread waits on blocking events (sleeps, not spins: it must not take a
    core from the kernel). `gbps` = bytes copied over the time it ran."""

    def __init__(self, mib: int = 256):
        self.src = torch.empty(mib << 20, dtype=torch.uint8, pin_memory=True)
        self.src.fill_(1)
        self.dst = torch.empty_like(self.src, device="cuda")
        self.stream = torch.cuda.Stream()
        self._stop = threading.Event()
        self.gbps = 0.0

    def __enter__(self):
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        time.sleep(0.05)                              # copies in flight before the measurement starts
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _run(self):
        copies, t0 = 0, time.perf_counter()
        with torch.cuda.stream(self.stream):
            while not self._stop.is_set():
                for _ in range(4):
                    self.dst.copy_(self.src, non_blocking=True)
                done = torch.cuda.Event(blocking=True)
                done.record(self.stream)
                done.synchronize()
                copies += 4
        self.gbps = copies * self.src.numel() / (time.perf_counter() - t0) / GB


def h2d_alone(bg: BackgroundH2D, seconds: float = 0.5) -> float:
    with bg:
        time.sleep(seconds)
    return bg.gbps


def read_sweep_gbps(views, threads: int, rounds: int = 3) -> float:
    """A parallel sum over every layer's bytes at `threads` numba threads (the probe's read bar), best of rounds."""
    import numba

    from runtime.experts.bench import _read_kernel
    numba.set_num_threads(threads)
    total = _read_kernel()
    total(views[0][:4096])
    nbytes = sum(v.nbytes for v in views)
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for v in views:
            total(v)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / GB


def lanes_line(lanes: dict) -> str:
    """Per stage, µs a request: a lane's time in its tasks (mean / busiest lane), its wait for the others' (mean /
    longest), its tasks, µs a task and its first task's µs - whether a slow stage's tasks are slow or its lanes
    wait."""
    return "    lanes, µs a request (busy mean/max, waiting mean/max, tasks a lane, µs a task, first task): " + \
        "; ".join(f"{name} {c['busy_us']:.1f}/{c['busy_max_us']:.1f}, {c['wait_us']:.1f}/{c['wait_max_us']:.1f}, "
                  f"{c['tasks_per_lane']:.1f}, {c['us_per_task']:.2f}, {c['first_task_us']:.2f}"
                  for name, c in lanes.items())


def in_thread(fn, *args):
    """fn(*args) in a thread of its own that then ends, and with it the OpenMP pool it made."""
    out = []
    th = threading.Thread(target=lambda: out.append(fn(*args)))
    th.start()
    th.join()
    return out[0]


def main(argv: list[str] | None = None) -> int:
    from runtime.experts.openmp import load_private_openmp
    binding = load_private_openmp()
    from runtime.experts.cpu_executor import CpuExecutor
    from runtime.experts.cpu_share import CpuShareWorker, Mailbox
    from runtime.experts.host_store import HostExpertStore
    from runtime.experts.interface import ExpertSpec

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", nargs="+", type=int, default=[8, 12, 14, 16])
    p.add_argument("--experts", nargs="+", type=int, default=[1, 2, 3, 4, 8])
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--gap-us", type=float, default=250.0)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--no-sweeps", dest="sweeps", action="store_false", help="skip the read sweeps (after the rows)")
    p.add_argument("--early-x", nargs="+", choices=["on", "off"], default=["on"],
                   help="the worker's early plan (x quantized while the lanes ask for their first rows) on and/or "
                        "off: with both, each row runs in each mode in turn (--repeat times), one worker throughout")
    p.add_argument("--repeat", type=int, default=1, help="rounds of the modes a row (an A/B alternating)")
    p.add_argument("--warmup-calls", type=int, default=400, help="untimed requests before the table, per lane count")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    sys.setswitchinterval(5e-5)                     # the background thread's Python must not hold the GIL long

    t0 = time.perf_counter()
    store = HostExpertStore.synthetic(layers=args.layers, num_experts=128, hidden=2048, intermediate=768,
                                      codec="int4", group=128, seed=3)
    from runtime.experts.cpu_kernels_int8 import ISA
    print(f"store {store.nbytes / GB:.2f} GB built in {time.perf_counter() - t0:.1f} s; OpenMP binding {binding}; "
          f"dot products {ISA}", flush=True)
    cpu = CpuExecutor(store, ExpertSpec())
    cpu.warm_up(store.layers[0])                    # compiled on one thread, as the tier does before its worker starts
    torch.set_num_threads(1)                        # the stand-in handoff's torch ops: no torch pool beside numba's
    bg = BackgroundH2D() if torch.cuda.is_available() else None
    report: dict = {"block_bytes": store.block_nbytes, "binding": binding,
                    "spin_count": os.environ.get("FREETOKEN_OMP_SPINCOUNT"), "rows": []}
    from runtime.experts.bench_model import phases_line, time_requests
    if bg is not None:
        report["h2d_alone_gbps"] = h2d_alone(bg)
        print(f"H2D alone: {report['h2d_alone_gbps']:.1f} GB/s", flush=True)
    # the worker rows first: libgomp counts every pool's threads, and a second pool (the sweeps' thread's) beside
    # the worker's would make it throttle (short spins, sleeping threads woken each region) - not the tier's case
    print(f"{'threads':>7} {'experts':>7} {'data':>5} {'beside':>6} {'early x':>7} {'worker µs':>9} {'GB/s':>6} "
          f"{'µs/expert':>9} {'trip µs':>7} {'p90':>6}", flush=True)
    args8 = cpu.int8_args()
    for threads in args.threads:
        box = Mailbox(max_tokens=1, top_k=max(args.experts), hidden=store.layout.hidden,
                      device=torch.device("cpu"), share=1.0)
        worker = CpuShareWorker(box, None, int8_args=args8, threads=threads)
        # untimed: a process's first cell ran its lanes waiting 20-90 µs a request (s22e, both trees), so the
        # table starts once the worker's threads have served a while
        time_requests(worker, box, store, experts=max(args.experts), calls=args.warmup_calls,
                      gap_s=args.gap_us * 1e-6, hot=False, seed=99)
        for n in args.experts:
            for hot in (False, True):
                for beside, early in [(b_, e_) for b_ in (["none", "h2d"] if bg is not None and not hot else ["none"])
                                      for _ in range(args.repeat) for e_ in args.early_x]:
                    if worker.early_x != (early == "on"):
                        worker.early_x = early == "on"    # read as the worker's loop next enters its region:
                        time.sleep(0.02)                  # its 5 ms spin over first
                    kw = dict(experts=n, calls=args.calls, gap_s=args.gap_us * 1e-6, hot=hot)
                    marks = worker.phase_marks()
                    if beside == "h2d":
                        with bg:
                            trips, busy = time_requests(worker, box, store, **kw)
                    else:
                        trips, busy = time_requests(worker, box, store, **kw)
                    med = statistics.median(trips)
                    p90 = sorted(trips)[int(0.9 * len(trips))]
                    gbps = n * store.block_nbytes / busy / GB if busy else 0.0
                    r = {"threads": threads, "experts": n, "data": "hot" if hot else "cold", "beside": beside,
                         "early_x": early, "worker_us": busy * 1e6, "gbps": gbps, "trip_median_us": med * 1e6,
                         "trip_p90_us": p90 * 1e6}
                    if beside == "h2d":
                        r["h2d_gbps"] = bg.gbps
                    report["rows"].append(r)
                    print(f"{threads:>7} {n:>7} {r['data']:>5} {beside:>6} {early:>7} {busy * 1e6:>9.0f} {gbps:>6.1f} "
                          f"{busy * 1e6 / n:>9.0f} {med * 1e6:>7.0f} {p90 * 1e6:>6.0f}"
                          + (f"  (H2D {bg.gbps:.0f} GB/s)" if beside == "h2d" else ""), flush=True)
                    line = phases_line(worker, marks)      # (the warm-up calls included: 10 of them)
                    if line:
                        print(line, flush=True)
                    lanes = worker.lane_counts(marks)
                    if lanes:
                        r["lanes"] = lanes
                        print(lanes_line(lanes), flush=True)
        worker.close()
    if args.sweeps:
        views = [store.layer_buffer(layer).reshape(-1).view(np.uint64) for layer in store.layers]
        print(f"{'threads':>7} {'read GB/s':>9} {'read+H2D':>9} {'H2D beside':>10}", flush=True)
        for threads in args.threads:
            row = {"threads": threads, "read_gbps": in_thread(read_sweep_gbps, views, threads)}
            if bg is not None:
                with bg:
                    row["read_gbps_beside_h2d"] = in_thread(read_sweep_gbps, views, threads)
                row["h2d_gbps_beside_read"] = bg.gbps
            report.setdefault("reads", []).append(row)
            print(f"{threads:>7} {row['read_gbps']:>9.1f} {row.get('read_gbps_beside_h2d', 0):>9.1f} "
                  f"{row.get('h2d_gbps_beside_read', 0):>10.1f}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
