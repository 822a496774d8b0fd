"""Cold load of the experts: `HostExpertStore.from_ftw(...).pinned_copy()` from a warm page cache (issue 10).

Targets: cold load to first token <= 15 s for a 20 GB package, peak host RSS <= package + 2 GiB. This script
builds a synthetic FTW expert file of the qwen3-30b-a3b block shape (int4, hidden 2048, expert FFN 768: one
2.53 MiB block per expert, 128 experts per layer) at the size asked, reads it once so the page cache is warm,
then times the copy into host memory of our own for each method and thread count, sampling the process's
RSS every 2 ms, and prints one row each:

    method    threads  allocate s  copy s  pin s  total s  GB/s  RSS before  peak RSS - before  after - before

Methods: `read` (readinto from the file, the default), `map` (copy out of the mapping, each chunk's mapped
pages released after), and `before` (what pinned_copy did before this change: one torch.empty(pin_memory=
pin) buffer -- rounded up to a power of two by torch's pinned allocator -- and one np.copyto per layer out of
the mapping, single-threaded, releasing each layer after).

    python benchmarks/bench_load.py --gib 20 --folder /scratch/ftw-load        # the GPU machine (pins)
    python benchmarks/bench_load.py --gib 1 --no-pin --threads 1 2             # this dev VM

The file is kept (pass --keep to reuse it on the next run: writing 20 GB takes a while); it needs that much
free disk and about twice its size in RAM (page cache + the copy).
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from runtime.experts.host_store import HostExpertStore, write_synthetic_ftw_experts  # noqa: E402
from runtime.experts.stats import PeakRSS, host_rss  # noqa: E402

GB, GiB = 1e9, 2 ** 30
HIDDEN, WIDTH, EXPERTS = 2048, 768, 128


def copy_before(store: HostExpertStore, *, pin: bool) -> HostExpertStore:
    """The pre-change pinned_copy: torch's pinned allocator, one single-threaded np.copyto per layer."""
    import torch

    owner = torch.empty((len(store.layers), store.num_experts, store.block_nbytes), dtype=torch.uint8,
                        pin_memory=pin)
    buf = owner.numpy()
    for i, layer in enumerate(store.layers):
        np.copyto(buf[i], store.layer_buffer(layer))
        store.release_pages(layer)
    return HostExpertStore({layer: buf[i] for i, layer in enumerate(store.layers)}, store.layout,
                           num_experts=store.num_experts, owner=owner)


def warm_page_cache(path: Path) -> float:
    """Read the whole file once (into a small reused buffer) so the timed copies see a warm page cache."""
    t0 = time.perf_counter()
    buf = bytearray(64 << 20)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=20 / 1.073741824, help="package size in GiB (default: 20 GB)")
    ap.add_argument("--folder", type=Path, default=Path(tempfile.gettempdir()) / "freetoken-load-bench")
    ap.add_argument("--keep", action="store_true", help="reuse an existing file of the right size")
    ap.add_argument("--methods", nargs="+", default=["before", "read", "map"], choices=["before", "read", "map"])
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 4, 8, 16])
    ap.add_argument("--no-pin", action="store_true", help="ordinary memory (machines without CUDA)")
    ap.add_argument("--experts", type=int, default=EXPERTS, help="experts per layer (fewer: tiny smoke runs)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    pin = not args.no_pin
    block = _block_nbytes()
    experts_per_layer = args.experts
    layers = max(1, round(args.gib * GiB / (experts_per_layer * block)))
    path = args.folder / "experts.bin"
    t0 = time.perf_counter()
    experts = write_synthetic_ftw_experts(args.folder, layers=layers, num_experts=experts_per_layer, hidden=HIDDEN,
                                          intermediate=WIDTH, codec="int4", reuse=args.keep)
    print(f"{path}: {layers} layers x {experts_per_layer} experts x {block} B = "
          f"{layers * experts_per_layer * block / GB:.2f} GB "
          f"(written or reused in {time.perf_counter() - t0:.1f} s)")
    nbytes = layers * experts_per_layer * block
    print(f"page cache warm-up read: {nbytes / warm_page_cache(path) / GB:.2f} GB/s")
    print(f"{'method':<7} {'threads':>7} {'alloc s':>8} {'copy s':>7} {'pin s':>6} {'total s':>8} {'GB/s':>6} "
          f"{'RSS GiB':>8} {'peak-before GiB':>16} {'after-before GiB':>17} {'package GiB':>12} pinned")
    rows = []
    for method in args.methods:
        for threads in ([1] if method == "before" else args.threads):
            store = HostExpertStore.from_ftw(experts)
            gc.collect()
            before = host_rss()
            with PeakRSS() as peak:
                t = time.perf_counter()
                copy = copy_before(store, pin=pin) if method == "before" else \
                    store.pinned_copy(pin=pin, method=method, threads=threads)
                total = time.perf_counter() - t
            after = host_rss()
            ls = getattr(copy, "load_seconds", {})
            row = {"method": method, "threads": threads, "allocate_s": ls.get("allocate"), "copy_s": ls.get("copy"),
                   "pin_s": ls.get("pin"), "total_s": total, "gbps": nbytes / total / GB, "rss_before": before,
                   "peak_minus_before": peak.peak - before, "after_minus_before": after - before,
                   "package": nbytes, "pinned": ls.get("pinned", pin)}
            rows.append(row)
            f = lambda v: "-" if v is None else f"{v:.2f}"      # noqa: E731
            print(f"{method:<7} {threads:>7} {f(row['allocate_s']):>8} {f(row['copy_s']):>7} {f(row['pin_s']):>6} "
                  f"{total:>8.2f} {row['gbps']:>6.2f} {before / GiB:>8.2f} {row['peak_minus_before'] / GiB:>16.2f} "
                  f"{row['after_minus_before'] / GiB:>17.2f} {nbytes / GiB:>12.2f} {row['pinned']}", flush=True)
            del copy, store
            gc.collect()
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1))
    return 0


def _block_nbytes() -> int:
    from runtime.experts.host_store import BlockLayout

    return BlockLayout.build("int4", HIDDEN, WIDTH, group=64).nbytes


if __name__ == "__main__":
    raise SystemExit(main())
