"""Where a traced decode step's GPU time goes: kernels by name and one layer's timeline (issue 10).

    python benchmarks/trace_summary.py TRACE.json.gz [--layer-kernel handoff] [--steps 2]

Reads a Chrome trace from `freetoken bench model --trace N` (torch.profiler; the kernels of a replayed CUDA graph
appear one by one) and prints, per step: each kernel name's count, median and total µs, and the GPU's idle time
(gaps between kernels); then a typical layer's kernels in order, each with the gap before it - what the critical
path of one layer is made of. A layer is cut at each kernel whose name contains --layer-kernel (the handoff to
the CPU worker, the first expert kernel of a zero-copy layer). Runs anywhere: it only reads the JSON.
"""
from __future__ import annotations

import argparse
import gzip
import json
import statistics
from collections import defaultdict


def kernels(path: str) -> list[tuple[float, float, str]]:
    """(start µs, duration µs, name) of every GPU kernel in the trace, in start order."""
    with gzip.open(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    out = [(float(e["ts"]), float(e.get("dur", 0.0)), e["name"]) for e in events
           if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    return sorted(out)


def short(name: str, n: int = 48) -> str:
    name = name.split("(")[0].replace("void ", "")
    return name if len(name) <= n else name[:n - 1] + "…"


def summarize(ks: list[tuple[float, float, str]], steps: int, layer_kernel: str) -> str:
    lines = []
    busy = sum(d for _, d, _ in ks)
    span = ks[-1][0] + ks[-1][1] - ks[0][0]
    lines.append(f"{len(ks)} kernels over {span / 1e3:.2f} ms ({steps} steps): busy {busy / 1e3:.2f} ms, "
                 f"idle between kernels {(span - busy) / 1e3:.2f} ms")
    by = defaultdict(list)
    for _, d, name in ks:
        by[short(name)].append(d)
    lines.append(f"{'kernel':<48} {'a step':>7} {'median µs':>9} {'µs a step':>9}")
    for name, ds in sorted(by.items(), key=lambda kv: -sum(kv[1]))[:18]:
        lines.append(f"{name:<48} {len(ds) / steps:>7.1f} {statistics.median(ds):>9.1f} {sum(ds) / steps:>9.1f}")
    cuts = [i for i, (_, _, name) in enumerate(ks) if layer_kernel in name]
    if len(cuts) >= 3:
        # the layer whose period (its layer kernel to the next one's) is the median: a typical one, not a
        # step's first or last (their periods hold the host's gap between steps)
        periods = sorted((ks[c2][0] - ks[c1][0], i) for i, (c1, c2) in enumerate(zip(cuts, cuts[1:])))
        period, mid = periods[len(periods) // 2]
        a, b = cuts[mid], cuts[mid + 1]
        lines.append(f"a typical layer ({b - a} kernels, {period:.1f} µs from its {layer_kernel} to the next, "
                     f"the median over layers):")
        # one period: this layer's expert kernels from its handoff, then the next layer's dense ones
        prev_end = ks[a - 1][0] + ks[a - 1][1]
        for t, d, name in ks[a:b]:
            lines.append(f"  {'gap ' + format(t - prev_end, '.1f'):>10}  {d:>7.1f}  {short(name, 70)}")
            prev_end = max(prev_end, t + d)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace")
    p.add_argument("--layer-kernel", default="handoff")
    p.add_argument("--steps", type=int, default=2)
    args = p.parse_args(argv)
    print(summarize(kernels(args.trace), args.steps, args.layer_kernel))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
