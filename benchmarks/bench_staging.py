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

On the dev VM (no GPU) only the host-copy rows run.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

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


def main(argv: list[str] | None = None) -> int:
    from runtime.experts.staging import default_copy_threads

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-30b-a3b", choices=list(SHAPES))
    ap.add_argument("--layers", type=int, default=8, help="layers of the shape in the store (8: ~2.4 GB for int4)")
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2, 4, 8])
    ap.add_argument("--repeats", type=int, default=5)
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
