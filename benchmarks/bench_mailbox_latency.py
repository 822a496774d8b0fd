"""How long a word takes to cross the CPU-share mailbox (page-locked host memory the GPU polls over PCIe), idle and
beside a gather that keeps the link busy - the latencies a decode layer pays twice (handoff -> worker, answer ->
collect) and the finer split once more (its rows' ticket).

    python benchmarks/bench_mailbox_latency.py [--pings 2000] [--json out.json]

Rows (GPU machine; numba for the CPU side):
  round trip   a one-program kernel writes a word to host memory (system fence) and polls another until a CPU
               thread (compiled, no GIL) has echoed it; globaltimer around each ping (mailbox_clock.GpuClockSync:
               the pings that also set the worker's clock against the GPU's for bench model's round-trip line)
  one poll     dependent volatile loads of a host word already set: a poll's own round trip
  a store      the GPU stores a word (its clock just before), a CPU echo sees it (its cycle counter, set on the
               GPU's clock by pings around the trials): the request's crossing without the worker, alone and with
               the gather launched right behind the store, as decode's misses follow its handoff
  collect      `handoff_triton.collect` with its answer already there, from its start to its rows added (the
               mailbox's timeline, the GPU's clock: s17d timed the launches with CUDA events and measured Python's
               launch, ~32 µs): its floor; "its poll" to the ticket seen. One thread a token polling (the default
               since session 19; its program of 4 warps, and of 16: one 16-byte load of the row a thread) and
               every warp (s18d: 8.7 µs idle where one poll takes 1.2)
  k warps      one poll of a word while k warps poll it too (8 programs of 2 warps: collect until session 19)
each idle, beside the gather kernel on another stream (SM loads, as zero-copy decode's misses) and beside
copy-engine copies. Predicted: ~1-2 µs idle; beside the gather, a poll waits behind the reads already in flight.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import triton
import triton.language as tl

from runtime.kernels.handoff_triton import globaltimer as _timer


@triton.jit
def _poll_kernel(word_ptr, times_ptr, n):
    v = tl.load(word_ptr, volatile=True)
    for i in range(n):
        t0 = _timer(i)
        v = tl.load(word_ptr + (v - v), volatile=True)     # dependent: one round trip after the other
        if tl.program_id(0) == 0:                         # (every warp of every program polls; one writes)
            tl.store(times_ptr + i, _timer(i) - t0 + (v - v))


def _stats(ns: torch.Tensor) -> dict:
    us = sorted((ns.double() / 1e3).tolist())
    q = lambda f: us[min(len(us) - 1, int(f * len(us)))]
    return {"median_us": statistics.median(us), "p10_us": q(0.1), "p90_us": q(0.9), "max_us": us[-1]}


def _with_load(kind: str | None, dev, fn, *, blocks: int = 48):
    """fn() while `kind` traffic crosses the link (bench_model.GatherTraffic: the gather kernel's SM loads or the
    copy engines, 8 blocks of 2.5 MB a launch out of `blocks` such blocks of page-locked memory, queued to outlast
    fn), the result and the traffic's GB/s."""
    from runtime.experts.bench_model import GatherTraffic

    if kind is None:
        return fn(), None
    src = torch.randint(0, 255, (blocks, 2_506_752), dtype=torch.uint8).pin_memory()
    load = GatherTraffic([src], dev, blocks=8, launches=2000, copy_engine=kind == "copy engine")
    load.start()                                          # ~40 GB: ~0.8 s of link at ~45 GB/s
    time.sleep(0.01)
    load.mark()
    out = fn()                                            # (fn waits for its own stream only: the load goes on)
    load.mark()
    torch.cuda.synchronize()
    return out, load.rate()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pings", type=int, default=2000)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--load-blocks", type=int, nargs="+", default=[48],
                    help="the gather's source, in 2.5 MB blocks (each a row beside it): a small one is a test of "
                         "whether the link's translations (IOTLB) or its queue hold a word up behind the gather")
    args = ap.parse_args()
    from runtime.experts.cpu_share import Mailbox
    from runtime.experts.mailbox_clock import GpuClockSync
    from runtime.kernels import handoff_triton as hk

    dev = torch.device("cuda")
    resp = torch.zeros(1, dtype=torch.int64).pin_memory()
    n = args.pings
    times = torch.zeros(n, dtype=torch.int64, device=dev)
    rows = []
    sync = GpuClockSync(dev)                              # (both sides compiled before any ping)

    def round_trips():
        g, _ = sync.pings(n)
        return _stats(torch.from_numpy(g[n // 10:, 1] - g[n // 10:, 0]))     # (the first pings warm both up)

    def polls(programs=1, warps=1):
        resp.fill_(7)
        _poll_kernel[(programs,)](resp, times, n, num_warps=warps)
        torch.cuda.current_stream().synchronize()
        return _stats(times[n // 10:].cpu())

    box = Mailbox(max_tokens=1, top_k=8, hidden=2048, device=dev, share=0.5)
    out = torch.zeros(1, 2048, dtype=torch.bfloat16, device=dev)

    def collects(span=(1, 3), warps=4):
        box.ncpu.fill_(1)
        box.ticket.fill_(5)
        box.resp.fill_(5)
        spans = []
        for _ in range(200):
            hk.collect(out, box, warps=warps)
            t = box.times[5].tolist()                     # (a copy on this stream: after the collect)
            spans.append(t[span[1]] - t[span[0]])
        return _stats(torch.tensor(spans[20:]))

    from runtime.kernels.gather_triton import gather_blocks
    src = torch.randint(0, 255, (48, 2_506_752), dtype=torch.uint8).pin_memory()
    scratch = torch.empty((8, 2_506_752), dtype=torch.uint8, device=dev)
    eight = torch.randperm(48)[:8].view(1, 8).to(dev)

    round_trips(), polls(), collects()                   # compiles
    gather_blocks(src, eight, scratch)
    # the request's crossing alone (no worker): a store the CPU echo sees, on an idle link, and with the gather
    # launched right behind it (decode's handoff, then its misses' gather: 8 blocks, 20 MB)
    for name, then in (("a store, seen by the CPU", None),
                       ("the same, a gather behind", lambda: gather_blocks(src, eight, scratch))):
        try:
            ns = sync.one_way(200, then)[20:]                 # (the first stores warm both sides up)
            rows.append({"what": name, "beside": "idle", "load_gbps": None, **_stats(torch.from_numpy(ns))})
        except RuntimeError as exc:
            print(f"{name}: not measured - {exc}", flush=True)
    # polls of one word from many warps at once (collect's programs polled from every warp until session 19):
    # does each poll wait behind the others?
    for programs, warps in ((1, 4), (8, 2)):
        rows.append({"what": f"one poll, {programs * warps} warps", "beside": "idle", "load_gbps": None,
                     **polls(programs, warps)})
    loads = [(None, 0)] + [("gather", b) for b in args.load_blocks] + [("copy engine", args.load_blocks[0])]
    collect_rows = (("collect (answer there)", collects),
                    ("  its poll", lambda: collects(span=(1, 2))),
                    ("collect, one poller, 16 warps", lambda: collects(warps=16)),
                    ("  its poll", lambda: collects(span=(1, 2), warps=16)),
                    ("collect, every warp polls", lambda: collects(warps=0)),
                    ("  its poll", lambda: collects(span=(1, 2), warps=0)))
    for kind, blocks in loads:
        for name, fn in (("round trip", round_trips), ("one poll", polls), *collect_rows):
            stats, gbps = _with_load(kind, dev, fn, blocks=blocks)
            beside = "idle" if kind is None else kind if len(args.load_blocks) == 1 else f"{kind} {blocks * 2.5:g}MB"
            rows.append({"what": name, "beside": beside, "load_gbps": gbps, **stats})
    print(f"{'what':<28} {'beside':<18} {'load GB/s':>9} {'median µs':>9} {'p10':>7} {'p90':>7} {'max':>8}")
    for r in rows:
        g = "" if r["load_gbps"] is None else f"{r['load_gbps']:.1f}"
        print(f"{r['what']:<28} {r['beside']:<18} {g:>9} {r['median_us']:>9.2f} {r['p10_us']:>7.2f} "
              f"{r['p90_us']:>7.2f} {r['max_us']:>8.1f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
