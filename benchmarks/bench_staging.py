"""How fast a pageable store's layers get to the GPU through the staging ring (runtime/experts/staging.py).

    python benchmarks/bench_staging.py [--model qwen3-30b-a3b] [--layers 8] [--threads 1 2 4 8] [--out st.json]

A store that is not page-locked (Windows pins about half the RAM; a RAM-short host) reaches the GPU by a host copy
into the ring's page-locked slots and a DMA from there. Rows, for a layer of the model's shape (all its experts,
as prefill streaming moves them):

  host copy   the ring's threads copying a layer from the pageable store into a slot (no GPU involved): GB/s
              by copy threads - the half of the trip that the CPU does
  staged      (GPU only) layers through stage_layer into two device buffers, back to back, as prefill does: GB/s
              end to end with the DMA overlapped
  pinned      (GPU only) the same layers from a page-locked store, DMA only: the rate a staged layer is held to
  promote     decode's promotions (`--blocks` experts a layer call): the decoding thread's µs to start them through
              `Transport.submit` (the ring's thread copies them) against copying them itself (`inline`, what it
              did before session 25): the time a host-driven decode call spends on them

On the dev VM (no GPU) the host-copy and promote rows run (there the "DMA" is a synchronous copy on the ring's
thread).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from runtime.experts.bench import SHAPES, _median_time  # noqa: E402  (the bench's shapes and its timing rule)

GB = 1e9


def _store(model: str, layers: int, pin: bool):
    from runtime.experts.host_store import HostExpertStore

    _, e, _, d, i, codec, group = SHAPES[model]
    return HostExpertStore.synthetic(layers=layers, num_experts=e, hidden=d, intermediate=i, codec=codec,
                                     group=group, pin=pin)


def host_copy_gbps(store, threads: int, repeats: int) -> float:
    from runtime.experts.staging import StagingRing

    ring = StagingRing(slots=2, entries_per_slot=store.num_experts, entry_nbytes=store.block_nbytes,
                       device=torch.device("cpu"), copy_threads=threads)
    slot = ring.buf[:store.num_experts].numpy()

    def copy_all():
        for layer in store.layers:
            ring.parallel_copy(slot, store.layer_buffer(layer))

    s = _median_time(copy_all, repeats=repeats, warmup=1)      # the warm-up starts the threads, touches the slot
    ring.close()
    return len(store.layers) * store.layer_buffer(store.layers[0]).nbytes / s / GB


def device_gbps(store, threads: int | None, repeats: int) -> float:
    """Layers into two alternating device buffers through a Transport (staged when the store is pageable)."""
    from runtime.experts.transport import Transport, ready_event

    dev = torch.device("cuda")
    transport = Transport(store, dev, copy_threads=threads)
    bufs = torch.empty((2, store.num_experts, store.block_nbytes), dtype=torch.uint8, device=dev)
    compute = torch.cuda.current_stream(dev)

    def all_layers():
        free = [None, None]
        for n, layer in enumerate(store.layers):
            b = n % 2
            handle = transport.submit_range(store.layer_buffer(layer), bufs[b], after=free[b])
            compute.wait_event(ready_event(handle))
            free[b] = compute.record_event()
        torch.cuda.synchronize(dev)

    s = _median_time(all_layers, repeats=repeats, warmup=1)
    transport.close()
    return len(store.layers) * store.layer_buffer(store.layers[0]).nbytes / s / GB


def promote_us(store, blocks: int, threads: int, repeats: int) -> tuple[float, float]:
    """µs on the caller's thread to start `blocks` promotions of one layer: through the ring (submit returns once
    they are queued) and inline (the caller copies each block into a page-locked entry itself, as before)."""
    from runtime.experts.transport import Transport, ready_event

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    transport = Transport(store, dev, staged=True, copy_threads=threads)
    pool = torch.empty((blocks, store.block_nbytes), dtype=torch.uint8, device=dev)
    entries = transport.ring.buf[:blocks].numpy()
    layers = iter(range(1 << 30))
    submitted, inline = [], []
    for _ in range(repeats + 1):                   # (the first of each: warm-up)
        src = store.layer_buffer(store.layers[next(layers) % len(store.layers)])
        t0 = time.perf_counter()
        handle = transport.submit([(src[e], pool[e]) for e in range(blocks)])
        submitted.append(time.perf_counter() - t0)
        ready_event(handle)                        # (not timed: the ring's thread, off the decoding thread)
        t0 = time.perf_counter()
        for e in range(blocks):
            np.copyto(entries[e], src[e])
        inline.append(time.perf_counter() - t0)
    transport.close()
    return 1e6 * statistics.median(submitted[1:]), 1e6 * statistics.median(inline[1:])


def main(argv: list[str] | None = None) -> int:
    from runtime.experts.staging import default_copy_threads

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-30b-a3b", choices=list(SHAPES))
    ap.add_argument("--layers", type=int, default=8, help="layers of the shape in the store (8: ~2.4 GB for int4)")
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2, 4, 8])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--blocks", type=int, default=3, help="promotions a layer call (8 MiB of qwen3-30b: 3)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)

    store = _store(args.model, args.layers, pin=False)
    layer_mb = store.layer_buffer(store.layers[0]).nbytes / 1e6
    print(f"{args.model}: {args.layers} layers of {layer_mb:.0f} MB, pageable; default copy threads "
          f"{default_copy_threads()}", flush=True)
    rows = []
    print(f"{'row':<12} {'threads':>7} {'GB/s':>7}")
    for t in args.threads:
        rows.append({"row": "host copy", "threads": t, "gbps": host_copy_gbps(store, t, args.repeats)})
        print(f"{'host copy':<12} {t:>7} {rows[-1]['gbps']:>7.1f}", flush=True)
    submitted, inline = promote_us(store, args.blocks, max(args.threads), max(20, args.repeats))
    rows += [{"row": "promote", "how": "ring", "blocks": args.blocks, "us": submitted},
             {"row": "promote", "how": "inline", "blocks": args.blocks, "us": inline}]
    print(f"promote {args.blocks} blocks, decoding thread's µs: through the ring {submitted:.0f}, inline {inline:.0f}",
          flush=True)
    if torch.cuda.is_available():
        for t in args.threads:
            rows.append({"row": "staged", "threads": t, "gbps": device_gbps(store, t, args.repeats)})
            print(f"{'staged':<12} {t:>7} {rows[-1]['gbps']:>7.1f}", flush=True)
        del store
        pinned = _store(args.model, args.layers, pin=True)
        rows.append({"row": "pinned", "threads": 0, "gbps": device_gbps(pinned, None, args.repeats)})
        print(f"{'pinned':<12} {'-':>7} {rows[-1]['gbps']:>7.1f}", flush=True)
    if args.out:
        out = args.out / "staging.json" if args.out.is_dir() else args.out
        out.write_text(json.dumps({"model": args.model, "layers": args.layers, "layer_mb": layer_mb, "rows": rows},
                                  indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
